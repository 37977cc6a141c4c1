"""--cross-entropy-loss-fusion: the vocab-parallel cross entropy without an fp32 copy of the logits.

The same math and collectives over the tp group as cross_entropy.py (the row maximum all-reduced with MAX, the
target's logit and the sum of exponentials with SUM), but it saves the logits themselves, in their own dtype (the
loss is their only reader, so their buffer becomes the gradient), with per-token fp32 statistics (the maximum and
the sum of exponentials), the target's local index and the out-of-range mask. Forward and backward work over
chunks of tokens, each upcast to fp32 on its own: at most units.CROSS_ENTROPY_CHUNK_BYTES of fp32 (the rule is
units.cross_entropy_chunk_tokens, which the memory model counts). The backward writes (softmax - one-hot) x
grad_loss chunk by chunk into the saved logits' buffer, in their dtype, and returns it: the caller's logits tensor
must not be read after the backward. A chunk's pointwise work runs through fused.cuda_compiled (one inductor kernel
on CUDA, eager on the CPU), written so that eagerly it holds one fp32 chunk at most (fp32 logits: none in the
backward, which works in place).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..fused import cuda_compiled
from ..units import CROSS_ENTROPY_CHUNK_BYTES, cross_entropy_chunk_tokens
from .cross_entropy import _all_reduce
from .state import ParallelState


@cuda_compiled
def _chunk_sum_exp(chunk: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
    """sum(exp(x - max)) per row of one chunk [n, v/tp], through one fp32 buffer."""
    shifted = chunk - row_max.unsqueeze(-1) if chunk.dtype == torch.float32 \
        else chunk.float().sub_(row_max.unsqueeze(-1))
    return shifted.exp_().sum(dim=-1)


@cuda_compiled
def _chunk_scaled_softmax_(chunk: torch.Tensor, row_max: torch.Tensor, sum_exp: torch.Tensor,
                           grad_loss: torch.Tensor) -> None:
    """chunk <- softmax x grad_loss, in place, computed in fp32 (the cross_entropy.py backward's operations)."""
    if chunk.dtype == torch.float32:
        chunk.sub_(row_max.unsqueeze(-1)).exp_().div_(sum_exp.unsqueeze(-1)).mul_(grad_loss.unsqueeze(-1))
    else:
        chunk.copy_(chunk.float().sub_(row_max.unsqueeze(-1)).exp_().div_(sum_exp.unsqueeze(-1))
                    .mul_(grad_loss.unsqueeze(-1)))


def _chunks(tokens: int, vocab_local: int, chunk_bytes: int):
    step = cross_entropy_chunk_tokens(tokens, vocab_local, chunk_bytes)
    return [(i, min(i + step, tokens)) for i in range(0, tokens, step)]


class _FusedVocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_start, chunk_bytes):
        logits = logits.contiguous()  # (a view of the caller's tensor when contiguous, as the linear layers give)
        flat = logits.view(-1, logits.size(-1))
        tokens, vocab_local = flat.shape
        row_max = flat.amax(dim=-1).float()
        _all_reduce(row_max, group, dist.ReduceOp.MAX)
        local = target.reshape(-1) - vocab_start
        outside = (local < 0) | (local >= vocab_local)
        local = local.masked_fill(outside, 0)
        predicted = (flat.gather(-1, local.unsqueeze(-1)).squeeze(-1).float() - row_max).masked_fill(outside, 0.0)
        _all_reduce(predicted, group)
        sum_exp = torch.empty_like(row_max)
        for i, j in _chunks(tokens, vocab_local, chunk_bytes):
            sum_exp[i:j] = _chunk_sum_exp(flat[i:j], row_max[i:j])
        _all_reduce(sum_exp, group)
        loss = sum_exp.log() - predicted
        ctx.chunk_bytes = chunk_bytes
        ctx.save_for_backward(logits, row_max, sum_exp, local, outside)
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        logits, row_max, sum_exp, local, outside = ctx.saved_tensors
        grad = logits.detach()  # the logits' only reader is this backward: the gradient takes their buffer
        flat = grad.view(-1, grad.size(-1))
        grad_loss = grad_loss.reshape(-1).float()
        for i, j in _chunks(*flat.shape, ctx.chunk_bytes):
            chunk, index = flat[i:j], local[i:j].unsqueeze(-1)
            target = chunk.gather(-1, index).squeeze(-1).float()  # the target's logit, before it is overwritten
            _chunk_scaled_softmax_(chunk, row_max[i:j], sum_exp[i:j], grad_loss[i:j])
            # the target's element: (softmax - 1) x grad_loss, in fp32 as the rest; out-of-shard rows keep theirs
            one_hot = (target.sub_(row_max[i:j]).exp_().div_(sum_exp[i:j]) - 1.0).mul_(grad_loss[i:j])
            keep = chunk.gather(-1, index).squeeze(-1)
            chunk.scatter_(-1, index, torch.where(outside[i:j], keep, one_hot.to(chunk.dtype)).unsqueeze(-1))
        return grad, None, None, None, None


def fused_vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, state: ParallelState,
                                       chunk_bytes: int | None = None) -> torch.Tensor:
    """Per-token loss [*] from logits [*, vocab/tp] and target ids [*] (global vocabulary ids), as
    cross_entropy.vocab_parallel_cross_entropy; `logits` is overwritten by its gradient in the backward. Chunks
    of at most `chunk_bytes` fp32 bytes (default CROSS_ENTROPY_CHUNK_BYTES)."""
    vocab_start = state.tp_rank * logits.size(-1)
    return _FusedVocabParallelCrossEntropy.apply(logits, target, state.tp_group, vocab_start,
                                                 chunk_bytes or CROSS_ENTROPY_CHUNK_BYTES)
