"""The derived CUDA allowance: each term by hand, their precedence, and the profile's measured terms."""


import pytest

from megatron_bmw.config import ModelConfig
from megatron_bmw.config.planner import PlannerConfig
from megatron_bmw.planner.cluster import load_cluster
from megatron_bmw.planner.cuda_allowance import (DerivedAllowance, MeasuredCudaMemory, allocator_fraction,
                                                 allowance_terms, block_overhead, cublas_workspace_bytes, segment_tails,
                                                 nccl_bytes, nccl_communicators)
from megatron_bmw.planner.engine import PrecisionConfig
from megatron_bmw.planner.memory_model import MemorySettings
from megatron_bmw.planner.profile_data import MODEL_KEYS, Profile, Profiles
from megatron_bmw.planner_args import memory_settings
from megatron_bmw.training import cuda_memory

MiB, GiB = 2**20, 2**30
A100 = load_cluster("a100-80g-ib").groups[0].device
H100 = load_cluster("h100-80g-ib").groups[0].device
T4 = load_cluster("aws-g4dn.12xlarge").groups[0].device
MODEL = ModelConfig(num_layers=4, hidden_size=1024, num_attention_heads=16, vocab_size=1024, seq_length=1024,
                    params_dtype="bf16")


def test_allocator_rounding_and_segments():
    assert block_overhead(1) == 511 and block_overhead(512) == 0 and block_overhead(MiB) == 0
    assert block_overhead(MiB + 1) == pytest.approx(511 + (20 * MiB - 19 * (MiB + 512)) / 19)
    assert block_overhead(6 * MiB) == pytest.approx(2 * MiB / 3)  # 3 per 20 MiB segment, 2 MiB left
    assert block_overhead(8 * MiB) == 2 * MiB  # 2 per segment, 4 MiB left
    assert block_overhead(10 * MiB) == 0 and block_overhead(11 * MiB) == MiB  # own segment, 2 MiB steps
    assert block_overhead(10 * MiB + 1) == 2 * MiB - 1
    assert allocator_fraction([(512, 3)]) == 0
    # 6 MiB alone: 3 per segment, 2 MiB tail; 11 MiB: 1 MiB rounding
    assert allocator_fraction([(6 * MiB, 3), (11 * MiB, 1)]) == pytest.approx((2 + 1) / 29)
    # packed largest first: two 8 MiB per segment leave 4 MiB, which two 2 MiB requests fill
    assert segment_tails({8 * MiB: 2, 2 * MiB: 2}) == 0 and segment_tails({8 * MiB: 2}) == 4 * MiB
    # 8 MiB: a full segment (4 MiB tail) and one with 12 MiB free; 3 MiB: one into the tail, two into the 12
    assert segment_tails({8 * MiB: 3, 3 * MiB: 3}) == (4 - 3) * MiB + (12 - 6) * MiB
    assert segment_tails({6 * MiB: 4}) == 2 * MiB + 14 * MiB  # one full segment, one with a single block


def test_cublas_workspaces_by_architecture():
    pre_hopper = 2 * 4 * MiB + 8 * 16 * 1024
    assert cublas_workspace_bytes(A100) == pre_hopper + 4 * MiB  # Ampere, >= 24 GB: 4 MiB cuBLASLt
    assert cublas_workspace_bytes(T4) == pre_hopper + MiB
    assert cublas_workspace_bytes(H100) == 64 * MiB
    assert cublas_workspace_bytes(None) == pre_hopper + MiB


def test_nccl_buffers_per_communicator():
    comms = nccl_communicators(tp=2, dp=2, pp=2, tied_embedding=True)
    # world 8, tp 2, dp 2, pp 2, model-parallel 4, embedding 2: 8 ring neighbours; 4 directional p2p groups
    assert sorted(comms) == sorted([(8, False), (2, False), (2, False), (2, False), (4, False), (2, False)]
                                   + [(2, True)] * 4)
    assert nccl_bytes(comms, channels=24) == 8 * 24 * 4 * MiB + 4 * 2 * 4 * MiB
    assert nccl_bytes(comms, channels=24, per_collective=50 * MiB) == 6 * 50 * MiB + 32 * MiB
    assert nccl_communicators(1, 1, 1, True) == [] and len(nccl_communicators(1, 1, 4, False)) == 3 + 4  # world, pp, model-parallel


