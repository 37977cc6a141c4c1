"""Context parallelism as Megatron-core does it: each sequence of length s is cut into 2C chunks (C the cp size) and
cp rank r holds chunks r and 2C-1-r, in that order (its local sequence has s/C rows); with causal attention every
rank then does the same work. Attention over the whole sequence is spread over the cp group two ways:

- "p2p", a ring: C steps; at step i a rank attends its queries to the K/V block that started on cp rank
  (r - i) mod C, while the next block travels (sent to r+1, received from r-1). Partial results are merged by
  log-sum-exp in fp32. With the chunk layout a block from a lower rank is seen whole by every local query through
  its first chunk only (its second chunk lies in the future of all of them), and a block from a higher rank is
  seen whole by the local second chunk only: off the diagonal a step computes half a block, unmasked.
  The backward runs a second ring: K/V travel again, and fp32 dK/dV accumulators travel one step behind them, so
  each block's gradient is back on its owner after the full cycle; dQ accumulates locally.
- "a2a", Ulysses: an all-to-all scatters the heads and gathers the sequence (q [b, n, s_loc, d] -> [b, n/C, s, d],
  the rows in chunk order: rank 0's rows, then rank 1's, ...), the causal attention runs locally by the same
  pairs, and an all-to-all brings the output back to [b, n, s_loc, d].

What backward keeps (the planner's memory model counts exactly this; no tensor of size s^2 or s_loc^2 is saved):

- p2p: the q, k, v given (q [b, n, s_loc, d], k and v [b, g, s_loc, d], their dtype), the output ([b, n, s_loc, d],
  q's dtype) and the log-sum-exp (fp32 [b, n, s_loc]; float64 for float64). (The positions are not kept.)
- a2a: the same bytes in the other layout: q, k, v and the output after the all-to-all ([b, n/C, s, d] and
  [b, g/C, s, d]) and the log-sum-exp (fp32 [b, n/C, s]). When g is not divisible by C, each kv head is first
  repeated to m = lcm(g, C) heads (a rank's n/C query heads then read m/C whole ones), so k and v are kept at m/C
  heads ((m/g) times the bytes of the given k and v; MQA at C = 2: twice). The given q, k, v are not kept.
- p2p and a2a under selective recomputation: the checkpoint keeps the q, k, v given (views of the QKV output where
  they are views; gpt.py copies q out of the grouped rows where a rank holds several groups of several heads).
- C == 1 (or a2a's local step): the same set, q, k, v, output and fp32 log-sum-exp.

Each (query block, key block) pair is attended by parallel/cp_blocks.py: torch's fused flash-attention kernel
where one takes the dtype and device (CPU: fp32, bf16, fp16; CUDA: fp16, bf16), else (float64 always) explicit
math in query-row tiles whose fp32 (float64) score buffer is at most cp_blocks.TILE_BYTES (64 MiB). With the chunk
layout every pair is unmasked or aligned-causal (the diagonal, in the local order of increasing positions).

What is allocated while it runs (transient, freed by the return), with e the input's element size and
kv = 2 * b * g * s_loc * d elements (one K/V block, K and V packed); planner/cp_buffers.py counts it term by term:

- p2p forward: 2 K/V blocks in q's dtype (the one being attended and sent, the one arriving: kv * e each), the
  fp32 output accumulator [b, n, s_loc, d] (in fp32 it is the saved output) and log-sum-exp (the saved one), and
  per pair the kernel's output and log-sum-exp and the merge's row vectors; no score tile.
- p2p backward: 2 K/V blocks (kv * e each), 3 fp32 dK/dV accumulators (kv * 4 each: the one being filled, the one
  sent last step, the one arriving), the fp32 dQ accumulator [b, n, s_loc, d], and per pair the kernel's dq, dk,
  dv and its workspace (the math path: two score tiles of at most TILE_BYTES instead).
- a2a: the all-to-all buffers (a contiguous copy and the received tensor of q, k, v, the output and, in backward,
  their gradients), the fp32 accumulators at [b, n/C, s, d], and per pair what the ring's pair holds.

Every isend/irecv is waited on before the function returns, and every rank posts the same transfers in the same
order, so a rank never leaves a transfer its peer waits for.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..errors import UsageError
from . import cp_blocks
from .mappings import with_adjoint

_KV_TAG, _DKV_TAG = 11, 12  # gloo matches a receive by (source, tag); NCCL ignores tags and keeps posting order


def chunk_positions(seq_length: int, cp: int, cp_rank: int, device=None) -> torch.Tensor:
    """int64 [seq_length // cp]: the global positions this cp rank holds (chunk r then chunk 2cp-1-r)."""
    if cp < 1 or not 0 <= cp_rank < cp:
        raise ValueError(f"cp rank {cp_rank} of a context-parallel size {cp}")
    if cp == 1:
        return torch.arange(seq_length, dtype=torch.int64, device=device)
    if seq_length % (2 * cp):
        raise ValueError(f"sequence length {seq_length} is not divisible by 2 x the context-parallel size {cp}")
    c = seq_length // (2 * cp)
    first = torch.arange(cp_rank * c, (cp_rank + 1) * c, dtype=torch.int64, device=device)
    second = torch.arange((2 * cp - 1 - cp_rank) * c, (2 * cp - cp_rank) * c, dtype=torch.int64, device=device)
    return torch.cat([first, second])


def split_sequence(t: torch.Tensor, dim: int, cp: int, cp_rank: int) -> torch.Tensor:
    """The rows of `t` along `dim` (the sequence dim) this cp rank holds, contiguous."""
    if cp < 1 or not 0 <= cp_rank < cp:
        raise ValueError(f"cp rank {cp_rank} of a context-parallel size {cp}")
    if cp == 1:
        return t.contiguous()
    s = t.size(dim)
    if s % (2 * cp):
        raise ValueError(f"dimension {dim} of size {s} is not divisible by 2 x the context-parallel size {cp}")
    c = s // (2 * cp)
    return torch.cat([t.narrow(dim, cp_rank * c, c), t.narrow(dim, (2 * cp - 1 - cp_rank) * c, c)], dim=dim)


def context_attention(q, k, v, positions, group, ranks: tuple[int, ...], scale: float, comm_type: str = "p2p"):
    """Causal attention of this rank's queries over the whole sequence's keys, spread over the cp group.

    q: [b, n, s_loc, d]; k, v: [b, g, s_loc, d] with n = g * per (grouped-query attention, k and v not repeated:
    query head i reads kv head i // per); positions: int64 [s_loc], chunk_positions of this rank (the ring and
    the all-to-all rely on the chunk layout: only its shape is checked, the pairs follow the layout); group: the cp
    ProcessGroup (None here is the default group when len(ranks) > 1; len(ranks) == 1 is plain causal attention
    and never communicates); ranks: its global ranks in cp-rank order; scale: the softmax scale.
    Causal by global position. Returns [b, n, s_loc, d] in q's dtype, differentiable in q, k, v."""
    if comm_type not in ("p2p", "a2a"):
        raise UsageError(f"--cp-comm-type {comm_type}: not one of p2p, a2a")
    _check_shapes(q, k, v, positions)
    if len(ranks) == 1:
        return _LocalAttention.apply(q, k, v, 1, scale)
    if comm_type == "p2p":
        return ring_attention(q, k, v, positions, group, ranks, scale)
    return _ulysses(q, k, v, positions, group, ranks, scale)


def ring_attention(q, k, v, positions, group, ranks, scale: float, overlap: bool = True):
    """context_attention's p2p ring; overlap=False waits for each transfer before computing (benchmarks)."""
    return _RingAttention.apply(q, k, v, group, tuple(ranks), scale, overlap)


def _check_shapes(q, k, v, positions) -> None:
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"q [b, n, s, d] and k, v [b, g, s, d] expected, got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    b, n, s, d = q.shape
    if (k.size(0), k.size(2), k.size(3)) != (b, s, d) or n % k.size(1):
        raise ValueError(f"k, v {tuple(k.shape)} do not fit q {tuple(q.shape)} (n must be a multiple of g)")
    if positions.shape != (s,):
        raise ValueError(f"positions {tuple(positions.shape)}: one per local row ({s}) expected")


# ---- the pairs: this rank's queries (some rows) against one K/V block (some rows) -------------------------------

def _pair(r: int, src: int, rows: int) -> tuple[slice, slice, bool]:
    """Which query rows of rank r's block see which key rows of rank src's block, and whether the pair is
    aligned-causal (else unmasked).

    Rank r holds chunks (r, 2C-1-r), each rows // 2 long. src == r: the diagonal, causal along the rows (the
    positions increase). src < r: chunk src is before both of r's chunks, chunk 2C-1-src after both: every query sees
    the first half, whole. src > r: chunk r is before both of src's chunks, chunk 2C-1-r after both: the second half
    sees everything."""
    half = rows // 2
    if src == r:
        return slice(None), slice(None), True
    if src < r:
        return slice(None), slice(0, half), False
    return slice(half, None), slice(None), False


def _accumulators(q):
    """The fp32 (float64 for float64) output [b, n, s, d] and log-sum-exp [b, n, s], filled by the first pair."""
    wide = cp_blocks.wide_dtype(q.dtype)
    return torch.empty(q.shape, dtype=wide, device=q.device), torch.empty(q.shape[:-1], dtype=wide, device=q.device)


def _rows(x, sel: slice):
    return x[:, :, sel]


# ---- the ring ---------------------------------------------------------------------------------------------------

class _Transfer:
    """Send `send` to the next cp rank and receive a tensor like it from the previous one, both in flight until
    wait() (which returns the received tensor; waiting twice is harmless)."""

    def __init__(self, send: torch.Tensor, group, ranks: tuple[int, ...], r: int, tag: int) -> None:
        c = len(ranks)
        self.received = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, ranks[(r + 1) % c], group, tag),
               dist.P2POp(dist.irecv, self.received, ranks[(r - 1) % c], group, tag)]
        self._requests = dist.batch_isend_irecv(ops)

    def wait(self) -> torch.Tensor:
        for req in self._requests:
            req.wait()
        self._requests = []
        return self.received


