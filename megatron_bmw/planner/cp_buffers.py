"""The transient bytes of the context-parallel attention core (parallel/context_parallel.py with
parallel/cp_blocks.py) on one rank: the peak of what its forward allocates beyond what it saves
(unit_activations.py) and returns, and the peak of what its backward allocates (the q, k, v gradients it returns
included: the fp32 accumulators become them in fp32). No term is of size s^2 or (s/C)^2.

Notation (one rank): C the cp size, s_l = s/C its rows, n = a/t query heads and g = max(1, kv groups/t) kv heads
per tensor-parallel rank, d the head dim, e bytes per element; Q = b n s_l d (q's elements), R = b n s_l (rows),
KV = 2 b g s_l d (one K/V block, K and V packed). A "pair" is one (query block, key block) of the ring: the
diagonal (all rows, all keys, aligned-causal: fractions (1, 1)), a lower rank's block (all rows, half the keys:
(1, 1/2)) or a higher rank's (half the rows, all keys: (1/2, 1)).

p2p (the ring), the largest over its steps (step 0 is the diagonal; steps 1..C-1 the off-diagonal pairs, the last
one with no K/V transfer in flight):
  forward  K/V blocks in flight in e (2: the one attended and the one arriving; 1 on the last step: KV e each),
           the fp32 output accumulator Q x 4 (16-bit only: in fp32 it becomes the saved output, as the fp32
           log-sum-exp accumulator always becomes the saved one), the kernel's block output fq Q e and block
           log-sum-exp fq R x 4, the merge's row vectors (new log-sum-exp, two weights: 3 fq R x 4; none on step
           0, whose result is copied in), and the kernel's workspace (below).
  backward K/V blocks in flight (as forward), the fp32 dK/dV accumulators (1 on step 0; then 3: this step's, the
           one sent last step, the one arriving: KV x 4 each), the fp32 dQ accumulator Q x 4, the kernel's block
           gradients dq (fq Q e), dk and dv (fk KV e), the copied rows of the log-sum-exp for a half-row pair
           (fq R x 4), and the kernel's workspace.
a2a (Ulysses; q, k, v, the output and the log-sum-exp re-laid are SAVED, not counted here), an upper bound: the
largest of its phases' terms, KVa = KV lcm(g, C)/g the re-laid k+v elements:
  forward  the output's all-to-all send copy (Q e; and its receive buffer, Q e, where b > 1 makes the re-lay a
           copy: at b = 1 the result is a view of it); where C does not divide g, k and v repeated with v's
           exchange buffers, 2 KVa e less the output and returned tensor not yet allocated (2 Q e); the local
           attention: the fp32 output accumulator (16-bit only: Q x 4), a pair's kernel output and log-sum-exp
           and the merge's row vectors (Q/C e, 4 R/C x 4) and the kernel's workspace for a pair of Q/C and KVa/C.
           (q's, k's and v's exchanges, 2 Q e at most, come before the saved tensors that outweigh them.)
  backward the output gradient's exchange (send, receive, re-laid copy: 3 Q e); the local backward: the re-laid
           gradient Q e, fp32 dq, dk, dv accumulators (Q + KVa) x 4, a pair's kernel gradients (Q + KVa)/C e, the
           copied rows of the log-sum-exp R/C x 4 and the workspace; the gradients cast to e beside the fp32
           accumulators and the re-laid gradient (16-bit only: (Q + KVa)(4 + e) + Q e); the re-laid gradients
           (Q + KVa) e beside dq's exchange (Q e send, Q e result, and Q e receive where b > 1).
The kernel's workspace beside its outputs, per pair of fq Q and fk KV (device "cuda": flash-attention 2, from its
source, not measured here; "cpu": torch's CPU flash kernel, measured by tests/planner/test_cp_buffers.py):
  cuda  forward none; backward the fp32 dq accumulator fq Q x 4 and rowsum(dO * O) fq R x 4, and with grouped
        queries (n > g) dk and dv expanded to n heads, (n/g) fk KV e.
  cpu   forward the packed 16-bit K/V, fk KV e (none in fp32); backward fq Q e; plus a per-thread scratch of
        about 0.5-1.7 MiB (its block sizes: not counted).
Where the math path runs instead (float64; devices or dtypes without a fused kernel) the kernel's output and
workspace terms are replaced by the query-row tiles of parallel/cp_blocks.py: at most one 64 MiB score tile in
forward and two in backward, plus the tile's rows of q, dO and O copied to fp32.
"""