def test_terms_and_measured_ones_first():
    precision = PrecisionConfig(param_bytes=2)
    t = allowance_terms(A100, MODEL, 2, 2, 2, 1, False, precision)
    assert t.context == 0.5 * GiB and t.cublas == 2 * cublas_workspace_bytes(A100)
    assert t.nccl == nccl_bytes(nccl_communicators(2, 2, 2, True), 24) and 0 < t.fragmentation < 0.1
    m = allowance_terms(A100, MODEL, 2, 2, 2, 1, False, precision,
                        MeasuredCudaMemory(GiB, 50 * MiB, 0.07))
    assert (m.context, m.nccl, m.fragmentation) == (GiB, 6 * 50 * MiB + 32 * MiB, 0.07)


def _ns(**kw):
    return PlannerConfig(**{"cluster": "a100-80g-ib", **kw})


def test_precedence_flags_profile_derived():
    cluster = load_cluster("a100-80g-ib")
    derived = memory_settings(_ns(), Profiles(), cluster)
    got = derived.for_layout(MODEL, 2, 2, 2, 1, False)
    t = allowance_terms(A100, MODEL, 2, 2, 2, 1, False, PrecisionConfig(2))
    assert (got.workspace_bytes, got.fragmentation) == (t.workspace, t.fragmentation) and got.derived is None
    half = memory_settings(_ns(memory_workspace_gb=2.0), Profiles(), cluster).for_layout(MODEL, 2, 2, 2, 1, False)
    assert (half.workspace_bytes, half.fragmentation) == (2 * GiB, t.fragmentation)
    flat = memory_settings(_ns(memory_workspace_gb=1.0, memory_fragmentation=0.2), Profiles(), cluster)
    assert flat.derived is None and (flat.workspace_bytes, flat.fragmentation) == (GiB, 0.2)
    prof = Profile(device={"name": "a100-80g", "kind": "cuda"}, dtype="bf16", model={},
                   cuda_memory={"context_bytes": 0.8 * GiB, "allocator_fraction": 0.04})
    measured = memory_settings(_ns(), Profiles([prof]), cluster).for_layout(MODEL, 2, 2, 2, 1, False)
    assert measured.workspace_bytes == pytest.approx(t.workspace + 0.3 * GiB) and measured.fragmentation == 0.04
    assert memory_settings(_ns(memory_device="cpu"), Profiles(), cluster) == MemorySettings(device="cpu")


class FakeCuda:
    """torch.cuda's memory functions, reading back what the test set."""

    def __init__(self, reserved, allocated, max_reserved, max_allocated, free, total):
        self.v = dict(reserved=reserved, allocated=allocated, max_reserved=max_reserved,
                      max_allocated=max_allocated, free=free, total=total)

    def mem_get_info(self, device):
        return self.v["free"], self.v["total"]

    def memory_reserved(self, device):
        return self.v["reserved"]

    def memory_allocated(self, device):
        return self.v["allocated"]

    def max_memory_reserved(self, device):
        return self.v["max_reserved"]

    def max_memory_allocated(self, device):
        return self.v["max_allocated"]


def test_profile_measures_the_terms_from_readings():
    total = 80 * GiB
    before = cuda_memory.reading(FakeCuda(0, 0, 0, 0, total - 300 * MiB, total), 0)
    # after the steps: 10 GiB reserved, 9 GiB peak allocated, 10.5 GiB peak reserved, 600 MiB outside the allocator
    after = cuda_memory.reading(FakeCuda(10 * GiB, 2 * GiB, 10.5 * GiB, 9 * GiB, total - 10 * GiB - 600 * MiB,
                                         total), 0)
    worker = cuda_memory.reading(FakeCuda(4 * GiB, GiB, 4 * GiB, 3 * GiB, total - 4 * GiB - 1000 * MiB, total), 0)
    busier = cuda_memory.reading(FakeCuda(4 * GiB, GiB, 4 * GiB, 3 * GiB, total - 4 * GiB - 3000 * MiB, total), 0)
    terms = cuda_memory.measured_terms(before, after, [busier, worker])
    assert terms["context_bytes"] == 600 * MiB
    assert terms["allocator_fraction"] == pytest.approx(10.5 / 9 - 1)
    assert terms["nccl_bytes_per_communicator"] == 400 * MiB / 2
    assert terms["samples"]["after"]["max_reserved"] == 10.5 * GiB
    prof = Profile(device={"name": "x"}, dtype="bf16", model={k: 1 for k in MODEL_KEYS}, cuda_memory=terms)
    back = Profile.from_json(prof.to_json())
    assert Profiles([back]).measured_cuda_memory() == MeasuredCudaMemory(600 * MiB, 200 * MiB, 10.5 / 9 - 1)
    assert DerivedAllowance().settings(MemorySettings(), MODEL, 1, 1, 1, 1, False).derived is None
    # the steady micro-batches' maxima, where measured, give the allocator's fraction; the context stays the sweep's
    steady = cuda_memory.reading(FakeCuda(9 * GiB, 2 * GiB, 9.09 * GiB, 9 * GiB, total - 9 * GiB - 600 * MiB,
                                          total), 0)
    terms = cuda_memory.measured_terms(before, after, None, steady)
    assert terms["allocator_fraction"] == pytest.approx(0.01) and terms["context_bytes"] == 600 * MiB
    assert terms["samples"]["steady"] == steady