def _ring_forward(q, k, v, group, ranks, scale: float, overlap: bool):
    c, r = len(ranks), dist.get_rank(group)
    out, lse = _accumulators(q)
    kv = torch.stack([k, v])
    for i in range(c):  # step 0 is the diagonal, which covers every row: it fills the accumulators
        src = (r - i) % c
        incoming = _Transfer(kv, group, ranks, r, _KV_TAG) if i + 1 < c else None
        if incoming is not None and not overlap:
            incoming.wait()
        rows, cols, causal = _pair(r, src, q.size(2))
        cp_blocks.block_forward(_rows(q, rows), _rows(kv[0], cols), _rows(kv[1], cols), causal, scale,
                                _rows(out, rows), _rows(lse, rows), first=i == 0)
        if incoming is not None:
            kv = incoming.wait()
            incoming = None
    return out, lse


def _ring_backward(do, q, k, v, out, lse, group, ranks, scale: float, overlap: bool):
    c, r = len(ranks), dist.get_rank(group)
    wide = cp_blocks.wide_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=wide, device=q.device)
    kv, behind = torch.stack([k, v]), None  # behind: the accumulator of this step's block, arriving from r-1
    for i in range(c):
        src = (r - i) % c
        incoming = _Transfer(kv, group, ranks, r, _KV_TAG) if i + 1 < c else None
        if incoming is not None and not overlap:
            incoming.wait()
        dkv = torch.zeros(kv.shape, dtype=wide, device=q.device)
        rows, cols, causal = _pair(r, src, q.size(2))
        cp_blocks.block_backward(_rows(do, rows), _rows(q, rows), _rows(kv[0], cols), _rows(kv[1], cols),
                                 _rows(out, rows), _rows(lse, rows).contiguous(), causal, scale, _rows(dq, rows),
                                 _rows(dkv[0], cols), _rows(dkv[1], cols))
        if behind is not None:
            dkv += behind.wait()
            behind = None  # frees the block sent last step and the one just added
        behind = _Transfer(dkv, group, ranks, r, _DKV_TAG)  # to r+1; block src's own gradient arrives last
        if not overlap:
            behind.wait()
        if incoming is not None:
            kv = incoming.wait()
            incoming = None
    dkv = behind.wait()  # this rank's own block, summed over every rank's queries
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, ranks, scale, overlap):
        out, lse = _ring_forward(q, k, v, group, ranks, scale, overlap)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.ranks, ctx.scale, ctx.overlap = group, ranks, scale, overlap
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(do.contiguous(), q, k, v, out, lse, ctx.group, ctx.ranks, ctx.scale,
                                    ctx.overlap)
        return dq, dk, dv, None, None, None, None


