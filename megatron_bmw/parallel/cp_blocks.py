"""The attention of one (query block, key/value block) pair of context-parallel attention, merged into running fp32
accumulators (parallel/context_parallel.py drives the ring and the all-to-all over these pairs).

With the chunk layout every pair is one of two kinds: unmasked (every query sees every key) or aligned-causal
(a square block whose row i sees keys 0..i: the diagonal, where a rank's queries meet its own keys, whose positions
increase along the rows). Two ways to compute a pair:

- fused: torch's flash-attention kernel, which returns the block's output and fp32 log-sum-exp, and whose backward
  takes the FINAL output and log-sum-exp (so it recomputes the probabilities of the whole attention and returns
  this block's share of dq, dk, dv), as ring flash-attention implementations use it. On CPU
  aten::_scaled_dot_product_flash_attention_for_cpu and its _backward (fp32, bf16, fp16: within 1e-6 relative of
  float64 in fp32, and several times faster than the explicit math on CPU); on CUDA
  aten::_scaled_dot_product_flash_attention and its _backward (fp16 and bf16, head dim a multiple of 8 up to
  256, where torch was built with flash attention; NOT exercised by this repository's CPU tests). Both take
  grouped k, v (n a multiple of g) as they are.
- math (the fallback, and float64 always: the tests' exact reference): explicit scores in fp32 (float64 for
  float64), processed in query-row tiles of `tile_rows` rows, so that one tile's score buffer [b, n, rows, s_kv]
  is at most TILE_BYTES (64 MiB; at least one row): forward holds one such tile (scores, turned into
  probabilities in place), backward two (probabilities, and dP turned into dS in place). An aligned-causal tile
  of rows [r0, r1) only reads keys [0, r1).

The accumulators: out (fp32, float64 for float64) [b, n, sq, d] and lse [b, n, sq]; dq [b, n, sq, d], dk and dv
[b, g, sk, d] (fp32, float64 for float64). Callers pass views of them (the rows and keys of the pair).
"""

from __future__ import annotations

import torch

TILE_BYTES = 64 * 2 ** 20  # the math path's score tile: at most this many bytes (fp32 or float64 elements)
USE_FUSED = True  # tests set False to run the math path on the dtypes the fused kernels take


def wide_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the accumulators (and the math path) use: fp32, float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


def tile_rows(b: int, n: int, sk: int, itemsize: int, budget: int | None = None) -> int:
    """Query rows per math-path tile: the most whose score buffer b x n x rows x sk x itemsize fits `budget`
    (default TILE_BYTES), at least one."""
    return max(1, (TILE_BYTES if budget is None else budget) // (b * n * sk * itemsize))


def fused_kind(q: torch.Tensor) -> str | None:
    """"cpu" or "cuda" where a fused kernel takes q's dtype, device and head dim; None: the math path."""
    if not USE_FUSED or q.dtype == torch.float64:
        return None
    if q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16, torch.float16):
        return "cpu" if hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu") else None
    if q.device.type == "cuda" and q.dtype in (torch.bfloat16, torch.float16) and q.size(-1) % 8 == 0 \
            and q.size(-1) <= 256 and torch.backends.cuda.is_flash_attention_available():
        return "cuda"
    return None


# ---- forward ----------------------------------------------------------------------------------------------------

def block_forward(q, k, v, causal: bool, scale: float, out, lse, first: bool) -> None:
    """Attend q [b, n, sq, d] to k, v [b, g, sk, d] (aligned-causal or not) and merge into out, lse (`first`: they
    hold nothing yet, the block's result is copied in)."""
    kind = fused_kind(q)
    if kind is None:
        _math_forward(q, k, v, causal, scale, out, lse, first)
        return
    if kind == "cpu":
        blk_out, blk_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal,
                                                                                       scale=scale)
    else:
        blk_out, blk_lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False,
                                                                              scale=scale)[:2]
    merge(out, lse, blk_out, blk_lse, first)


def merge(out, lse, blk_out, blk_lse, first: bool) -> None:
    """out, lse <- the softmax-weighted merge of (out, lse) and a block's (blk_out, blk_lse), in place (the block's
    output may be 16-bit: it is read, never copied to fp32)."""
    if first:
        out.copy_(blk_out)
        lse.copy_(blk_lse)
        return
    new = torch.logaddexp(lse, blk_lse)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).addcmul_(blk_out, torch.exp(blk_lse - new).unsqueeze(-1))
    lse.copy_(new)