def test_steady_microbatches_read_the_allocator_after_emptying_it():
    """The readings cover the steady micro-batches only: the cache is emptied and the maxima reset first."""
    from megatron_bmw.parallel.state import ParallelState
    from megatron_bmw.training.profiler import steady_microbatches

    calls = []

    class Recording(FakeCuda):
        def synchronize(self, device):
            calls.append("synchronize")

        def empty_cache(self):
            calls.append("empty_cache")

        def reset_peak_memory_stats(self, device):
            calls.append("reset")

        def max_memory_reserved(self, device):
            calls.append("read")
            return super().max_memory_reserved(device)

    tiny = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=2, vocab_size=64, seq_length=8,
                       attention_backend="unfused")
    got = steady_microbatches(tiny, ParallelState.serial(), 2, cuda=Recording(1, 1, 3, 2, 5, 10))
    assert calls == ["synchronize", "empty_cache", "reset", "read"] and got["max_reserved"] == 3
    assert steady_microbatches(tiny, ParallelState.serial(), 1) is None  # the CPU: the micro-batches alone


def test_the_cluster_file_states_the_device_inputs():
    from megatron_bmw.errors import UsageError
    from megatron_bmw.planner.cluster import parse_cluster

    def cluster(**extra):
        return parse_cluster({"name": "c", "inter_node": {"bandwidth_GBps": 1},
                              "device_types": {"g": {"memory_gb": 40, "peak_tflops": {"bf16": 100}, **extra}},
                              "groups": [{"nodes": 1, "gpus_per_node": 2, "device": "g",
                                          "intra_node": {"bandwidth_GBps": 10}}]})

    g = cluster(cuda_context_gb=1.25, compute_capability=9.0, nccl_channels=4).groups[0].device
    t = allowance_terms(g, MODEL, 2, 1, 1, 1, False, PrecisionConfig(2))
    # world, tp and model-parallel groups: three 2-rank rings of one peer over 4 channels
    assert (t.context, t.cublas, t.nccl) == (1.25 * GiB, 2 * 64 * MiB, 3 * 1 * 4 * 4 * MiB)
    with pytest.raises(UsageError, match="nccl_channels"):
        cluster(nccl_channels=0)
    with pytest.raises(UsageError, match="cuda_context_gb"):
        cluster(cuda_context_gb=-1)


def test_nemo_holds_no_per_matrix_optimizer_tensors():
    """Apex's DistributedFusedAdam (engine nemo) keeps parameters in a flat buffer and its states in flat bucket
    shards: the allocator's fraction counts only the saved activations, not a request per weight matrix."""
    from megatron_bmw.planner.cuda_allowance import held_tensor_bytes
    from megatron_bmw.planner.engine import EngineConfig

    nemo = EngineConfig("nemo").precision("bf16", True)
    core = EngineConfig("megatron-core").precision("bf16", True)
    model = ModelConfig(**{**MODEL.__dict__, "params_dtype": "bf16"})
    held = held_tensor_bytes(model, 2, 2, 1, False, nemo)
    assert held and len(held_tensor_bytes(model, 2, 2, 1, False, core)) == len(held) + 4 * 2
