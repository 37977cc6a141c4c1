"""The shape-aware kernel model: efficiency rises with GEMM size and contraction, steps where tiles or waves split,
memory-bound when small; per sample, bigger micro-batches and fewer, larger heads are faster."""

import math

import pytest

from megatron_bmw.config import ModelConfig
from megatron_bmw.planner.cluster import load_cluster
from megatron_bmw.planner.spec import RunSpec
from megatron_bmw.planner.kernel_time import (KernelDevice, flash_attention_time, gemm_efficiency, gemm_time,
                                              unit_kernel_times)

A100 = KernelDevice(peak_flops=312e12, achievable_fraction=0.75, sm_count=108, memory_bandwidth=2039e9)
WAVE = A100.tile_m * A100.sm_count  # rows of one full wave of 128 x 128 tiles over one column of tiles


def test_efficiency_grows_with_size_over_full_waves_and_saturates_below_the_large_gemm_rate():
    effs = [gemm_efficiency(WAVE * j, 128, 4096, 2, A100) for j in (1, 2, 4, 8, 16)]
    assert all(b >= a - 1e-12 for a, b in zip(effs, effs[1:]))
    assert effs[-1] <= A100.achievable_fraction
    # longer contractions amortise each tile's prologue and epilogue
    by_k = [gemm_efficiency(WAVE, 128, k, 2, A100) for k in (64, 256, 1024, 4096, 16384)]
    assert all(b > a for a, b in zip(by_k, by_k[1:]))
    assert by_k[-1] == pytest.approx(A100.achievable_fraction * 16384 / (16384 + A100.k_overhead), rel=1e-6)


def test_wave_and_tile_quantization_steps():
    full = gemm_time(WAVE, 128, 4096, 2, A100)
    assert gemm_time(WAVE + 1, 128, 4096, 2, A100) == pytest.approx(2 * full)  # one more tile: a second wave
    assert gemm_time(WAVE - 127, 128, 4096, 2, A100) == pytest.approx(full)  # a partial tile costs a whole one
    small = gemm_time(128, 128, 4096, 2, A100)
    assert gemm_time(100 * 128, 128, 4096, 2, A100) == pytest.approx(small)  # one wave, whatever its fill
    assert gemm_efficiency(128, 128, 4096, 2, A100) < gemm_efficiency(WAVE, 128, 4096, 2, A100) / 50


def test_short_contractions_are_memory_bound():
    m, n, k = 16384, 16384, 16  # little work per byte moved: the output's bytes dominate
    assert gemm_time(m, n, k, 2, A100) == pytest.approx((m * k + k * n + m * n) * 2 / A100.memory_bandwidth)
    assert gemm_time(m, n, 4096, 2, A100) > (m * 4096 + 4096 * n + m * n) * 2 / A100.memory_bandwidth


GPT3_LAYER = dict(num_layers=1, hidden_size=12288, num_attention_heads=96, seq_length=2048, vocab_size=51200,
                  params_dtype="bf16", attention_backend="flash")


def _per_sample(kind, model, mbs, tp):
    f, b = unit_kernel_times(kind, model, mbs, tp, A100)
    return (f + b) / mbs


def test_bigger_micro_batches_are_faster_per_sample_at_high_tp():
    model = ModelConfig(**GPT3_LAYER)
    for kind in ("attention", "mlp"):
        one, four = _per_sample(kind, model, 1, 8), _per_sample(kind, model, 4, 8)
        assert four < one, kind
    small = ModelConfig(**{**GPT3_LAYER, "hidden_size": 2048, "num_attention_heads": 16, "seq_length": 512})
    assert _per_sample("mlp", small, 4, 8) < 0.9 * _per_sample("mlp", small, 1, 8)


