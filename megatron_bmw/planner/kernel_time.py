"""Shape-aware kernel times: what a unit's matrix multiplications and attention take on a device, from first
principles instead of one flat share of peak. Torch-free.

A GEMM C[m, n] = A[m, k] B[k, n] is cut into output tiles of tile_m x tile_n; the device runs one tile per
streaming multiprocessor (SM) at a time, in waves of `sm_count` tiles. So
  - tile quantization: a partial tile costs a whole one (m, n padded up to tile multiples);
  - wave quantization: a last, partial wave costs a whole one (ceil(tiles / SMs) waves);
  - each tile's main loop runs k steps plus a fixed prologue/epilogue worth `k_overhead` more (filling the
    pipeline, writing C), so short contractions reach less of the rate: efficiency k / (k + k_overhead);
  - the large-GEMM rate is the device's achievable fraction of peak (what big cuBLAS GEMMs reach);
  - a GEMM never beats moving its operands: max(compute, bytes / memory bandwidth);
  - tensor cores load 16-byte aligned rows: a 16-bit GEMM whose contraction or output width is not a multiple of
    8 elements (16 bytes; e.g. a head dimension of 108, whose heads start at misaligned addresses in the QKV
    output) runs on the CUDA cores with fp32 FMA, at the device's fp32 peak (`unaligned_flops`).
Efficiency therefore rises with the GEMM's size and falls in steps where a tile or a wave splits: a micro-batch
of 1 at tp 8 (few row tiles, a thin n) is slower per sample than a micro-batch of 4.

One tile shape (128 x 128) stands for cuBLAS's choices; its smaller tiles and split-K for thin GEMMs (a few
rows, as in decoding) are not modelled, so such GEMMs come out slower than they run. Training GEMMs have s x b
rows.

Attention (the fused flash kernel) tiles the same way: one tile is 128 query rows of one head, and its two
products (QK^T, PV) contract over the head dimension d and the keys; a small d is a short contraction. The causal
mask skips the blocks above the diagonal (half the work). Backward runs five products where forward runs two
(recomputing the scores): 2.5 x.

Units per tensor-parallel rank (T = s x b tokens): attention = QKV [T, qkv_rows/t, h], core, projection
[T, h, h/t]; MLP = fc1 [T, fc1_rows/t, h], fc2 [T, h, f/t]; head = logits [T, v/t, h]. A backward GEMM runs the
input gradient [m, k] (contracting n) and the weight gradient [k, n] (contracting m); zero-bubble's W runs the
weight gradients of the deferred layers (all but BERT's LM dense), its B the rest.

An MoE unit (moe_model.py) runs the router [T, E, h] in fp32 (at the fp32 peak), the experts as grouped GEMMs over
the E/ep local experts at the tokens each receives on the busiest rank (`grouped_gemm_time`: every expert's rows
tiled apart, so a few tokens per expert waste most of a tile: the grouped GEMM's efficiency at small per-expert
counts), and the shared experts as a dense MLP over tp; the dispatcher's communication is moe_cost.py's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import ModelConfig
from .moe_model import Experts, default_experts, expert_loads, local_tokens

FLASH_BLOCK = 128  # query rows per attention tile
FLASH_BACKWARD = 2.5  # five products against forward's two


@dataclass(frozen=True)
class KernelDevice:
    """What the kernel model needs of a device type (planner/cluster.py DeviceType.kernels)."""

    peak_flops: float  # of the run's dtype
    achievable_fraction: float  # the rate a large, well-shaped GEMM reaches
    sm_count: int
    memory_bandwidth: float | None = None  # bytes/s
    tile_m: int = 128
    tile_n: int = 128
    k_overhead: int = 64  # a tile's prologue and epilogue, in main-loop steps of k
    unaligned_flops: float | None = None  # peak of GEMMs tensor cores cannot take (fp32 FMA); None: no such penalty


ALIGN_BYTES = 16  # tensor cores' operand alignment


def device_kernels(device, dtype: str, achievable_fraction: float) -> KernelDevice | None:
    """The kernel model's view of a cluster device type (planner/cluster.py DeviceType) running `dtype`: None
    where it gives no SM count; 16-bit GEMMs off the tensor cores' alignment run at its fp32 peak."""
    if device.sm_count is None:
        return None
    unaligned = device.peak_flops.get("fp32") if dtype in ("bf16", "fp16") else None
    return KernelDevice(device.peak(dtype), achievable_fraction, device.sm_count, device.memory_bandwidth,
                        unaligned_flops=unaligned)