def _grouped(x: torch.Tensor, g: int) -> torch.Tensor:
    """q-like [b, n, T, d] (any strides) -> [b, g, (n/g) T, d], contiguous: query head j * per + t reads kv head j."""
    b, n, t, d = x.shape
    return x.reshape(b, g, n // g, t, d).reshape(b, g, (n // g) * t, d)


def _causal_mask(r0: int, r1: int, device) -> torch.Tensor:
    """[r1 - r0, r1] bool: row r0 + i sees keys 0..r0 + i."""
    rows = torch.arange(r0, r1, device=device).unsqueeze(1)
    return torch.arange(r1, device=device).unsqueeze(0) <= rows


def _tile_scores(q, k, scale: float, causal: bool, r0: int, r1: int):
    """Scores [b, g, per * T, kc] (wide) of q's rows [r0, r1) against the keys they can see, masked to -inf."""
    wide = wide_dtype(q.dtype)
    kc = r1 if causal else k.size(2)
    qt = _grouped(q[:, :, r0:r1], k.size(1)).to(wide)
    s = torch.matmul(qt, k[:, :, :kc].to(wide).transpose(-1, -2)).mul_(scale)
    if causal:
        per = q.size(1) // k.size(1)
        mask = _causal_mask(r0, r1, q.device).repeat(per, 1)
        s.masked_fill_(~mask, float("-inf"))
    return s, kc


def _math_forward(q, k, v, causal: bool, scale: float, out, lse, first: bool) -> None:
    b, n, sq, _ = q.shape
    g = k.size(1)
    rows = tile_rows(b, n, k.size(2), torch.empty(0, dtype=wide_dtype(q.dtype)).element_size())
    for r0 in range(0, sq, rows):
        r1 = min(sq, r0 + rows)
        s, kc = _tile_scores(q, k, scale, causal, r0, r1)
        m = s.amax(-1, keepdim=True)
        p = s.sub_(m).exp_()
        total = p.sum(-1, keepdim=True)
        blk_lse = (m + total.log()).squeeze(-1)
        blk_out = torch.matmul(p.div_(total), v[:, :, :kc].to(p.dtype))  # [b, g, per * T, d]
        del s, p
        shape = (b, n, r1 - r0)
        merge(out[:, :, r0:r1], lse[:, :, r0:r1], blk_out.view(*shape, -1), blk_lse.view(shape), first)


# ---- backward ---------------------------------------------------------------------------------------------------

def block_backward(do, q, k, v, out, lse, causal: bool, scale: float, dq, dk, dv) -> None:
    """This block's share of the gradients, added into dq [b, n, sq, d], dk, dv [b, g, sk, d]: do, q, out and lse
    are the block's rows of the upstream gradient, the queries and the FINAL output and log-sum-exp."""
    kind = fused_kind(q)
    if kind is None:
        _math_backward(do, q, k, v, out, lse, causal, scale, dq, dk, dv)
        return
    if kind == "cpu":
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, out, lse, 0.0, causal, scale=scale)
    else:
        none = torch.empty(0, dtype=torch.int64, device=q.device)  # no dropout: no sequence offsets, no RNG state
        grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            do, q, k, v, out, lse, none, none, q.size(2), k.size(2), 0.0, causal, none, none, scale=scale)
    for acc, grad in zip((dq, dk, dv), grads):
        acc += grad


def _math_backward(do, q, k, v, out, lse, causal: bool, scale: float, dq, dk, dv) -> None:
    b, n, sq, d = q.shape
    g = k.size(1)
    wide = wide_dtype(q.dtype)
    rows = tile_rows(b, n, k.size(2), torch.empty(0, dtype=wide).element_size())
    for r0 in range(0, sq, rows):
        r1 = min(sq, r0 + rows)
        s, kc = _tile_scores(q, k, scale, causal, r0, r1)
        p = s.sub_(_grouped(lse[:, :, r0:r1].unsqueeze(-1), g)).exp_()  # [b, g, per * T, kc]
        dot = _grouped(do[:, :, r0:r1], g).to(wide)
        delta = (dot * _grouped(out[:, :, r0:r1], g).to(wide)).sum(-1, keepdim=True)  # rowsum(dO * O)
        vw, kw = v[:, :, :kc].to(wide), k[:, :, :kc].to(wide)
        dv[:, :, :kc] += torch.matmul(p.transpose(-1, -2), dot)
        ds = torch.matmul(dot, vw.transpose(-1, -2)).sub_(delta).mul_(p).mul_(scale)
        del s, p
        dq[:, :, r0:r1] += torch.matmul(ds, kw).view(b, n, r1 - r0, d)
        dk[:, :, :kc] += torch.matmul(ds.transpose(-1, -2), _grouped(q[:, :, r0:r1], g).to(wide))