def test_many_small_heads_cost_more_than_few_large_ones():
    few = flash_attention_time(8 * 16, 2048, 128, 2, A100)
    many = flash_attention_time(8 * 32, 2048, 64, 2, A100)  # same hidden size, same FLOPs
    assert many > 1.1 * few
    # the causal kernel does about half the non-causal work
    assert flash_attention_time(64, 4096, 128, 2, A100) < 0.6 * flash_attention_time(64, 4096, 128, 2, A100,
                                                                                      causal=False)


def test_the_cost_model_uses_it_where_the_device_gives_its_sms():
    from dataclasses import replace

    from megatron_bmw.config import PipelineConfig
    from megatron_bmw.planner.cost_model import CostModel
    from megatron_bmw.planner.spec import RunSpec

    cluster = load_cluster("a100-80g-ib")
    device = cluster.groups[0].device
    assert device.sm_count == 108
    model = ModelConfig(**{**GPT3_LAYER, "num_layers": 2})
    spec = RunSpec.of(model=model, tp=8, pp=1, dp=1, pipeline=PipelineConfig(micro_batch_size=1, num_microbatches=4))
    shaped = CostModel(spec, cluster)._analytic("mlp", 8, device)
    flat = CostModel(spec, cluster)._analytic("mlp", 8, replace(device, sm_count=None))
    assert shaped[0] > flat[0]  # thin tp-8 shards at micro-batch 1 reach less than the large-GEMM rate
    assert math.isfinite(shaped[1]) and shaped[1] > shaped[0]


def _profile(units, device):
    from megatron_bmw.planner.profile_data import Profile, UnitTiming, model_signature

    small = ModelConfig(**{**GPT3_LAYER, "hidden_size": 1024, "num_attention_heads": 8})
    return small, Profile(device=device, dtype="bf16", model=model_signature(small),
                          units=[UnitTiming(k, 1, b, f, 2 * f) for k, b, f in units])


def test_a_gpu_profile_rescales_to_another_shape_by_the_kernel_model_and_a_cpu_profile_by_flops():
    from megatron_bmw.planner.flops import unit_forward_flops
    from megatron_bmw.planner.kernel_time import shape_ratio

    big = ModelConfig(**GPT3_LAYER)
    small, gpu = _profile([("mlp", 1, 1e-3)], {"name": "g", "kind": "cuda", "sm_count": 108})
    _, cpu = _profile([("mlp", 1, 1e-3)], {"name": "c", "kind": "cpu"})
    flops = unit_forward_flops("mlp", big, 1) / unit_forward_flops("mlp", small, 1)
    assert cpu.unit_time("mlp", 1, 1, big)[0] == pytest.approx(1e-3 * flops)
    by_shape = gpu.unit_time("mlp", 1, 1, big)
    ratio = shape_ratio("mlp", big, 1, 1, small, 1, KernelDevice(1.0, 1.0, 108))
    assert by_shape == pytest.approx((1e-3 * ratio[0], 2e-3 * ratio[1]))
    # the small profiled GEMMs fill fewer waves: per FLOP, the big model's run faster than a FLOP rescale says
    assert by_shape[0] < 0.9 * 1e-3 * flops
    # a CPU profile used for a device type with SMs takes the cluster's kernel device
    assert cpu.unit_time("mlp", 1, 1, big, kernels=A100)[0] == pytest.approx(
        1e-3 * shape_ratio("mlp", big, 1, 1, small, 1, A100)[0])