def gemm_time(m: int, n: int, k: int, elem_bytes: int, dev: KernelDevice, batch: int = 1) -> float:
    """Seconds of `batch` GEMMs [m, k] x [k, n]."""
    if min(m, n, k, batch) <= 0:
        return 0.0
    tiles = batch * math.ceil(m / dev.tile_m) * math.ceil(n / dev.tile_n)
    waves = math.ceil(tiles / dev.sm_count)
    peak = dev.peak_flops
    if dev.unaligned_flops is not None and ((k * elem_bytes) % ALIGN_BYTES or (n * elem_bytes) % ALIGN_BYTES):
        peak = min(peak, dev.unaligned_flops)
    per_sm = peak * dev.achievable_fraction / dev.sm_count
    compute = waves * 2.0 * dev.tile_m * dev.tile_n * (k + dev.k_overhead) / per_sm
    if dev.memory_bandwidth is None:
        return compute
    moved = batch * (m * k + k * n + m * n) * elem_bytes
    return max(compute, moved / dev.memory_bandwidth)


def grouped_gemm_time(ms: list[float], n: int, k: int, elem_bytes: int, dev: KernelDevice) -> float:
    """Seconds of one grouped GEMM: expert i's [m_i, k] x [k, n], each expert's rows tiled apart, all tiles in waves
    over the SMs (the tile and wave rules of gemm_time)."""
    ms = [math.ceil(m) for m in ms if m > 0]
    if not ms or min(n, k) <= 0:
        return 0.0
    tiles = sum(math.ceil(m / dev.tile_m) for m in ms) * math.ceil(n / dev.tile_n)
    waves = math.ceil(tiles / dev.sm_count)
    per_sm = _peak(n, k, elem_bytes, dev) * dev.achievable_fraction / dev.sm_count
    compute = waves * 2.0 * dev.tile_m * dev.tile_n * (k + dev.k_overhead) / per_sm
    if dev.memory_bandwidth is None:
        return compute
    moved = sum(m * k + k * n + m * n for m in ms) * elem_bytes
    return max(compute, moved / dev.memory_bandwidth)


def grouped_wgrad_time(ms: list[float], n: int, k: int, elem_bytes: int, dev: KernelDevice) -> float:
    """Seconds of the grouped weight gradients [k, n] of each expert, contracting its m_i rows: every expert the
    same tiles, each tile's loop m_i + the overhead long; the work spread over the SMs, at least one tile of the
    longest."""
    ms = [math.ceil(m) for m in ms if m > 0]
    if not ms or min(n, k) <= 0:
        return 0.0
    tiles = math.ceil(k / dev.tile_m) * math.ceil(n / dev.tile_n)
    per_sm = _peak(n, k, elem_bytes, dev) * dev.achievable_fraction / dev.sm_count
    tile = 2.0 * dev.tile_m * dev.tile_n / per_sm
    compute = max(tile * (max(ms) + dev.k_overhead),
                  tile * tiles * sum(m + dev.k_overhead for m in ms) / dev.sm_count)
    if dev.memory_bandwidth is None:
        return compute
    moved = sum(m * k + m * n + k * n for m in ms) * elem_bytes
    return max(compute, moved / dev.memory_bandwidth)


def _peak(n: int, k: int, elem_bytes: int, dev: KernelDevice) -> float:
    if dev.unaligned_flops is not None and ((k * elem_bytes) % ALIGN_BYTES or (n * elem_bytes) % ALIGN_BYTES):
        return min(dev.peak_flops, dev.unaligned_flops)
    return dev.peak_flops


