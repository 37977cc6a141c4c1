"""What context parallelism (cp = C ranks splitting every sequence) adds to an attention unit's time; the rest of
a unit is timed on the rank's s/C tokens (spec.RunSpec.rank_model), and the gradients are reduced over dp x cp
(comm_cost.py).

Compute: with the balanced chunk layout (2C chunks, rank r holding chunks r and 2C-1-r) every rank does 1/C of the
causal attention of the whole sequence, so its core takes the full-sequence core time / C (the kernel model's
fused kernel, kernel_time.py, where the device type gives its SMs; else its FLOPs at the achievable rate,
backward 2 x forward), not the s/C-sequence core time (attention is quadratic in the sequence).

Communication, on the links the cluster file describes between the cp group's ranks (cluster.py: NVLink inside a
node while tp x cp fits in it, else the nodes' NICs, shared by the node's ranks sending at once):
  p2p (the ring): C-1 steps per forward, each passing one K/V block (K and V of the rank's s/C tokens: 2 b g/t s/C
      d e bytes) to the next cp rank while one block's share of the core runs (core / C): exposed per step
      max(0, transfer - block compute). The backward's C-1 steps pass a K/V block and a dK/dV block (fp32) each,
      beside one block's backward.
  a2a: two all-to-alls forward (q, k, v scattered by heads; the output gathered back) and two backward (the
      output's gradient; dq, dk, dv), each (C-1)/C of its bytes per rank at the link's bandwidth plus C-1
      latencies, not overlapped.
The loss's token-count all-reduce over cp (one number per micro-batch) is left out: a latency of microseconds
beside the attention exchanges.
"""

from __future__ import annotations

from dataclasses import replace

from ..config import ModelConfig
from .cluster import Link
from .flops import core_attention_flops
from .kernel_time import KernelDevice, attention_core_times

_FP32 = 4


def core_times(model: ModelConfig, micro_batch_size: int, tp: int, kd: KernelDevice | None,
               flops_rate: float) -> tuple[float, float]:
    """(forward, backward) seconds of one attention unit's core over `model`'s sequence on one tensor-parallel
    rank: by kernel shape (`kd`), else FLOPs at `flops_rate` with backward 2 x forward."""
    if kd is not None:
        return attention_core_times(model, micro_batch_size, tp, kd)
    f = core_attention_flops(model, micro_batch_size, tp) / flops_rate
    return f, 2 * f


def cp_core_times(model: ModelConfig, micro_batch_size: int, tp: int, cp: int, kd: KernelDevice | None,
                  flops_rate: float) -> tuple[float, float]:
    """(forward, backward) of the context-parallel core on one rank: 1/cp of the whole sequence's causal core."""
    f, b = core_times(replace(model, attention_backend="flash"), micro_batch_size, tp, kd, flops_rate)
    return f / cp, b / cp


def kv_block_bytes(model: ModelConfig, micro_batch_size: int, tp: int, cp: int, itemsize: int) -> float:
    """K and V of one rank's s/cp tokens: 2 b g/t s/cp d elements."""
    groups = max(1, model.query_groups // tp)
    return 2.0 * micro_batch_size * groups * (model.seq_length // cp) * model.head_dim * itemsize


def ring_exposed(steps: int, transfer: float, block_compute: float) -> float:
    """What `steps` ring steps leave exposed, each transfer overlapped with one block's compute."""
    return steps * max(0.0, transfer - block_compute)


def ring_times(model: ModelConfig, micro_batch_size: int, tp: int, cp: int, link: Link,
               core: tuple[float, float]) -> tuple[float, float]:
    """(forward, backward) exposed seconds of the p2p ring beside the core's (forward, backward) seconds."""
    kv = link.time(kv_block_bytes(model, micro_batch_size, tp, cp, model.dtype_bytes))
    dkv = link.time(kv_block_bytes(model, micro_batch_size, tp, cp, _FP32))
    return ring_exposed(cp - 1, kv, core[0] / cp), ring_exposed(cp - 1, kv + dkv, core[1] / cp)


def all_to_all_time(nbytes: float, n: int, link: Link) -> float:
    """One all-to-all of `nbytes` per rank among n ranks: (n-1)/n of it leaves each rank."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes / link.bandwidth + (n - 1) * link.latency


def a2a_times(model: ModelConfig, micro_batch_size: int, tp: int, cp: int, link: Link) -> tuple[float, float]:
    """(forward, backward) seconds of the all-to-alls: q, k, v in and the output back; in backward the output's
    gradient in and dq, dk, dv back."""
    local_h = (model.seq_length // cp) * micro_batch_size * (model.hidden_size // tp)
    kv = local_h * model.query_groups // model.num_attention_heads
    qkv, out = (local_h + 2 * kv) * model.dtype_bytes, local_h * model.dtype_bytes
    both = all_to_all_time(qkv, cp, link) + all_to_all_time(out, cp, link)
    return both, both
