"""Megatron-core's --tp-comm-overlap: Transformer Engine's userbuffers hide the sequence-parallel collectives of a
transformer layer behind its GEMMs, each GEMM by one of three methods (TE's defaults, which Megatron-core uses
without --tp-comm-overlap-cfg). Torch-free.

  ring exchange (the all-gathers before QKV and fc1 forward, and of the output gradient before the projection's
  and fc2's input gradient): the GEMM runs in tp chunks of its rows, each as soon as its shard has arrived; the
  shards move on copy engines, so the GEMM keeps every SM. The first chunk is local.
  pipeline (the reduce-scatters after the projection and fc2 forward): the GEMM runs in `PIPELINE_SPLITS` chunks;
  each chunk's reduce-scatter runs beside the next chunk, on `COMM_SMS` SMs, and the last chunk's is exposed.
  bulk (QKV's and fc1's backward): the input gradient GEMM runs beside the all-gather of the saved input shard the
  weight gradient needs, the weight gradient GEMM beside the reduce-scatter of the input gradient, each
  collective on `COMM_SMS` SMs.

Where the communication kernel's SMs come from is TE's `set_sm_margin`. TE 1.4-1.13 (all of 2024: the NeMo 24.x
containers, Megatron-core's 2024 README runs) default it to False for every method
(transformer_engine/pytorch/module/base.py, initialize_ub's get_default_config): the GEMM is launched on every
SM (comm_gemm_overlap.h: _math_sms = multiProcessorCount) and the communication kernel, on a higher-priority
stream, holds its COMM_SMS only while it runs; the GEMM loses that share of the device for the collective's
duration (`pipelined_shared`, `bulk_shared`). TE 2.0 (2025-02) defaults it to True for the pipeline and bulk
methods: the GEMM is launched on COMM_SMS fewer SMs for its whole length (`pipelined`, `bulk` on
`margin_device`); `unit_overlap_cost(sm_margin=True)`. What a collective takes beyond its GEMM is exposed either
way. Chunks of one GEMM run on several streams in TE, so a chunked GEMM is costed as the whole one (no per-chunk
wave quantization).
"""

from __future__ import annotations

from dataclasses import replace

from .kernel_time import KernelDevice, gemm_time

COMM_SMS = 16  # TE's default num_sm of its pipeline and bulk overlaps
PIPELINE_SPLITS = 4  # TE's num_splits of a pipeline overlap
SET_SM_MARGIN = False  # TE 1.x's default set_sm_margin (module doc)


def ring_exchange(gemm: float, comm: float, tp: int) -> float:
    """Seconds an all-gather of `comm` seconds adds to a GEMM of `gemm` seconds run in tp chunks beside it."""
    steps = tp - 1
    return max(0.0, gemm / tp + steps * max(gemm / tp, comm / steps) - gemm)


def pipelined(gemm: float, gemm_margin: float, comm: float, splits: int = PIPELINE_SPLITS) -> float:
    """Seconds a reduce-scatter of `comm` seconds adds to a GEMM (`gemm` on every SM, `gemm_margin` on the SMs the
    communication leaves) run in `splits` chunks, each chunk's reduce-scatter beside the next chunk's GEMM."""
    g, c = gemm_margin / splits, comm / splits
    return g + (splits - 1) * max(g, c) + c - gemm


def pipelined_shared(gemm: float, comm: float, share: float, splits: int = PIPELINE_SPLITS) -> float:
    """`pipelined` without an SM margin: each chunk's GEMM on every SM, slowed by `share` (the communication
    kernel's share of the SMs) while the previous chunk's reduce-scatter runs beside it."""
    g, c = gemm / splits, comm / splits
    return g + (splits - 1) * max(c, g + c * share) + c - gemm


def bulk_shared(gemm: float, comm: float, share: float) -> float:
    """`bulk` without an SM margin: the GEMM on every SM loses `share` of them while the collective runs (it
    progresses at 1 - share for the collective's length, then at full rate)."""
    return max(comm, gemm + comm * share) - gemm


def bulk(gemm: float, gemm_margin: float, comm: float) -> float:
    """Seconds a collective of `comm` seconds adds to the GEMM it runs beside (`gemm` on every SM, `gemm_margin`
    on the SMs the communication leaves)."""
    return max(gemm_margin, comm) - gemm


def margin_device(dev: KernelDevice) -> KernelDevice:
    """The device as a GEMM beside a pipeline or bulk overlap sees it: COMM_SMS fewer SMs, each as fast."""
    left = max(1, dev.sm_count - COMM_SMS)
    share = left / dev.sm_count
    unaligned = None if dev.unaligned_flops is None else dev.unaligned_flops * share
    return replace(dev, sm_count=left, peak_flops=dev.peak_flops * share, unaligned_flops=unaligned)


def unit_overlap_cost(first: tuple[int, int, int], last: tuple[int, int, int], elem_bytes: int, comm: float,
                      tp: int, dev: KernelDevice, sm_margin: bool = SET_SM_MARGIN) -> tuple[float, float]:
    """(forward, backward) seconds the overlapped collectives add to an attention or MLP unit on one rank, beyond
    its GEMMs on every SM: `first` and `last` are the (m, n, k) of its column-parallel (QKV, fc1) and row-parallel
    (projection, fc2) GEMMs, `comm` one sequence-parallel all-gather or reduce-scatter of its [s x b, h] input;
    `sm_margin`: TE's set_sm_margin (module doc)."""
    low = margin_device(dev)
    share = COMM_SMS / dev.sm_count

    def on(d: KernelDevice, m: int, n: int, k: int) -> float:
        return gemm_time(m, n, k, elem_bytes, d)

    def pipe(shape: tuple[int, int, int]) -> float:
        full = on(dev, *shape)
        return pipelined(full, on(low, *shape), comm) if sm_margin else pipelined_shared(full, comm, share)

    def beside(shape: tuple[int, int, int]) -> float:
        full = on(dev, *shape)
        return bulk(full, on(low, *shape), comm) if sm_margin else bulk_shared(full, comm, share)

    (m, n, k), (lm, ln, lk) = first, last
    forward = ring_exchange(on(dev, *first), comm, tp) + pipe(last)
    # the row-parallel GEMM's input gradient by ring exchange; the column-parallel one's input and weight gradients
    # beside the bulk collectives
    backward = ring_exchange(on(dev, lm, lk, ln), comm, tp) + beside((m, k, n)) + beside((k, n, m))
    return forward, backward