def moe_kernel_parts(model: ModelConfig, micro_batch_size: int, tp: int, dev: KernelDevice, sp: bool = True,
                     cp: int = 1, experts: Experts | None = None) -> list[tuple[float, float, float]]:
    """(forward, backward, weight gradient) of each kernel of an MoE unit on the busiest rank (module doc); `model`
    holds the rank's s/cp tokens already where cp > 1 (`cp` 1 then)."""
    experts = default_experts(tp, experts)
    moe, h, e = model.moe, model.hidden_size, model.dtype_bytes
    tokens = local_tokens(model, micro_batch_size, tp, sp, cp)
    loads = expert_loads(model, tokens, experts)
    f = model.moe_ffn_hidden_size // experts.etp
    rows = 2 * f if model.swiglu else f
    fp32 = KernelDevice(dev.unaligned_flops or dev.peak_flops, dev.achievable_fraction, dev.sm_count,
                        dev.memory_bandwidth, dev.tile_m, dev.tile_n, dev.k_overhead)
    parts = [_linear(tokens, moe.num_experts, h, 4, fp32, deferred=False)]  # the router, in fp32
    for n, k in ((rows, h), (h, f)):  # fc1, fc2
        fwd = grouped_gemm_time(loads, n, k, e, dev)
        wgrad = grouped_wgrad_time(loads, n, k, e, dev)
        parts.append((fwd, grouped_gemm_time(loads, k, n, e, dev) + wgrad, wgrad))
    shared = moe.shared_expert_intermediate_size
    if shared:
        full = model.seq_length * micro_batch_size
        shared_rows = 2 * shared if model.swiglu else shared
        parts.append(_linear(full, shared_rows // tp, h, e, dev))
        parts.append(_linear(full, h, shared // tp, e, dev))
    return parts


def gemm_efficiency(m: int, n: int, k: int, elem_bytes: int, dev: KernelDevice) -> float:
    """Achieved share of peak: 2mnk / (time x peak)."""
    return 2.0 * m * n * k / (gemm_time(m, n, k, elem_bytes, dev) * dev.peak_flops)


def flash_attention_time(batch_heads: int, s: int, d: int, elem_bytes: int, dev: KernelDevice,
                         causal: bool = True) -> float:
    """Forward seconds of the fused attention kernel over `batch_heads` (micro-batch x local heads) heads."""
    row_blocks = math.ceil(s / FLASH_BLOCK)
    keys = (s + FLASH_BLOCK) / 2 if causal else s  # a query block sees the keys up to it
    tiles = batch_heads * row_blocks
    waves = math.ceil(tiles / dev.sm_count)
    per_sm = dev.peak_flops * dev.achievable_fraction / dev.sm_count
    # QK^T: [128, keys] contracting d; PV: [128, d] contracting keys; each contraction with its own overhead
    flops = 2.0 * FLASH_BLOCK * keys * (d + dev.k_overhead) + 2.0 * FLASH_BLOCK * d * (keys + dev.k_overhead)
    compute = waves * flops / per_sm
    if dev.memory_bandwidth is None:
        return compute
    moved = 4 * batch_heads * s * d * elem_bytes  # q, k, v in, the output out
    return max(compute, moved / dev.memory_bandwidth)


def _linear(m: int, n: int, k: int, e: int, dev: KernelDevice, deferred: bool = True) -> tuple[float, float, float]:
    """(forward, backward, weight gradient) of a linear layer: y[m, n] = x[m, k] W^T; backward = input and weight
    gradients; the weight gradient is what a split backward's W runs (0 for a layer whose gradient is not deferred)."""
    wgrad = gemm_time(k, n, m, e, dev)
    return gemm_time(m, n, k, e, dev), gemm_time(m, k, n, e, dev) + wgrad, wgrad if deferred else 0.0


def _unit_parts(kind: str, model: ModelConfig, micro_batch_size: int, tp: int,
                dev: KernelDevice) -> list[tuple[float, float, float]]:
    """(forward, backward, deferred weight gradient) of each kernel of one unit on one tensor-parallel rank (an MoE
    unit's at Megatron's default expert layout, ep 1, etp = tp, with sequence parallelism under tp)."""
    if kind == "moe":
        return moe_kernel_parts(model, micro_batch_size, tp, dev)
    s, b, h = model.seq_length, micro_batch_size, model.hidden_size
    e = model.dtype_bytes
    tokens = s * b
    parts: list[tuple[float, float, float]] = []
    if kind in ("attention", "mlp"):
        first, last = unit_edge_shapes(kind, model, b, tp)
        parts.append(_linear(*first, e, dev))
    if kind == "attention":
        heads = model.num_attention_heads // tp
        d = model.head_dim
        if model.flash_attention:
            f = flash_attention_time(b * heads, s, d, e, dev, causal=model.model_type != "bert")
            parts.append((f, FLASH_BACKWARD * f, 0.0))
        else:  # scores [s, s] contracting d, context [s, d] contracting s
            qk = gemm_time(s, s, d, e, dev, b * heads)
            pv = gemm_time(s, d, s, e, dev, b * heads)
            # backward: dV, dQ, dK [s, d] contracting s; dP [s, s] contracting d
            parts.append((qk + pv, 3 * pv + qk, 0.0))
    if kind in ("attention", "mlp"):
        parts.append(_linear(*last, e, dev))
    elif kind == "head":
        parts.append(_linear(tokens, model.vocab_size // tp, h, e, dev))
        if model.model_type == "bert":
            parts.append(_linear(tokens, h, h, e, dev, deferred=False))  # the LM head's dense layer (F.linear)
    elif kind == "embedding":  # lookups and adds: memory traffic (the word rows, the position rows, the sum)
        moved = 3.0 * tokens * h * e
        rate = dev.memory_bandwidth or dev.peak_flops * dev.achievable_fraction  # no bandwidth given: a byte a FLOP
        parts.append((moved / rate, 2 * moved / rate, 0.0))
    else:
        raise ValueError(f"unknown unit kind {kind!r}")
    return parts


def attention_core_times(model: ModelConfig, micro_batch_size: int, tp: int, dev: KernelDevice) -> tuple[float, float]:
    """(forward, backward) seconds of the attention core alone (the fused kernel, or the unfused products) of one
    attention unit on one tensor-parallel rank."""
    core = _unit_parts("attention", model, micro_batch_size, tp, dev)[1]
    return core[0], core[1]


def unit_kernel_times(kind: str, model: ModelConfig, micro_batch_size: int, tp: int,
                      dev: KernelDevice) -> tuple[float, float]:
    """(forward, backward) seconds of the matrix work of one unit on one tensor-parallel rank."""
    parts = _unit_parts(kind, model, micro_batch_size, tp, dev)
    return sum(f for f, _, _ in parts), sum(g for _, g, _ in parts)


def unit_weight_grad_time(kind: str, model: ModelConfig, micro_batch_size: int, tp: int, dev: KernelDevice) -> float:
    """Seconds of the unit's deferred weight-gradient GEMMs (a split backward's W; part of unit_kernel_times'
    backward)."""
    return sum(w for _, _, w in _unit_parts(kind, model, micro_batch_size, tp, dev))


def shape_ratio(kind: str, model: ModelConfig, micro_batch_size: int, tp: int, ref_model: ModelConfig, ref_tp: int,
                dev: KernelDevice) -> tuple[float, float] | None:
    """(forward, backward) kernel time of `model`'s unit at `tp` over the reference's at `ref_tp`, both at the same
    micro-batch size: how a unit timed at one shape rescales to another on the same device (None where the
    reference has no matrix work)."""
    ours = unit_kernel_times(kind, model, micro_batch_size, tp, dev)
    ref = unit_kernel_times(kind, ref_model, micro_batch_size, ref_tp, dev)
    if min(ref) <= 0:
        return None
    return ours[0] / ref[0], ours[1] / ref[1]


def unit_edge_shapes(kind: str, model: ModelConfig, micro_batch_size: int,
                     tp: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(m, n, k) of the GEMMs at the ends of an attention or MLP unit on one tensor-parallel rank: the
    column-parallel one a sequence-parallel all-gather feeds (QKV, fc1) and the row-parallel one a reduce-scatter
    drains (projection, fc2); what Transformer Engine's communication overlap hides the collectives behind."""
    tokens, h = model.seq_length * micro_batch_size, model.hidden_size
    if kind == "attention":
        return (tokens, model.qkv_rows // tp, h), (tokens, h, h // tp)
    if kind == "mlp":
        return (tokens, model.fc1_rows // tp, h), (tokens, h, model.ffn_hidden_size // tp)
    raise ValueError(f"unit kind {kind!r} has no sequence-parallel GEMMs")
