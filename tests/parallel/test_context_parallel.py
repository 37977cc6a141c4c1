"""Context parallelism (parallel/context_parallel.py): the chunk layout, and attention spread over the cp group (the
p2p ring and the a2a all-to-all) against serial causal attention in float64, forward and backward."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_bmw.errors import UsageError
from megatron_bmw.parallel import cp_blocks
from megatron_bmw.parallel.context_parallel import (chunk_positions, context_attention, ring_attention,
                                                    split_sequence)
from tests.dist_harness import run_distributed


# ---- the layout (no processes) -----------------------------------------------------------------------------------

@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("chunk", [1, 3])
def test_the_ranks_positions_are_a_permutation_made_of_chunks_r_and_2cp_minus_1_minus_r(cp, chunk):
    s = 2 * cp * chunk
    held = [chunk_positions(s, cp, r) for r in range(cp)]
    assert all(p.dtype == torch.int64 and p.shape == (s // cp,) for p in held)
    assert sorted(torch.cat(held).tolist()) == list(range(s))
    chunks = torch.arange(s).view(2 * cp, chunk)
    for r, p in enumerate(held):
        assert p.tolist() == torch.cat([chunks[r], chunks[2 * cp - 1 - r]]).tolist()


@pytest.mark.parametrize("dim", [0, 1, 2, -1])
def test_split_sequence_takes_the_rows_chunk_positions_names_along_any_dim(dim):
    t = torch.randn(16, 8, 24, 32)
    for cp in (1, 2, 4):
        for r in range(cp):
            part = split_sequence(t, dim, cp, r)
            pos = chunk_positions(t.size(dim), cp, r)
            assert part.is_contiguous()
            assert torch.equal(part, t.index_select(dim, pos))


def test_split_sequence_is_differentiable_and_layouts_refuse_ragged_lengths():
    x = torch.randn(2, 8, requires_grad=True)
    split_sequence(x, 1, 2, 1).sum().backward()
    assert x.grad.tolist() == [[0, 0, 1, 1, 1, 1, 0, 0]] * 2
    with pytest.raises(ValueError, match="not divisible by 2 x"):
        chunk_positions(12, 4, 0)
    with pytest.raises(ValueError, match="not divisible by 2 x"):
        split_sequence(torch.zeros(6), 0, 2, 0)
    with pytest.raises(ValueError, match="cp rank 2"):
        chunk_positions(8, 2, 2)


# ---- the reference -----------------------------------------------------------------------------------------------

def _reference(q, k, v, scale):
    """Serial causal attention over the whole sequence, k/v heads repeated to q's (float64 in the tests)."""
    per = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(per, 1), v.repeat_interleave(per, 1)
    s = q.size(2)
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    return scores.softmax(-1) @ v


