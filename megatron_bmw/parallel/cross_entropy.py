"""Cross-entropy over logits split along the vocabulary, without gathering them."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .groups import group_size
from .state import ParallelState


def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> None:
    if group_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_start):
        ctx.in_dtype = logits.dtype
        logits_max = logits.max(dim=-1).values.float()
        _all_reduce(logits_max, group, dist.ReduceOp.MAX)
        # one fp32 [tokens, vocab/tp] tensor from here on, worked in place as Megatron does; the caller's logits
        # stay as they are (an fp32 input is copied by the subtraction, a 16-bit one by the upcast)
        if logits.dtype == torch.float32:
            logits = logits - logits_max.unsqueeze(-1)
        else:
            logits = logits.float().sub_(logits_max.unsqueeze(-1))
        vocab_local = logits.size(-1)
        local = target - vocab_start
        outside = (local < 0) | (local >= vocab_local)
        local = local.masked_fill(outside, 0)
        predicted = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        _all_reduce(predicted, group)
        exp = logits.exp_()
        sum_exp = exp.sum(dim=-1)
        _all_reduce(sum_exp, group)
        loss = sum_exp.log() - predicted
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local, outside = ctx.saved_tensors
        grad = softmax  # its only reader is this backward: the gradient takes its place (no fp32 copies)
        grad.scatter_add_(-1, local.unsqueeze(-1), -(~outside).to(grad.dtype).unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """Per-token loss [*] from logits [*, vocab/tp] and target ids [*] (global vocabulary ids)."""
    vocab_start = state.tp_rank * logits.size(-1)
    return _VocabParallelCrossEntropy.apply(logits, target, state.tp_group, vocab_start)
