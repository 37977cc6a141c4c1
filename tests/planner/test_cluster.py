"""Cluster descriptions: built-ins, links, heterogeneous groups, bandwidth matrices, and bad files."""

import copy

import pytest

from megatron_bmw.errors import UsageError
from megatron_bmw.planner.cluster import BUILTIN, load_cluster, parse_cluster

V100 = {"memory_gb": 16, "peak_tflops": {"fp32": 15.7, "fp16": 125}}
T4 = {"memory_gb": 15, "peak_tflops": {"fp32": 8.1, "fp16": 65}}


def _hetero() -> dict:
    return copy.deepcopy({
        "name": "hetero",
        "device_types": {"v100": V100, "t4": T4},
        "groups": [
            {"nodes": 3, "gpus_per_node": 4, "device": "v100", "intra_node": {"bandwidth_GBps": 45, "latency_us": 8}},
            {"nodes": 1, "gpus_per_node": 4, "device": "t4", "intra_node": {"bandwidth_GBps": 6.25}},
        ],
        "inter_node": {"bandwidth_GBps": 1.25, "latency_us": 30},
    })


@pytest.mark.parametrize("name", BUILTIN)
def test_builtins_load(name):
    c = load_cluster(name)
    assert c.num_gpus >= 1
    for g in c.groups:
        assert g.device.memory_bytes > 0 and g.device.peak_flops


def test_num_nodes_resizes_and_links():
    c = load_cluster("a100-80g-ib", num_nodes=4)
    assert (c.num_gpus, c.num_nodes) == (32, 4)
    nvlink, ib = c.link(0, 7), c.link(7, 8)
    assert nvlink.bandwidth == pytest.approx(230e9) and ib.bandwidth == pytest.approx(23e9)
    assert c.slowest_link([0, 1, 8]).bandwidth == ib.bandwidth
    assert load_cluster("h100-80g-ib").device(0).peak("bf16") == pytest.approx(989e12)


def test_rings_use_the_nics_of_their_gpus_on_each_node():
    """One NIC per GPU (DGX-style): a data-parallel ring with k GPUs per node leaves each node over k NICs, capped
    by NVLink; one NIC per node: the node's GPUs share it; no NIC count: the link whatever the GPUs per node."""
    dgx = load_cluster("a100-80g-ib", num_nodes=4)
    ib = dgx.inter_node.bandwidth
    assert dgx.slowest_link([0, 8, 16, 24]).bandwidth == pytest.approx(ib)  # tp 8: one GPU per node
    assert dgx.slowest_link([0, 4, 8, 12]).bandwidth == pytest.approx(2 * ib)  # tp 4: two
    assert dgx.slowest_link(list(range(32))).bandwidth == pytest.approx(min(8 * ib, 230e9))  # tp 1: NVLink caps
    shared = _hetero()
    shared["groups"][0]["nics_per_node"] = 1
    c = parse_cluster(shared)
    assert c.slowest_link([0, 4, 8]).bandwidth == pytest.approx(1.25e9 / 4)  # tp 4: four rings share the NIC
    assert c.slowest_link([0, 1, 4, 5]).bandwidth == pytest.approx(1.25e9 / 2)
    assert c.slowest_link([0, 1, 2, 3, 4, 5, 6, 7]).bandwidth == pytest.approx(1.25e9)
    assert c.slowest_link([0, 1, 2, 3, 12]).bandwidth == pytest.approx(1.25e9)  # the t4 group gives no NIC count
    assert parse_cluster(_hetero()).slowest_link([0, 4, 8]).bandwidth == pytest.approx(1.25e9)


def test_concurrent_transfers_share_a_nodes_nics():
    """A stage's replicas send to the next stage at once: on a node with one NIC they share it, on DGX-style
    nodes each has its own; within a node nothing is shared."""
    shared = _hetero()
    shared["groups"][0]["nics_per_node"] = 1
    c = parse_cluster(shared)
    assert c.concurrent_link([(0, 4), (1, 5), (2, 6), (3, 7)]).bandwidth == pytest.approx(1.25e9 / 4)
    assert c.concurrent_link([(0, 4), (1, 5)]).bandwidth == pytest.approx(1.25e9 / 2)
    assert c.concurrent_link([(0, 4)]).bandwidth == pytest.approx(1.25e9)
    assert c.concurrent_link([(0, 1), (2, 3)]).bandwidth == pytest.approx(45e9)
    assert parse_cluster(_hetero()).concurrent_link([(0, 4), (1, 5)]).bandwidth == pytest.approx(1.25e9)
    dgx = load_cluster("a100-80g-ib", num_nodes=2)
    assert dgx.concurrent_link([(g, g + 8) for g in range(8)]).bandwidth == pytest.approx(23e9)


def test_heterogeneous_groups():
    c = parse_cluster(_hetero())
    assert c.num_gpus == 16
    assert c.device(11).name == "v100" and c.device(12).name == "t4"
    assert c.link(12, 13).bandwidth == pytest.approx(6.25e9)
    assert c.link(0, 12).bandwidth == pytest.approx(1.25e9)
    assert c.link(0, 1).latency == pytest.approx(8e-6)


