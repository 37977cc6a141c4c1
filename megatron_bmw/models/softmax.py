"""Scale-mask-softmax that keeps only its output, in the input's precision (as Megatron's fused kernels).

The softmax is computed in fp32; what backward keeps is the result cast back to the scores' dtype, so a 16-bit
run saves 2 bytes per score instead of the 4 of an fp32 softmax, and no mask is saved at all. Two masks: causal
(GPT: future positions) and padding (BERT: keys that are padding, given per sample).
"""

from __future__ import annotations

import torch


def _backward(ctx, grad):
    (probs,) = ctx.saved_tensors
    p, g = probs.float(), grad.float()
    return (p * (g - (g * p).sum(dim=-1, keepdim=True)) * ctx.scale).to(grad.dtype), None, None


def _softmax(ctx, scores, scale, masked):
    fill = torch.finfo(torch.float32).min  # a row with every key masked becomes uniform, not NaN
    probs = (scores.float() * scale).masked_fill_(masked, fill).softmax(dim=-1).to(scores.dtype)
    ctx.scale = scale
    ctx.save_for_backward(probs)
    return probs


class _CausalSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores, scale, _unused):
        causal = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu_(1)
        return _softmax(ctx, scores, scale, causal)

    backward = staticmethod(_backward)


class _PaddingSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores, scale, keep):
        return _softmax(ctx, scores, scale, ~keep)

    backward = staticmethod(_backward)


def causal_softmax(scores: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(scores * scale) over the last dim with future positions masked out."""
    return _CausalSoftmax.apply(scores, scale, None)


def padding_softmax(scores: torch.Tensor, scale: float, keep: torch.Tensor) -> torch.Tensor:
    """softmax(scores * scale) over the keys (last dim) where `keep` (bool, broadcast to the scores, e.g.
    [b, 1, 1, s]) is True; the other keys get probability 0."""
    return _PaddingSoftmax.apply(scores, scale, keep)
