"""torch.distributed.pipelining on our model chunks: the adapter, stages, micro-batches and step the pipeline
benchmarks (pipeline_engine.py, zero_bubble.py) share.

torch's stages run the *same* chunk objects (same Parameters) as our engine. The last stage returns the chunk's
own scalar loss (the code our engine runs), so the schedule's loss_fn is the identity and scale_grads=True divides
the accumulated gradients by m, which equals our engine's loss/m before each backward.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from megatron_bmw.config import ModelConfig


class StageAdapter(nn.Module):
    """torch.pipelining view of one chunk: the first stage takes the tokens [b, s], the others the hidden state
    [s, b, h]; the last returns the micro-batch's loss. torch passes the step's keyword arguments (labels,
    loss_mask) to every stage; only the last reads them."""

    def __init__(self, chunk: nn.Module, first: bool, last: bool) -> None:
        super().__init__()
        self.chunk, self.first, self.last = chunk, first, last

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None,
                loss_mask: torch.Tensor | None = None) -> torch.Tensor:
        batch = {"labels": labels, "loss_mask": loss_mask} if self.last else {}
        if self.first:
            return self.chunk(None, {**batch, "tokens": x})
        return self.chunk(x, batch)


def identity_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return output  # the last stage already returns the micro-batch's loss


def torch_stage(chunk: nn.Module, index: int, num_stages: int, device, hidden_shape: tuple[int, int, int],
                dtype: torch.dtype, tokens: torch.Tensor):
    """A PipelineStage for virtual stage `index` of `num_stages` around `chunk`, with static shapes (`tokens`: one
    micro-batch's tokens); requires_grad marks which activations carry gradients back."""
    from torch.distributed.pipelining import PipelineStage

    first, last = index == 0, index == num_stages - 1
    hidden = torch.empty(hidden_shape, dtype=dtype, requires_grad=True)
    outputs = (torch.empty((), requires_grad=True),) if last else (hidden,)
    return PipelineStage(StageAdapter(chunk, first, last), index, num_stages, device,
                         input_args=(tokens,) if first else (hidden,), output_args=outputs)


def torch_step(schedule, full: dict[str, torch.Tensor]) -> list[float]:
    """One iteration of a torch schedule on the whole batch; the per-micro-batch losses on the rank holding the
    last stage, [] elsewhere."""
    losses: list[torch.Tensor] = []
    schedule.step(full["tokens"], target=full["labels"], losses=losses, return_outputs=False,
                  labels=full["labels"], loss_mask=full["loss_mask"])
    return [x.item() for x in losses]


def make_microbatches(cfg: ModelConfig, mbs: int, m: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(m):
        tokens = torch.randint(0, cfg.vocab_size, (mbs, cfg.seq_length + 1), generator=g)
        mask = (torch.rand(mbs, cfg.seq_length, generator=g) > 0.1).float()
        out.append({"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(), "loss_mask": mask})
    return out


def whole_batch(micro: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The micro-batches concatenated, as torch's step splits them again (dimension 0)."""
    return {k: torch.cat([mb[k] for mb in micro]) for k in micro[0]}


def zero_grads(params) -> None:
    for p in params:
        p.grad = None


@contextmanager
def native_linear():
    """Our linear layers as torch.nn.functional.linear while inside (tp = 1 only).

    Our layers run a custom autograd Function (parallel/deferred_wgrad.py) whose backward computes the input and
    the weight gradient in one node; torch's zero-bubble split (pipelining/_backward.py) re-runs such a node for
    the weights, so on our Function its B would do the weight GEMM too and its W both. With F.linear autograd
    computes only the gradients each pass asks for, as for any stock module."""
    from megatron_bmw.parallel import layers

    original = layers.linear

    def linear(x, weight, bias, gather_group=None):
        if gather_group is not None:
            raise ValueError("native_linear: sequence-parallel linear layers are not supported")
        return F.linear(x, weight, bias)

    layers.linear = linear
    try:
        yield
    finally:
        layers.linear = original
