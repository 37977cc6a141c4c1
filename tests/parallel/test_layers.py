"""Every tensor-parallel layer against its serial PyTorch counterpart, on 2 and 4 gloo ranks."""

import pytest
import torch
import torch.nn.functional as F

from megatron_bmw.config import ParallelConfig
from megatron_bmw.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_bmw.parallel.fused_cross_entropy import fused_vocab_parallel_cross_entropy
from megatron_bmw.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megatron_bmw.parallel.mappings import gather_from_sp, reduce_scatter_to_sp, scatter_to_sp
from megatron_bmw.parallel.random import RNGTracker, set_seeds
from megatron_bmw.parallel.state import ParallelState
from tests.dist_harness import run_distributed

TOL = dict(rtol=1e-5, atol=1e-6)


def _data(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _layers_case(rank, world_size, sequence_parallel):
    st = ParallelState.build(ParallelConfig(tensor_model_parallel_size=world_size, sequence_parallel=sequence_parallel))
    t, r = world_size, st.tp_rank
    s, b, h, o = 4 * t, 2, 8, 4 * t
    w, bias, x = _data(o, h, seed=1), _data(o, seed=2), _data(s, b, h, seed=3)

    # column-parallel (output gathered) vs F.linear
    col = ColumnParallelLinear(w, bias, st, gather_output=True)
    xin = (x.chunk(t, 0)[r] if sequence_parallel else x).clone().requires_grad_()
    y = col(xin)
    ref_x = x.clone().requires_grad_()
    ref_w, ref_b = w.clone().requires_grad_(), bias.clone().requires_grad_()
    ref = F.linear(ref_x, ref_w, ref_b)
    torch.testing.assert_close(y, ref, **TOL)
    g = _data(*ref.shape, seed=4)
    y.backward(g)
    ref.backward(g)
    torch.testing.assert_close(col.weight.grad, ref_w.grad.chunk(t, 0)[r], **TOL)
    torch.testing.assert_close(col.bias.grad, ref_b.grad.chunk(t, 0)[r], **TOL)
    expect_x = ref_x.grad.chunk(t, 0)[r] if sequence_parallel else ref_x.grad
    torch.testing.assert_close(xin.grad, expect_x, **TOL)

    # row-parallel (input split on features) vs F.linear
    w2, b2 = _data(h, o, seed=5), _data(h, seed=6)
    row = RowParallelLinear(w2, b2, st)
    z = _data(s, b, o, seed=7)
    zin = z.chunk(t, -1)[r].clone().requires_grad_()
    out = row(zin)
    ref_z, ref_w2 = z.clone().requires_grad_(), w2.clone().requires_grad_()
    ref_out = F.linear(ref_z, ref_w2, b2)
    expect = ref_out.chunk(t, 0)[r] if sequence_parallel else ref_out
    torch.testing.assert_close(out, expect, **TOL)
    g2 = _data(*ref_out.shape, seed=8)
    out.backward(g2.chunk(t, 0)[r] if sequence_parallel else g2)
    ref_out.backward(g2)
    torch.testing.assert_close(row.weight.grad, ref_w2.grad.chunk(t, 1)[r], **TOL)
    torch.testing.assert_close(zin.grad, ref_z.grad.chunk(t, -1)[r], **TOL)
    return True


def _embedding_and_loss_case(rank, world_size):
    st = ParallelState.build(ParallelConfig(tensor_model_parallel_size=world_size))
    t, r = world_size, st.tp_rank
    vocab, h = 8 * t, 6
    table = _data(vocab, h, seed=1)
    ids = torch.randint(0, vocab, (3, 5), generator=torch.Generator().manual_seed(2))
    emb = VocabParallelEmbedding(table, st)
    out = emb(ids)
    ref_table = table.clone().requires_grad_()
    ref = F.embedding(ids, ref_table)
    torch.testing.assert_close(out, ref, **TOL)
    g = _data(*ref.shape, seed=3)
    out.backward(g)
    ref.backward(g)
    torch.testing.assert_close(emb.weight.grad, ref_table.grad.chunk(t, 0)[r], **TOL)

    logits = _data(3, 5, vocab, seed=4)
    local = logits.chunk(t, -1)[r].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, ids, st)
    ref_logits = logits.clone().requires_grad_()
    ref_loss = F.cross_entropy(ref_logits.view(-1, vocab), ids.view(-1), reduction="none").view(3, 5)
    torch.testing.assert_close(loss, ref_loss, **TOL)
    gl = _data(3, 5, seed=5)
    loss.backward(gl)
    ref_loss.backward(gl)
    torch.testing.assert_close(local.grad, ref_logits.grad.chunk(t, -1)[r], **TOL)
    # --cross-entropy-loss-fusion over the tp group, in chunks of 4 tokens (15: a ragged last one)
    fused_local = logits.chunk(t, -1)[r].clone().requires_grad_()
    fused = fused_vocab_parallel_cross_entropy(fused_local * 1, ids, st, chunk_bytes=4 * 8 * 4)
    torch.testing.assert_close(fused, ref_loss, **TOL)
    fused.backward(gl)
    torch.testing.assert_close(fused_local.grad, ref_logits.grad.chunk(t, -1)[r], **TOL)
    return True


def _sequence_mappings_case(rank, world_size):
    st = ParallelState.build(ParallelConfig(tensor_model_parallel_size=world_size))
    g = st.tp_group
    x = _data(4 * world_size, 2, 3, seed=rank)  # differs per rank
    full = torch.cat([_data(4 * world_size, 2, 3, seed=q) for q in range(world_size)], 0)
    xin = x.clone().requires_grad_()
    gathered = gather_from_sp(xin, g, tp_output_grad=False)
    torch.testing.assert_close(gathered, full)
    gathered.sum().backward()
    torch.testing.assert_close(xin.grad, torch.ones_like(x))
    rs = reduce_scatter_to_sp(x, g)
    total = sum(_data(4 * world_size, 2, 3, seed=q) for q in range(world_size))
    torch.testing.assert_close(rs, total.chunk(world_size, 0)[st.tp_rank], **TOL)
    torch.testing.assert_close(scatter_to_sp(full, g), full.chunk(world_size, 0)[st.tp_rank])
    return True


def _rng_case(rank, world_size):
    st = ParallelState.build(ParallelConfig(tensor_model_parallel_size=world_size))
    set_seeds(1234, st.tp_rank, st.pp_rank, st.rng)
    outside = torch.rand(4)
    with st.rng.fork():
        inside = torch.rand(4)
    after = torch.rand(4)
    return outside, inside, after


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_linear_layers_match_serial(world_size, sequence_parallel):
    assert all(run_distributed(world_size, _layers_case, sequence_parallel))


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_embedding_and_cross_entropy_match_serial(world_size):
    assert all(run_distributed(world_size, _embedding_and_loss_case))


@pytest.mark.slow
def test_sequence_parallel_mappings():
    assert all(run_distributed(2, _sequence_mappings_case))


@pytest.mark.slow
def test_tp_rng_differs_inside_tp_region_only():
    (o0, i0, a0), (o1, i1, a1) = run_distributed(2, _rng_case)
    assert torch.equal(o0, o1) and torch.equal(a0, a1)
    assert not torch.equal(i0, i1)


def test_tracker_fork_leaves_default_stream_untouched():
    tr = RNGTracker()
    tr.add("x", 5)
    torch.manual_seed(0)
    a = torch.rand(3)
    torch.manual_seed(0)
    with tr.fork("x"):
        torch.rand(10)
    assert torch.equal(torch.rand(3), a)
