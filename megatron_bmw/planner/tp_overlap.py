"""Megatron-core's --tp-comm-overlap: Transformer Engine's userbuffers hide the sequence-parallel collectives of a
transformer layer behind its GEMMs, each GEMM by one of three methods (TE's defaults, which Megatron-core uses
without --tp-comm-overlap-cfg). Torch-free.

  ring exchange (the all-gathers before QKV and fc1 forward, and of the output gradient before the projection's
  and fc2's input gradient): the GEMM runs in tp chunks of its rows, each as soon as its shard has arrived; the
  shards move on copy engines, so the GEMM keeps every SM. The first chunk is local.
  pipeline (the reduce-scatters after the projection and fc2 forward): the GEMM runs in `PIPELINE_SPLITS` chunks;
  each chunk's reduce-scatter runs beside the next chunk, on `COMM_SMS` SMs taken from the GEMM (TE's sm margin),
  and the last chunk's is exposed.
  bulk (QKV's and fc1's backward): the input gradient GEMM runs beside the all-gather of the saved input shard the
  weight gradient needs, the weight gradient GEMM beside the reduce-scatter of the input gradient; each on
  `COMM_SMS` fewer SMs.

So the overlap is not free: every pipeline and bulk GEMM loses COMM_SMS of the device's SMs (the kernel model's
waves over the SMs left), and what a collective takes beyond its GEMM is exposed. Chunks of one GEMM run on
several streams in TE, so a chunked GEMM is costed as the whole one (no per-chunk wave quantization).
"""

from __future__ import annotations

from dataclasses import replace

from .kernel_time import KernelDevice, gemm_time

COMM_SMS = 16  # TE's num_sm of its pipeline and bulk overlaps, which set_sm_margin takes from the GEMM
PIPELINE_SPLITS = 4  # TE's num_splits of a pipeline overlap


def ring_exchange(gemm: float, comm: float, tp: int) -> float:
    """Seconds an all-gather of `comm` seconds adds to a GEMM of `gemm` seconds run in tp chunks beside it."""
    steps = tp - 1
    return max(0.0, gemm / tp + steps * max(gemm / tp, comm / steps) - gemm)


def pipelined(gemm: float, gemm_margin: float, comm: float, splits: int = PIPELINE_SPLITS) -> float:
    """Seconds a reduce-scatter of `comm` seconds adds to a GEMM (`gemm` on every SM, `gemm_margin` on the SMs the
    communication leaves) run in `splits` chunks, each chunk's reduce-scatter beside the next chunk's GEMM."""
    g, c = gemm_margin / splits, comm / splits
    return g + (splits - 1) * max(g, c) + c - gemm


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
                      tp: int, dev: KernelDevice) -> tuple[float, float]:
    """(forward, backward) seconds the overlapped collectives add to an attention or MLP unit on one rank, beyond
    its GEMMs on every SM: `first` and `last` are the (m, n, k) of its column-parallel (QKV, fc1) and row-parallel
    (projection, fc2) GEMMs, `comm` one sequence-parallel all-gather or reduce-scatter of its [s x b, h] input."""
    low = margin_device(dev)

    def on(d: KernelDevice, m: int, n: int, k: int) -> float:
        return gemm_time(m, n, k, elem_bytes, d)

    (m, n, k), (lm, ln, lk) = first, last
    dgrad, wgrad = (m, k, n), (k, n, m)  # the column-parallel GEMM's input and weight gradients
    forward = ring_exchange(on(dev, *first), comm, tp) + pipelined(on(dev, *last), on(low, *last), comm)
    backward = (ring_exchange(on(dev, lm, lk, ln), comm, tp)  # the row-parallel GEMM's input gradient
                + bulk(on(dev, *dgrad), on(low, *dgrad), comm) + bulk(on(dev, *wgrad), on(low, *wgrad), comm))
    return forward, backward