# ---- local attention by pairs (C == 1, and the a2a path's attention over the gathered sequence) -----------------

def _local_pairs(tiles: int, rows: int):
    """(query rows, key rows, aligned-causal) of every pair of S = tiles x rows rows in chunk order (tile j: cp rank
    j's rows), each tile's diagonal first (it covers the tile's every row)."""
    for i in range(tiles):
        at = slice(i * rows, (i + 1) * rows)
        for j in [i] + [j for j in range(tiles) if j != i]:
            r_sel, c_sel, causal = _pair(i, j, rows)
            q_rows = range(at.start, at.stop)[r_sel]
            k_rows = range(j * rows, (j + 1) * rows)[c_sel]
            yield slice(q_rows.start, q_rows.stop), slice(k_rows.start, k_rows.stop), causal, j == i


def _local_forward(q, k, v, tiles: int, scale: float):
    out, lse = _accumulators(q)
    for q_sel, k_sel, causal, first in _local_pairs(tiles, q.size(2) // tiles):
        cp_blocks.block_forward(_rows(q, q_sel), _rows(k, k_sel), _rows(v, k_sel), causal, scale,
                                _rows(out, q_sel), _rows(lse, q_sel), first)
    return out, lse


def _local_backward(do, q, k, v, out, lse, tiles: int, scale: float):
    wide = cp_blocks.wide_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=wide, device=q.device)
    dk = torch.zeros(k.shape, dtype=wide, device=q.device)
    dv = torch.zeros_like(dk)
    for q_sel, k_sel, causal, _ in _local_pairs(tiles, q.size(2) // tiles):
        cp_blocks.block_backward(_rows(do, q_sel), _rows(q, q_sel), _rows(k, k_sel), _rows(v, k_sel),
                                 _rows(out, q_sel), _rows(lse, q_sel).contiguous(), causal, scale,
                                 _rows(dq, q_sel), _rows(dk, k_sel), _rows(dv, k_sel))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _LocalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, tiles, scale):
        out, lse = _local_forward(q, k, v, tiles, scale)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.tiles, ctx.scale = tiles, scale
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _local_backward(do.contiguous(), q, k, v, out, lse, ctx.tiles, ctx.scale)
        return dq, dk, dv, None, None


