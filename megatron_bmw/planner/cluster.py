"""Cluster descriptions: device types, groups of nodes, links between GPUs.

A cluster is one or more groups of identical nodes (AMP's heterogeneous setting: e.g. 3 nodes of 4 V100 on
NVLink plus 1 node of 4 T4). GPUs are numbered node by node in group order. The link between two GPUs is the
group's intra-node link when they share a node, else the inter-node link (the slower of the two ends when
groups set their own), unless an explicit per-pair bandwidth matrix says otherwise.

YAML (bandwidths in GB/s = 1e9 bytes/s, latencies in microseconds, memory in GiB, peaks in TFLOP/s):

    name: my-cluster
    device_types:
      v100: {memory_gb: 16, peak_tflops: {fp32: 15.7, fp16: 125}, compute_capability: 7.0, nccl_channels: 8}
    groups:
      - {nodes: 3, gpus_per_node: 4, device: v100, intra_node: {bandwidth_GBps: 150, latency_us: 5}}
    inter_node: {bandwidth_GBps: 1.25, latency_us: 30}
    bandwidth_matrix_GBps: [[...], ...]   # optional, one row per GPU

A group may say `nics_per_node`: its inter-node link is then one NIC of that many (DGX-style nodes: one per GPU),
and a ring collective (a data- or tensor-parallel group) with k of its GPUs on a node moves its traffic off that
node over nics x k / gpus_per_node of them: NCCL runs one channel per NIC and a ring leaves each node once, while
the node's other GPUs, in groups of the same kind, use the rest; a pipeline stage's replicas sending to the next
stage at once share them the same way (concurrent_link). Without it the inter-node link is what any ring or
transfer crossing nodes gets, whatever its GPUs per node (right where something per connection, not the NICs,
limits it: BLOOM's Jean Zay, benchmarks/bloom_trials.py).

A device type may state what the CUDA allowance (cuda_allowance.py) needs: `cuda_context_gb` (the CUDA context),
`compute_capability` (cuBLAS workspace sizes follow the architecture) and `nccl_channels` (NCCL's collective
channels on these nodes); without them it takes its defaults.

CPU ranks share the cores of their node: a group's optional `cores_per_node` says how many (the built-in `local`
cluster and the local cluster built from a CPU profile default to this machine's os.cpu_count()). When more ranks of
a node compute at once than it has cores, the cost model stretches their compute (see cost_model.py). Without
it every rank has a device of its own (GPUs), as before.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from importlib import resources

import yaml

from ..config.planner import BUILTIN_CLUSTERS
from ..errors import UsageError
from .files import read_text

DTYPES = ("fp32", "tf32", "bf16", "fp16")
GB = 1e9


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s
    latency: float  # s

    def time(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth


@dataclass(frozen=True)
class DeviceType:
    name: str
    memory_bytes: float
    peak_flops: dict[str, float]  # per dtype name, FLOP/s
    memory_bandwidth: float | None = None  # bytes/s, optional
    achievable_fraction: float | None = None  # of peak FLOP/s that large matrix multiplications reach, optional
    sm_count: int | None = None  # streaming multiprocessors: analytic unit times follow GEMM shapes (kernel_time.py)
    # the CUDA allowance's inputs (cuda_allowance.py): context bytes, architecture (cuBLAS workspace sizes),
    # NCCL's collective channels on these nodes
    cuda_context_bytes: float | None = None
    compute_capability: float | None = None
    nccl_channels: int | None = None
    # the optimizer step as a CPU profile measured it (training/optimizer_time.py), instead of the bandwidth's
    optimizer_bytes_per_s: float | None = None
    optimizer_fixed_s: float = 0.0

    def peak(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            have = ", ".join(sorted(self.peak_flops)) or "none"
            raise UsageError(f"device type {self.name} has no peak FLOP/s for {dtype} (has {have})")
        return self.peak_flops[dtype]


@dataclass(frozen=True)
class NodeGroup:
    nodes: int
    gpus_per_node: int
    device: DeviceType
    intra_node: Link
    inter_node: Link | None = None  # this group's network interface, if it differs from the cluster's
    cores_per_node: int | None = None  # CPU ranks share this many cores per node; None: a device per rank
    nics_per_node: int | None = None  # the inter-node link is one of this many NICs; None: what any ring gets

    def ring_share(self, gpus_on_node: int) -> float:
        """How many inter-node links' worth a ring collective with `gpus_on_node` of its ranks on one of these
        nodes moves off that node: NCCL runs a channel per NIC and leaves the node once per ring, and the node's
        NICs are shared by its GPUs, all of them in some group of the same kind at once (the tp peers of a
        data-parallel group reduce together): nics x gpus_on_node / gpus_per_node. Without nics_per_node the
        link is what any ring crossing nodes gets (1)."""
        if self.nics_per_node is None:
            return 1.0
        return self.nics_per_node * gpus_on_node / self.gpus_per_node


@dataclass(frozen=True)
class Cluster:
    name: str
    groups: tuple[NodeGroup, ...]
    inter_node: Link
    bandwidth_matrix: tuple[tuple[float, ...], ...] | None = None  # bytes/s per GPU pair
    matrix_latency: float = 0.0
    source: str = ""
    measured: dict = field(default_factory=dict, compare=False)

    @property
    def num_gpus(self) -> int:
        return sum(g.nodes * g.gpus_per_node for g in self.groups)

    @property
    def num_nodes(self) -> int:
        return sum(g.nodes for g in self.groups)

    def locate(self, gpu: int) -> tuple[NodeGroup, int]:
        """(group, global node index) of a GPU."""
        if not 0 <= gpu < self.num_gpus:
            raise UsageError(f"GPU {gpu} is outside cluster {self.name} ({self.num_gpus} GPUs)")
        node = 0
        for g in self.groups:
            size = g.nodes * g.gpus_per_node
            if gpu < size:
                return g, node + gpu // g.gpus_per_node
            gpu -= size
            node += g.nodes
        raise AssertionError("unreachable")

    def node_cores(self, gpu: int) -> tuple[int, int | None]:
        """(global node index, cores its ranks share or None) of a GPU (a CPU rank)."""
        group, node = self.locate(gpu)
        return node, group.cores_per_node

    @property
    def shares_cores(self) -> bool:
        return any(g.cores_per_node is not None for g in self.groups)

    def device(self, gpu: int) -> DeviceType:
        return self.locate(gpu)[0].device

    def device_type(self, name: str) -> DeviceType | None:
        """The device type called `name` in one of the groups, or None."""
        return next((g.device for g in self.groups if g.device.name == name), None)

    def devices_of(self, gpus) -> list[DeviceType]:
        """The distinct device types among `gpus`."""
        if len(self.groups) == 1:
            return [self.groups[0].device]
        return list({id(d): d for d in (self.device(g) for g in gpus)}.values())

    def link(self, a: int, b: int) -> Link:
        """The link between GPUs a and b."""
        ga, na = self.locate(a)
        gb, nb = self.locate(b)
        if self.bandwidth_matrix is not None:
            return Link(self.bandwidth_matrix[a][b], self.matrix_latency)
        if na == nb:
            return ga.intra_node
        ends = [g.inter_node or self.inter_node for g in (ga, gb)]
        return Link(min(x.bandwidth for x in ends), max(x.latency for x in ends))

    def slowest_link(self, gpus: list[int]) -> Link:
        """The link a ring collective over `gpus` runs at: its slowest pair (AMP's rule), where a node's share of
        the network grows with the ring's GPUs on it when the node's NICs are described (NodeGroup.ring_share);
        with the largest latency."""
        if len(gpus) < 2:
            return Link(float("inf"), 0.0)
        if self.bandwidth_matrix is not None:
            links = [self.link(a, b) for i, a in enumerate(gpus) for b in gpus[i + 1:]]
        else:  # pairs differ only by node: the intra-node links of shared nodes, each node's way off it between
            per_node: dict[int, list] = {}
            for g in gpus:
                group, node = self.locate(g)
                per_node.setdefault(node, [group, 0])[1] += 1
            links = [group.intra_node for group, count in per_node.values() if count > 1]
            if len(per_node) > 1:
                for group, count in per_node.values():
                    end = group.inter_node or self.inter_node
                    links.append(Link(end.bandwidth * group.ring_share(count), end.latency))
        return Link(min(x.bandwidth for x in links), max(x.latency for x in links))

    def concurrent_link(self, pairs: list[tuple[int, int]]) -> Link:
        """The link each (src, dst) pair gets when all of `pairs` transfer at once (a pipeline stage's replicas
        sending to the next stage's): its own link, where a node's inter-node transfers out of (or into) it are more
        than its NICs (nics_per_node) they share them; with the largest latency."""
        if not pairs:
            return Link(float("inf"), 0.0)
        if self.bandwidth_matrix is not None:
            links = [self.link(a, b) for a, b in pairs]
            return Link(min(x.bandwidth for x in links), max(x.latency for x in links))
        out: dict[int, int] = {}
        into: dict[int, int] = {}
        where = {g: self.locate(g) for pair in pairs for g in pair}
        for a, b in pairs:
            if where[a][1] != where[b][1]:
                out[where[a][1]] = out.get(where[a][1], 0) + 1
                into[where[b][1]] = into.get(where[b][1], 0) + 1
        bandwidth, latency = float("inf"), 0.0
        for a, b in pairs:
            link = self.link(a, b)
            (ga, na), (gb, nb) = where[a], where[b]
            share = 1.0
            if na != nb:
                for group, count in ((ga, out[na]), (gb, into[nb])):
                    if group.nics_per_node is not None and count > group.nics_per_node:
                        share = min(share, group.nics_per_node / count)
            bandwidth, latency = min(bandwidth, link.bandwidth * share), max(latency, link.latency)
        return Link(bandwidth, latency)

    def with_nodes(self, num_nodes: int) -> Cluster:
        """The same cluster with `num_nodes` nodes (single-group clusters only)."""
        if num_nodes < 1:
            raise UsageError(f"--num-nodes must be >= 1, got {num_nodes}")
        if len(self.groups) != 1:
            raise UsageError(f"--num-nodes: cluster {self.name} has {len(self.groups)} node groups; "
                             "edit its YAML file to size each group")
        if self.bandwidth_matrix is not None:
            raise UsageError(f"--num-nodes: cluster {self.name} has an explicit bandwidth matrix for "
                             f"{self.num_gpus} GPUs; edit its YAML file instead")
        return replace(self, groups=(replace(self.groups[0], nodes=num_nodes),))


    def with_bus_bandwidth(self, inter_node: float | None = None, intra_node: float | None = None) -> Cluster:
        """The same cluster with measured NCCL bus bandwidths in bytes/s (nccl-tests' busbw, or a measured
        all-reduce's 2(n-1)/n x bytes / time): `inter_node` is what every ring crossing nodes gets, whatever its
        GPUs per node (the groups' NIC sharing is what the measurement already holds, so it is dropped);
        `intra_node` each group's link inside a node. Latencies stay the cluster's."""
        if self.bandwidth_matrix is not None and (inter_node or intra_node):
            raise UsageError(f"--inter-node-bus-bandwidth/--intra-node-bus-bandwidth: cluster {self.name} has an "
                             "explicit bandwidth matrix; edit its YAML file instead")
        groups = []
        for g in self.groups:
            if inter_node is not None:
                g = replace(g, nics_per_node=None,
                            inter_node=None if g.inter_node is None else Link(inter_node, g.inter_node.latency))
            if intra_node is not None:
                g = replace(g, intra_node=Link(intra_node, g.intra_node.latency))
            groups.append(g)
        inter = self.inter_node if inter_node is None else Link(inter_node, self.inter_node.latency)
        return replace(self, groups=tuple(groups), inter_node=inter)


# ---- loading -------------------------------------------------------------------------------------------------
BUILTIN = BUILTIN_CLUSTERS


def builtin_names() -> tuple[str, ...]:
    return BUILTIN


class _Loader(yaml.SafeLoader):
    """YAML 1.1 as PyYAML reads it, but 1e2 and 5e-06 (no dot; JSON writes such numbers) are numbers, as in YAML
    1.2, not strings."""


_Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
                              list("-+0123456789"))


def load_cluster(name_or_path: str, num_nodes: int | None = None) -> Cluster:
    """A built-in cluster by name, or a YAML file; `num_nodes` resizes a single-group cluster."""
    if name_or_path in BUILTIN:
        text = resources.files(__package__).joinpath("clusters", f"{name_or_path}.yaml").read_text()
        where = f"built-in cluster {name_or_path}"
    elif os.path.exists(name_or_path):
        text = read_text(name_or_path, "--cluster", "cluster file")
        where = name_or_path
    else:
        raise UsageError(f"--cluster {name_or_path}: not a built-in cluster ({', '.join(BUILTIN)}) "
                         "and no such file")
    try:
        data = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise UsageError(f"--cluster {where}: not valid YAML{at}") from None
    cluster = parse_cluster(data, where)
    if name_or_path == "local" and cluster.groups[0].cores_per_node is None:  # this machine's cores
        cluster = replace(cluster, groups=(replace(cluster.groups[0], cores_per_node=os.cpu_count() or 1),))
    return cluster.with_nodes(num_nodes) if num_nodes is not None else cluster


def parse_cluster(data, where: str = "cluster") -> Cluster:
    """Validate a cluster description (a dict, as loaded from YAML)."""
    if not isinstance(data, dict):
        raise UsageError(f"{where}: expected a mapping with device_types, groups and inter_node")
    _only(data, {"name", "device_types", "groups", "inter_node", "bandwidth_matrix_GBps", "matrix_latency_us",
                 "description"}, where)
    types_raw = _need(data, "device_types", dict, where)
    types = {name: _device_type(name, spec, f"{where}: device_types.{name}") for name, spec in types_raw.items()}
    if not types:
        raise UsageError(f"{where}: device_types is empty")
    groups_raw = _need(data, "groups", list, where)
    if not groups_raw:
        raise UsageError(f"{where}: groups is empty")
    groups = tuple(_group(g, types, f"{where}: groups[{i}]") for i, g in enumerate(groups_raw))
    inter = _link(_need(data, "inter_node", dict, where), f"{where}: inter_node")
    cluster = Cluster(name=str(data.get("name", where)), groups=groups, inter_node=inter, source=where)
    matrix = data.get("bandwidth_matrix_GBps")
    if matrix is not None:
        n = cluster.num_gpus
        if not isinstance(matrix, list) or len(matrix) != n or any(not isinstance(r, list) or len(r) != n
                                                                   for r in matrix):
            raise UsageError(f"{where}: bandwidth_matrix_GBps must be {n} rows of {n} numbers (one per GPU)")
        rows = []
        for i, row in enumerate(matrix):
            for j, x in enumerate(row):
                if i != j and not (_is_number(x) and x > 0):
                    raise UsageError(f"{where}: bandwidth_matrix_GBps[{i}][{j}] must be a positive number, got {x!r}")
            rows.append(tuple(float(x) * GB if i != j else float("inf") for j, x in enumerate(row)))
        latency = data.get("matrix_latency_us", 0.0)
        if not (_is_number(latency) and latency >= 0):
            raise UsageError(f"{where}: matrix_latency_us must be a number >= 0, got {latency!r}")
        cluster = replace(cluster, bandwidth_matrix=tuple(rows), matrix_latency=float(latency) * 1e-6)
    return cluster


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _only(data: dict, allowed: set[str], where: str) -> None:
    extra = sorted(set(data) - allowed)
    if extra:
        raise UsageError(f"{where}: unknown key {extra[0]!r} (allowed: {', '.join(sorted(allowed))})")


def _need(data: dict, key: str, kind: type, where: str):
    if key not in data:
        raise UsageError(f"{where}: missing {key!r}")
    value = data[key]
    if not isinstance(value, kind):
        raise UsageError(f"{where}: {key!r} must be a {'mapping' if kind is dict else kind.__name__}")
    return value


def _positive(data: dict, key: str, where: str, default=None, allow_zero: bool = False) -> float:
    if key not in data:
        if default is None:
            raise UsageError(f"{where}: missing {key!r}")
        return default
    x = data[key]
    if not _is_number(x) or x < 0 or (x == 0 and not allow_zero):
        raise UsageError(f"{where}: {key!r} must be a {'non-negative' if allow_zero else 'positive'} number, got {x!r}")
    return float(x)


def _device_type(name: str, spec, where: str) -> DeviceType:
    if not isinstance(spec, dict):
        raise UsageError(f"{where}: expected a mapping with memory_gb and peak_tflops")
    _only(spec, {"memory_gb", "peak_tflops", "memory_bandwidth_GBps", "achievable_fraction", "sm_count",
                 "cuda_context_gb", "compute_capability", "nccl_channels"}, where)
    memory = _positive(spec, "memory_gb", where) * 2**30
    peaks_raw = _need(spec, "peak_tflops", dict, where)
    peaks = {}
    for dtype, value in peaks_raw.items():
        if dtype not in DTYPES:
            raise UsageError(f"{where}: peak_tflops has unknown dtype {dtype!r} (use {', '.join(DTYPES)})")
        peaks[dtype] = _positive(peaks_raw, dtype, f"{where}.peak_tflops") * 1e12
    bw = spec.get("memory_bandwidth_GBps")
    fraction = spec.get("achievable_fraction")
    if fraction is not None and not (_is_number(fraction) and 0 < fraction <= 1):
        raise UsageError(f"{where}: 'achievable_fraction' must be a number in (0, 1], got {fraction!r}")
    sms = spec.get("sm_count")
    if sms is not None and not (isinstance(sms, int) and not isinstance(sms, bool) and sms >= 1):
        raise UsageError(f"{where}: 'sm_count' must be a positive integer, got {sms!r}")
    channels = spec.get("nccl_channels")
    if channels is not None and not (isinstance(channels, int) and not isinstance(channels, bool) and channels >= 1):
        raise UsageError(f"{where}: 'nccl_channels' must be a positive integer, got {channels!r}")
    context = spec.get("cuda_context_gb")
    cc = spec.get("compute_capability")
    return DeviceType(name, memory, peaks, _positive(spec, "memory_bandwidth_GBps", where) * GB if bw is not None else None,
                      float(fraction) if fraction is not None else None, sms,
                      _positive(spec, "cuda_context_gb", where, allow_zero=True) * 2**30 if context is not None else None,
                      _positive(spec, "compute_capability", where) if cc is not None else None, channels)


def _link(spec, where: str) -> Link:
    if not isinstance(spec, dict):
        raise UsageError(f"{where}: expected a mapping with bandwidth_GBps and latency_us")
    _only(spec, {"bandwidth_GBps", "latency_us"}, where)
    return Link(_positive(spec, "bandwidth_GBps", where) * GB,
                _positive(spec, "latency_us", where, default=0.0, allow_zero=True) * 1e-6)


def _group(spec, types: dict[str, DeviceType], where: str) -> NodeGroup:
    if not isinstance(spec, dict):
        raise UsageError(f"{where}: expected a mapping with nodes, gpus_per_node, device and intra_node")
    _only(spec, {"nodes", "gpus_per_node", "device", "intra_node", "inter_node", "cores_per_node", "nics_per_node"},
          where)
    counts = {}
    for key in ("nodes", "gpus_per_node", "cores_per_node", "nics_per_node"):
        if key in ("cores_per_node", "nics_per_node") and key not in spec:
            continue
        x = spec.get(key)
        if not isinstance(x, int) or isinstance(x, bool) or x < 1:
            raise UsageError(f"{where}: {key!r} must be an integer >= 1, got {x!r}")
        counts[key] = x
    device = spec.get("device")
    if device is None:
        raise UsageError(f"{where}: missing 'device' (one of device_types: {', '.join(types)})")
    if device not in types:
        raise UsageError(f"{where}: device {device!r} is not one of device_types ({', '.join(types)})")
    intra = _link(_need(spec, "intra_node", dict, where), f"{where}.intra_node")
    inter = _link(spec["inter_node"], f"{where}.inter_node") if "inter_node" in spec else None
    return NodeGroup(counts["nodes"], counts["gpus_per_node"], types[device], intra, inter,
                     counts.get("cores_per_node"), counts.get("nics_per_node"))


def local_cluster(gpus: int, device: DeviceType, p2p: Link, allreduce: Link | None = None,
                  cores: int | None = None) -> Cluster:
    """One node of `gpus` identical devices joined by the measured link (the `local` cluster, filled in from a
    profile). The all-reduce link, when measured separately, is kept in `measured`. `cores`: CPU ranks share
    this many cores (None: GPUs, a device each)."""
    group = NodeGroup(1, gpus, device, p2p, cores_per_node=cores)
    measured = {"allreduce": allreduce} if allreduce is not None else {}
    return Cluster("local", (group,), p2p, source="local (measured)", measured=measured)