from __future__ import annotations

import math

from ..config import ModelConfig

_FP32 = 4
PAIRS = ((1.0, 1.0), (1.0, 0.5), (0.5, 1.0))  # (query rows, keys) fractions: diagonal, lower, higher rank's block


def _workspace(device: str, e: int, n: int, g: int, q: float, r: float, kv: float) -> tuple[float, float]:
    """(forward, backward) workspace of the fused kernel for one pair of q elements, r rows and kv K/V elements."""
    if device == "cpu":
        return (kv * e if e < _FP32 else 0.0), q * e
    return 0.0, q * _FP32 + r * _FP32 + (kv * e * n // g if n > g else 0.0)


def cp_attention_buffers(model: ModelConfig, micro_batch_size: int, tp: int, cp: int, comm_type: str = "p2p",
                         device: str = "cuda") -> tuple[int, int]:
    """(forward, backward) bytes the context-parallel attention core holds in flight beside what it saves (and, in
    backward, beside the q, k, v gradients it returns), on one rank of `device` kind: the module docstring's terms."""
    if cp <= 1:
        return 0, 0
    s, b, d, e = model.seq_length // cp, micro_batch_size, model.head_dim, model.dtype_bytes
    n, g = model.num_attention_heads // tp, max(1, model.query_groups // tp)
    q, r, kv = b * n * s * d, b * n * s, 2 * b * g * s * d
    if comm_type == "a2a":
        return _a2a_buffers(device, e, n, g, cp, b, q, r, kv)
    fwd = bwd = 0.0
    out_acc = q * _FP32 if e < _FP32 else 0  # in fp32 the accumulator becomes the saved output
    for step in range(cp):
        blocks = 2 if step + 1 < cp else 1
        for fq, fk in (PAIRS[:1] if step == 0 else PAIRS[1:]):
            ws_f, ws_b = _workspace(device, e, n, g, fq * q, fq * r, fk * kv)
            merge = 0.0 if step == 0 else 3 * fq * r * _FP32
            fwd = max(fwd, blocks * kv * e + out_acc + fq * q * e + fq * r * _FP32 + merge + ws_f)
            accumulators = (1 if step == 0 else 3) * kv * _FP32 + q * _FP32
            lse_rows = fq * r * _FP32 if fq < 1 else 0.0
            bwd = max(bwd, blocks * kv * e + accumulators + fq * q * e + fk * kv * e + lse_rows + ws_b)
    return int(fwd), int(bwd)


def _a2a_buffers(device: str, e: int, n: int, g: int, cp: int, b: int, q: int, r: int, kv: int) -> tuple[int, int]:
    m = math.lcm(g, cp)  # kv heads after the repeat: a rank holds m/C of them over s, beside n/C query heads
    kva = kv * m // g
    ws_f, ws_b = _workspace(device, e, n, m, q / cp, r / cp, kva / cp)
    relaid = 1 if b == 1 else 2  # the output's send copy, and its receive buffer where the re-lay copies (b > 1)
    repeated = max(0, 2 * kva * e - 2 * q * e) if g % cp else 0
    out_acc = q * _FP32 if e < _FP32 else 0
    fwd = max(relaid * q * e, repeated, out_acc + q / cp * e + 4 * r / cp * _FP32 + ws_f)
    local = q * e + (q + kva) * _FP32 + (q + kva) / cp * e + r / cp * _FP32 + ws_b
    casts = (q + kva) * (_FP32 + e) + q * e if e < _FP32 else 0
    exchanges = (q + kva) * e + (relaid + 1) * q * e
    return int(fwd), int(max(3 * q * e, local, casts, exchanges))