# ---- Ulysses: all-to-all over heads and sequence ------------------------------------------------------------------

def _seq_to_heads(x: torch.Tensor, group, c: int) -> torch.Tensor:
    """[b, h, s_loc, d] on each cp rank -> [b, h / c, c * s_loc, d]: this rank's heads, every rank's rows (in cp-rank
    order)."""
    b, h, s, d = x.shape
    send = x.reshape(b, c, h // c, s, d).transpose(0, 1).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // c, c * s, d)


def _heads_to_seq(x: torch.Tensor, group, c: int) -> torch.Tensor:
    """The inverse of _seq_to_heads: [b, h / c, c * s_loc, d] -> [b, h, s_loc, d]."""
    b, hc, cs, d = x.shape
    send = x.reshape(b, hc, c, cs // c, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.transpose(0, 1).reshape(b, hc * c, cs // c, d)


def _ulysses(q, k, v, positions, group, ranks, scale: float):
    c, n, g = len(ranks), q.size(1), k.size(1)
    if n % c:
        raise UsageError(f"--cp-comm-type a2a: the {n} attention heads per tensor-parallel rank are not divisible "
                         f"by --context-parallel-size {c}")
    if g % c:  # the kv heads cannot be scattered: repeat each to lcm(g, C) heads, so each rank gets whole ones
        rep = math.lcm(g, c) // g  # (n is a multiple of lcm(g, C); a rank's n/C query heads read its own copies)
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    qh, kh, vh = (with_adjoint(x, _seq_to_heads, _heads_to_seq, group, c) for x in (q, k, v))
    del q, k, v  # the repeated k and v are not needed past their all-to-all
    return with_adjoint(_LocalAttention.apply(qh, kh, vh, c, scale), _heads_to_seq, _seq_to_heads, group, c)
