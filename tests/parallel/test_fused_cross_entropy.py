"""--cross-entropy-loss-fusion: the fused vocab-parallel cross entropy against the unfused one (loss and logits
gradient), over chunks of tokens with a ragged last one, over two vocabulary shards (in one process: two threads
whose all-reduces meet), and what it allocates against the memory model's transient."""

import threading

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_bmw.config import ModelConfig
from megatron_bmw.parallel import fused_cross_entropy as fused
from megatron_bmw.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_bmw.parallel.fused_cross_entropy import fused_vocab_parallel_cross_entropy
from megatron_bmw.parallel.state import ParallelState
from megatron_bmw.planner.unit_activations import unit_backward_bytes
from megatron_bmw.units import CROSS_ENTROPY_CHUNK_BYTES, cross_entropy_chunk_tokens
from tests.parallel.test_cross_entropy import NewTensors

S, B, V = 7, 3, 96  # 21 tokens
TIGHT = dict(rtol=1e-6, atol=1e-7)
BF16 = dict(rtol=1.6e-2, atol=1e-5)


def _case(dtype, v=V, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(S, B, v, generator=g)).to(dtype)
    target = torch.randint(0, v, (S, B), generator=g)
    return logits, target, torch.rand(S, B, generator=g)


def _loss_and_grad(fn, logits, target, weights, **kw):
    x = logits.clone().requires_grad_()
    loss = fn(x * 1, target, ParallelState.serial(), **kw)  # a non-leaf, as the output layer gives
    (grad,) = torch.autograd.grad(loss, x, weights)
    return loss, grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_tokens", [1, 4, 21, 64])  # 4: five chunks and a ragged one of 1
def test_fused_equals_unfused(dtype, chunk_tokens):
    logits, target, weights = _case(dtype)
    ref_loss, ref_grad = _loss_and_grad(vocab_parallel_cross_entropy, logits, target, weights)
    loss, grad = _loss_and_grad(fused_vocab_parallel_cross_entropy, logits, target, weights,
                                chunk_bytes=chunk_tokens * V * 4)
    assert grad.dtype == dtype and loss.dtype == torch.float32
    tol = TIGHT if dtype == torch.float32 else BF16
    torch.testing.assert_close(loss, ref_loss, **tol)
    torch.testing.assert_close(grad, ref_grad, **tol)
    full = logits.float().view(-1, V).requires_grad_()  # and the plain loss
    torch.testing.assert_close(loss, F.cross_entropy(full, target.view(-1), reduction="none").view(S, B),
                               **(dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else BF16))


def test_chunk_rule():
    assert cross_entropy_chunk_tokens(8192, 128 * 1024) == 128  # 64 MiB of fp32 rows of a 128k vocabulary
    assert cross_entropy_chunk_tokens(21, V, 4 * V * 4) == 4
    assert cross_entropy_chunk_tokens(21, V, 1) == 1 and cross_entropy_chunk_tokens(21, V, 1 << 30) == 21
    assert fused._chunks(21, V, 4 * V * 4) == [(0, 4), (4, 8), (8, 12), (12, 16), (16, 20), (20, 21)]


def _two_shards(monkeypatch, dtype, chunk_bytes):
    """The loss and the gradient of each of two vocabulary shards, each shard's forward in its own thread and
    their all-reduces summed (or maxed) across the two, as a tp group of 2 does."""
    barrier, slots = threading.Barrier(2, timeout=30), [None, None]

    def all_reduce(x, rank, op=dist.ReduceOp.SUM):  # the shard's rank stands for its group
        slots[rank] = x.clone()
        barrier.wait()
        both = torch.maximum(slots[0], slots[1]) if op == dist.ReduceOp.MAX else slots[0] + slots[1]
        barrier.wait()
        x.copy_(both)

    monkeypatch.setattr(fused, "_all_reduce", all_reduce)
    logits, target, weights = _case(dtype, 2 * V, seed=3)
    target[0] = torch.tensor([0, V, 2 * V - 1])  # the first and the last id of each shard
    out = [None, None]

    def shard(rank):
        x = logits[..., rank * V:(rank + 1) * V].clone().requires_grad_()
        loss = fused._FusedVocabParallelCrossEntropy.apply(x * 1, target, rank, rank * V, chunk_bytes)
        out[rank] = (loss, torch.autograd.grad(loss, x, weights)[0])

    threads = [threading.Thread(target=shard, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return logits, target, weights, out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_vocabulary_shards(monkeypatch, dtype):
    """Targets in either shard (outside the other's range): each shard's loss is the whole vocabulary's, its
    gradient the whole gradient's columns."""
    logits, target, weights, out = _two_shards(monkeypatch, dtype, 4 * V * 4)
    full = logits.float().requires_grad_()
    ref = F.cross_entropy(full.view(-1, 2 * V), target.view(-1), reduction="none").view(S, B)
    (ref_grad,) = torch.autograd.grad(ref, full, weights)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else BF16
    for rank, (loss, grad) in enumerate(out):
        torch.testing.assert_close(loss, ref, **tol)
        torch.testing.assert_close(grad.float(), ref_grad[..., rank * V:(rank + 1) * V], **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_bytes", [None, 4 * V * 4])  # the default rule (one chunk here); five and a ragged one
def test_allocates_one_fp32_chunk_as_the_memory_model_counts(dtype, chunk_bytes):
    """Nothing of the logits' size: the forward upcasts one chunk at a time, the backward (16-bit logits) too
    and writes the gradient into the logits' buffer (fp32: in place); the largest is one fp32 chunk,
    unit_backward_bytes' under the default rule."""
    logits, target, weights = _case(dtype)
    chunk = cross_entropy_chunk_tokens(S * B, V, chunk_bytes or CROSS_ENTROPY_CHUNK_BYTES) * V
    x = logits.clone().requires_grad_()
    y = x * 1
    with NewTensors() as forward:
        loss = fused_vocab_parallel_cross_entropy(y, target, ParallelState.serial(), chunk_bytes=chunk_bytes)
    with NewTensors() as backward:
        (grad,) = torch.autograd.grad(loss, y, weights)
    assert grad.data_ptr() == y.data_ptr()  # the gradient took the logits' buffer
    z = x * 1
    again = fused_vocab_parallel_cross_entropy(z, target, ParallelState.serial(), chunk_bytes=chunk_bytes)
    torch.autograd.grad(again, z, weights, retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):  # its logits are the gradient now
        torch.autograd.grad(again, z, weights)
    big = [(dt, n) for dt, n in forward.allocated + backward.allocated if n > S * B]
    assert max(n for _, n in big) == chunk and {dt for dt, _ in big} == {torch.float32}
    ragged = [chunk] * (S * B * V // chunk) + ([S * B * V % chunk] if S * B * V % chunk else [])
    assert [n for _, n in backward.allocated if n > S * B] == ([] if dtype == torch.float32 else ragged)
    if chunk_bytes is None:
        model = ModelConfig(seq_length=S, vocab_size=V, params_dtype="fp32" if dtype == torch.float32 else "bf16",
                            cross_entropy_loss_fusion=True)
        assert unit_backward_bytes("head", model, B) == chunk * 4