def _inputs(seed, b, n, g, s, d, dtype):
    gen = torch.Generator().manual_seed(seed)
    q, do = (torch.randn(b, n, s, d, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(b, g, s, d, generator=gen, dtype=torch.float64) for _ in range(2))
    return [x.to(dtype) for x in (q, k, v, do)]


def _run_case(rank, cp, comm, b, n, g, s, d, dtype, overlap=True):
    """(output, dq, dk, dv) of this rank's rows and the reference's same rows, both float64, and the saved tensors."""
    q, k, v, do = _inputs(1000 * s + 10 * n + g, b, n, g, s, d, dtype)
    scale = 1.0 / math.sqrt(d)
    pos = chunk_positions(s, cp, rank)
    local = [split_sequence(x, 2, cp, rank).requires_grad_(x is not do) for x in (q, k, v, do)]
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype, t.untyped_storage().data_ptr()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if comm == "p2p" and not overlap:
            out = ring_attention(*local[:3], pos, None, tuple(range(cp)), scale, overlap=False)
        else:
            out = context_attention(*local[:3], pos, None, tuple(range(cp)), scale, comm_type=comm)
    out.backward(local[3])
    ref_in = [x.double().requires_grad_() for x in (q, k, v)]
    ref = _reference(*ref_in, scale)
    ref.backward(do.double())
    got = [out, *(x.grad for x in local[:3])]
    want = [ref, *(x.grad for x in ref_in)]
    ptrs = {x.untyped_storage().data_ptr(): name for x, name in zip(local[:3] + [out], "qkvo")}
    return ([a.detach().double() for a in got], [w.detach()[:, :, pos] for w in want],
            [(shape, dtype, ptrs.get(p, "")) for shape, dtype, p in saved])


CASES = [  # (comm, b, n, g, s, d, dtype, overlap)
    ("p2p", 2, 4, 4, 16, 8, torch.float32, True), ("p2p", 2, 4, 2, 48, 8, torch.float32, True),
    ("p2p", 2, 4, 1, 32, 8, torch.float32, True), ("p2p", 2, 4, 2, 32, 8, torch.float32, False),
    ("p2p", 2, 4, 2, 32, 8, torch.float64, True),
    ("a2a", 2, 4, 4, 16, 8, torch.float32, True), ("a2a", 2, 4, 2, 48, 8, torch.float32, True),
    ("a2a", 2, 4, 1, 32, 8, torch.float32, True), ("a2a", 2, 4, 2, 32, 8, torch.float64, True),
]


def _check_all(rank, world_size, cases, math_tile=None):
    """Every case on this rank: output and gradients against the reference rows, and what autograd saved.
    math_tile: run the math path (no fused kernel) in query-row tiles of this many score bytes."""
    report = []
    for comm, b, n, g, s, d, dtype, overlap in cases:
        cp_blocks.USE_FUSED, cp_blocks.TILE_BYTES = math_tile is None, math_tile or 64 * 2 ** 20
        try:
            got, want, saved = _run_case(rank, world_size, comm, b, n, g, s, d, dtype, overlap)
        finally:
            cp_blocks.USE_FUSED, cp_blocks.TILE_BYTES = True, 64 * 2 ** 20
        tol = 1e-12 if dtype == torch.float64 else 2e-6
        for name, a, w in zip(("out", "dq", "dk", "dv"), got, want):
            err = ((a - w).abs().max() / w.abs().max()).item()
            assert err < tol, f"{comm} n={n} g={g} s={s} {dtype} overlap={overlap}: {name} off by {err:.2e}"
        report.append((comm, n, g, s, str(dtype), saved))
    n = 2 * world_size - 1  # every rank refuses before any transfer
    with pytest.raises(UsageError, match=f"a2a: the {n} attention heads per tensor-parallel rank are not divisible "
                                         f"by --context-parallel-size {world_size}"):
        q = kv = torch.zeros(1, n, 2, 2)
        context_attention(q, kv, kv, chunk_positions(2 * world_size, world_size, rank), None,
                          tuple(range(world_size)), 1.0, comm_type="a2a")
    return report


def _itemsize(dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _check_saved(report, cp):
    for comm, n, g, s, dtype, saved in report:
        b, d, s_loc = 2, 8, s // cp
        e = _itemsize(getattr(torch, dtype.split(".")[1]))
        lse_e = max(e, 4)
        expected = b * s_loc * d * (2 * n + 2 * g) * e + b * n * s_loc * lse_e
        total = sum(math.prod(shape) * _itemsize(dt) for shape, dt, _ in saved)
        if comm == "p2p":
            assert [who for *_, who in saved] == ["q", "k", "v", "o", ""], saved
            assert saved[4][:2] == ((b, n, s_loc), torch.float32 if e == 4 else torch.float64)
            assert total == expected, (comm, n, g, saved)
        elif g % cp == 0:  # a2a scatters the kv heads: the same bytes in the other layout
            assert len(saved) == 5 and total == expected, (comm, n, g, saved)
        else:  # each kv head repeated to lcm(g, cp) heads first (cp // g per rank's query heads' group)
            m = math.lcm(g, cp)
            assert len(saved) == 5 and total == expected + 2 * b * s_loc * d * (m - g) * e, (comm, n, g, saved)


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4])
def test_context_attention_equals_serial_causal_attention_forward_and_backward(cp):
    reports = run_distributed(cp, _check_all, CASES)
    for report in reports:
        _check_saved(report, cp)