def test_bandwidth_matrix_overrides_links():
    data = {"device_types": {"t4": T4},
            "groups": [{"nodes": 1, "gpus_per_node": 3, "device": "t4", "intra_node": {"bandwidth_GBps": 10}}],
            "inter_node": {"bandwidth_GBps": 1}, "bandwidth_matrix_GBps": [[0, 5, 1], [5, 0, 2], [1, 2, 0]],
            "matrix_latency_us": 3}
    c = parse_cluster(data)
    assert c.link(0, 1).bandwidth == pytest.approx(5e9) and c.link(2, 0).bandwidth == pytest.approx(1e9)
    assert c.link(1, 2).latency == pytest.approx(3e-6)
    assert c.slowest_link([0, 1, 2]).bandwidth == pytest.approx(1e9)


@pytest.mark.parametrize("mutate,match", [
    (lambda d: d.pop("inter_node"), "missing 'inter_node'"),
    (lambda d: d["groups"][0].update(device="a100"), "device 'a100' is not one of device_types"),
    (lambda d: d["groups"][0].pop("device"), "missing 'device'"),
    (lambda d: d["groups"][0].update(nodes=0), "'nodes' must be an integer >= 1"),
    (lambda d: d["groups"][0].update(nics_per_node=0.5), "'nics_per_node' must be an integer >= 1"),
    (lambda d: d["device_types"]["v100"].update(memory_gb=-1), "'memory_gb' must be a positive number"),
    (lambda d: d["device_types"]["v100"]["peak_tflops"].update(fp8=1), "unknown dtype 'fp8'"),
    (lambda d: d.update(bandwidth_matrix_GBps=[[0, 1]]), "must be 16 rows of 16 numbers"),
    (lambda d: d.update(colour="red"), "unknown key 'colour'"),
    (lambda d: d["groups"][1]["intra_node"].update(bandwidth_GBps="fast"), "'bandwidth_GBps' must be a positive"),
])
def test_bad_descriptions_give_one_line(mutate, match):
    data = _hetero()
    mutate(data)
    with pytest.raises(UsageError, match=match) as err:
        parse_cluster(data, "c.yaml")
    assert "\n" not in str(err.value) and str(err.value).startswith("c.yaml")


def test_bad_files(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("groups: [\n")
    with pytest.raises(UsageError, match="not valid YAML"):
        load_cluster(str(bad))
    with pytest.raises(UsageError, match="not a built-in cluster"):
        load_cluster("no-such-cluster")
    with pytest.raises(UsageError, match="has 2 node groups"):
        load_cluster("amp-heterogeneous", num_nodes=3)
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n")
    with pytest.raises(UsageError, match="expected a mapping"):
        load_cluster(str(lst))


def test_unreadable_files_are_one_line(tmp_path):
    with pytest.raises(UsageError, match=r"^--cluster .*: is a directory, not a cluster file$"):
        load_cluster(str(tmp_path))
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(UsageError, match=r"^--cluster .*bin.yaml: not a text file$"):
        load_cluster(str(binary))


def test_numbers_in_exponent_form(tmp_path):
    """1e2 (no dot, as JSON writes small and large numbers) is a number, as YAML 1.2 reads it, not a string."""
    path = tmp_path / "sci.yaml"
    path.write_text("device_types:\n  g: {memory_gb: 1.6e1, peak_tflops: {fp32: 15.7, fp16: 125}}\n"
                    "groups:\n  - {nodes: 1, gpus_per_node: 4, device: g, intra_node: {bandwidth_GBps: 1.5E2, "
                    "latency_us: 5e0}}\ninter_node: {bandwidth_GBps: 1e2, latency_us: 3e1}\n")
    cluster = load_cluster(str(path))
    assert cluster.inter_node.bandwidth == pytest.approx(100e9) and cluster.inter_node.latency == pytest.approx(30e-6)
    assert cluster.groups[0].intra_node.bandwidth == pytest.approx(150e9)
    assert cluster.groups[0].device.memory_bytes == 16 * 2**30  # memory_gb counts GiB


def test_a_measured_bus_bandwidth_is_what_every_ring_gets():
    """--inter-node-bus-bandwidth: the measurement holds the NIC sharing, so every ring crossing nodes gets it
    whatever its GPUs per node; --intra-node-bus-bandwidth replaces the NVLink figure."""
    from megatron_bmw.config.planner import PlannerConfig
    from megatron_bmw.planner_args import measured_links

    dgx = load_cluster("a100-80g-ib", num_nodes=4)
    jz = measured_links(PlannerConfig(inter_node_bus_bandwidth=5.06, intra_node_bus_bandwidth=100.0), dgx)
    for ranks in ([0, 8, 16, 24], [0, 4, 8, 12], list(range(32))):
        assert jz.slowest_link(ranks).bandwidth == pytest.approx(5.06e9)
    assert jz.slowest_link(list(range(8))).bandwidth == pytest.approx(100e9)
    assert jz.inter_node.latency == dgx.inter_node.latency
    assert measured_links(PlannerConfig(), dgx) is dgx