def test_a_tp1_profile_entry_is_split_over_tp_ranks_by_the_shard_shapes():
    from megatron_bmw.config import PipelineConfig
    from megatron_bmw.planner.cost_model import CostModel
    from megatron_bmw.planner.kernel_time import shape_ratio
    from megatron_bmw.planner.profile_data import Profile, UnitTiming, model_signature

    cluster = load_cluster("a100-80g-ib")
    device = cluster.groups[0].device
    model = ModelConfig(**{**GPT3_LAYER, "num_layers": 2})
    prof = Profile(device={"name": device.name, "kind": "cuda", "sm_count": 108}, dtype="bf16",
                   model=model_signature(model), units=[UnitTiming(k, 1, 1, 1e-2, 2e-2)
                                                       for k in ("embedding", "attention", "mlp", "head")])
    spec = RunSpec.of(model=model, tp=8, pp=1, dp=1, pipeline=PipelineConfig(micro_batch_size=1, num_microbatches=4))
    (fw, _), (bw, _), comm_in = CostModel(spec, cluster, prof)._compute_parts("mlp", device, None)
    ratio = shape_ratio("mlp", model, 1, 8, model, 1, KernelDevice(1.0, 1.0, 108))
    assert not comm_in and (fw, bw) == pytest.approx((1e-2 * ratio[0], 2e-2 * ratio[1]))
    assert fw > 1e-2 / 8  # thin shards: slower than an eighth of the whole


def test_misaligned_16_bit_gemms_fall_back_to_the_fp32_rate():
    dev = KernelDevice(peak_flops=312e12, achievable_fraction=0.75, sm_count=108, memory_bandwidth=2039e9,
                       unaligned_flops=19.5e12)
    aligned = gemm_time(WAVE, 128, 4096, 2, dev)
    assert aligned == gemm_time(WAVE, 128, 4096, 2, A100)
    # a contraction of 4100 bf16 elements (8200 bytes) is not 16-byte aligned; in fp32 (16400 bytes) it is
    assert gemm_time(WAVE, 128, 4100, 2, dev) == pytest.approx(gemm_time(WAVE, 128, 4100, 2, A100) * 312 / 19.5)
    assert gemm_time(WAVE, 128, 4100, 4, dev) == gemm_time(WAVE, 128, 4100, 4, A100)
    assert gemm_time(WAVE, 132, 4096, 2, dev) > 10 * gemm_time(WAVE, 132, 4096, 2, A100)  # the output width too


def test_a_head_dimension_off_the_alignment_slows_only_the_unfused_core():
    dev = KernelDevice(peak_flops=312e12, achievable_fraction=0.75, sm_count=108, memory_bandwidth=2039e9,
                       unaligned_flops=19.5e12)
    # 13824 = 128 heads of 108 (216 bytes: misaligned) or 96 heads of 144 (288 bytes)
    kw = dict(num_layers=1, hidden_size=13824, vocab_size=1024, seq_length=2048, params_dtype="bf16",
              attention_backend="unfused")
    odd, even = ModelConfig(num_attention_heads=128, **kw), ModelConfig(num_attention_heads=96, **kw)
    assert unit_kernel_times("attention", odd, 2, 4, dev)[0] > 2 * unit_kernel_times("attention", even, 2, 4, dev)[0]
    assert unit_kernel_times("attention", odd, 2, 4, A100)[0] < 1.1 * unit_kernel_times("attention", even, 2, 4,
                                                                                         A100)[0]
    assert unit_kernel_times("mlp", odd, 2, 4, dev) == unit_kernel_times("mlp", odd, 2, 4, A100)


def test_h100_large_gemm_rate_is_its_mamf_at_the_a100s_share():
    """The H100's achievable fraction is its Maximum Achievable Matmul FLOPS (80.1% of 989 TFLOP/s) at the share of
    MAMF the A100's 0.75 is of its own (85.9% of 312): the cluster file's sourced figure, not the old 0.65."""
    a100 = load_cluster("a100-80g-ib").device(0)
    h100 = load_cluster("h100-80g-ib").device(0)
    assert h100.achievable_fraction == pytest.approx(0.801 * a100.achievable_fraction / 0.859, abs=0.005)
    kd = KernelDevice(h100.peak("bf16"), h100.achievable_fraction, h100.sm_count, h100.memory_bandwidth)
    # GPT-3 175B's fc1 at tp 4, micro-batch 1 (9 full-ish waves of 128 x 128 tiles): within 4% of the large rate
    assert 0.96 * 0.70 < gemm_efficiency(2048, 12288, 12288, 2, kd) <= 0.70