@pytest.mark.slow
def test_the_math_path_in_small_query_row_tiles_is_as_exact():
    """Without the fused kernel, tiles of 2-3 query rows (a 2 KiB score budget) give the same results."""
    cases = [c for c in CASES if c[6] == torch.float32 and c[7]]
    for report in run_distributed(2, _check_all, cases, 2048):
        _check_saved(report, 2)


def test_tile_rows_fit_the_budget():
    assert cp_blocks.tile_rows(2, 4, 1024, 4, 64 * 2 ** 20) == 2048
    assert cp_blocks.tile_rows(1, 32, 65536, 4) == 8  # 128k tokens at cp 2: 8 rows of 32 heads x 64k keys, 64 MiB
    assert cp_blocks.tile_rows(1, 64, 2 ** 20, 8, 1) == 1


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("g", [4, 1])
def test_a_pair_by_the_fused_kernel_equals_the_math_path_in_tiles(causal, g, monkeypatch):
    """One pair merged into accumulators holding another: the CPU flash kernel (fp32) against the math path in
    3-row tiles, forward (output, log-sum-exp) and backward (dq, dk, dv with the final output and lse)."""
    q, k, v, do = _inputs(5, 2, 4, g, 16, 8, torch.float32)
    results = []
    for fused in (True, False):
        monkeypatch.setattr(cp_blocks, "USE_FUSED", fused)
        monkeypatch.setattr(cp_blocks, "TILE_BYTES", 3 * 2 * 4 * 16 * 4)
        out = torch.zeros(2, 4, 16, 8)
        lse = torch.full((2, 4, 16), 0.5)
        cp_blocks.block_forward(q, k, v, causal, 0.3, out, lse, first=False)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        cp_blocks.block_backward(do, q, k, v, out.to(q.dtype), lse, causal, 0.3, dq, dk, dv)
        results.append([out, lse, dq, dk, dv])
    for a, b in zip(*results):
        assert ((a - b).abs().max() / b.abs().max()).item() < 2e-6


def test_a_single_cp_rank_is_plain_causal_attention_with_the_same_saved_set():
    q, k, v, do = _inputs(7, 2, 4, 2, 12, 8, torch.float32)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = context_attention(q, k, v, torch.arange(12), None, (0,), 0.25)
    out.backward(do)
    ref_in = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = _reference(*ref_in, 0.25)
    ref.backward(do.double())
    for a, w in zip([out, q.grad, k.grad, v.grad], [ref, *(x.grad for x in ref_in)]):
        assert ((a.double() - w).abs().max() / w.abs().max()).item() < 2e-6
    with pytest.raises(UsageError, match="--cp-comm-type ring: not one of p2p, a2a"):
        context_attention(q, k, v, torch.arange(12), None, (0, 1), 0.25, comm_type="ring")


def test_16_bit_inputs_keep_their_dtype_and_save_an_fp32_log_sum_exp():
    q, k, v, do = _inputs(3, 1, 4, 1, 8, 8, torch.bfloat16)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((tuple(t.shape), t.dtype)) or t,
                                                  lambda t: t):
        out = context_attention(q, k, v, torch.arange(8), None, (0,), 0.5)
    out.backward(do)
    assert out.dtype == q.grad.dtype == k.grad.dtype == v.grad.dtype == torch.bfloat16
    assert saved == [((1, 4, 8, 8), torch.bfloat16), ((1, 1, 8, 8), torch.bfloat16), ((1, 1, 8, 8), torch.bfloat16),
                     ((1, 4, 8, 8), torch.bfloat16), ((1, 4, 8), torch.float32)]
    ref = _reference(*(x.detach().double() for x in (q, k, v)), 0.5)
    assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < 1e-2
