"""Megatron-format log lines, the statistics of a log interval, Megatron's FLOPs count, and a TensorBoard writer
that degrades to a no-op."""

from __future__ import annotations

import datetime
import math
import time
from collections.abc import Mapping

import torch
import torch.distributed as dist

from ..config import ModelConfig
from ..parallel.state import ParallelState
from ..parallel.expert_params import counted_in_world, experts_anywhere
from .optimizer import counts_in_grad_norm


def timestamp() -> str:
    """Megatron's ` [YYYY-MM-DD HH:MM:SS]` prefix of an iteration line (local time)."""
    return f" [{datetime.datetime.now().strftime('%Y-%m-%d %H:%M:%S')}]"


def gpt_train_flops(model: ModelConfig, batch_size: int) -> float:
    """FLOPs of one training iteration (forward and backward) of `batch_size` sequences, by Megatron-LM's
    num_floating_point_operations for a GPT (no MoE): 12 FLOPs per weight per token in the transformer layers
    (3 passes x 2 per multiply-add x 2 GEMMs per block), the key and value projections scaled by the query
    groups, causal attention counted half, SwiGLU's third matrix, and the logit layer."""
    h, s, L = model.hidden_size, model.seq_length, model.num_layers
    attention = 12 * L * h * h * (1 + model.query_groups / model.num_attention_heads + s / h / 2)
    mlp = 12 * L * h * model.ffn_hidden_size * (1.5 if model.swiglu else 1.0)
    logits = 6 * h * model.vocab_size
    return float(batch_size) * s * (attention + mlp + logits)


def throughput_tflops(model: ModelConfig, batch_size: int, seconds_per_iteration: float, world_size: int) -> float:
    """Megatron's `throughput per GPU (TFLOP/s/GPU)`."""
    return gpt_train_flops(model, batch_size) / (seconds_per_iteration * 1e12 * world_size)


def _counted(named_params, state: ParallelState) -> tuple[list[torch.nn.Parameter], bool]:
    """Each parameter once over the model-parallel ranks (as the grad norm counts them), trainable only; with
    experts each once over the world (expert_params.py)."""
    seen, out = set(), []
    world = experts_anywhere([p for _, p in named_params], state)
    for _, p in named_params:
        counted = counted_in_world(p, state, sharded=False) if world else counts_in_grad_norm(p, state.tp_rank)
        if p.requires_grad and id(p) not in seen and counted:
            seen.add(id(p))
            out.append(p)
    return out, world


def _mp_sum(value: torch.Tensor, state: ParallelState, world: bool = False) -> float:
    if state.units.norms_over_world or world:  # per-unit strategies, experts: counted elements lie on every rank
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(value)
    elif state.mp_group is not None:
        dist.all_reduce(value, group=state.mp_group)
    return float(value.item())


@torch.no_grad()
def params_norm(named_params, state: ParallelState) -> float:
    """L2 norm of all model parameters (Megatron's `params norm`), over every model-parallel rank."""
    sq = torch.zeros(1, dtype=torch.float64, device=state.device)
    params, world = _counted(named_params, state)
    for p in params:
        sq += p.detach().double().square().sum()
    return _mp_sum(sq, state, world) ** 0.5


@torch.no_grad()
def num_zeros_in_grad(named_params, state: ParallelState) -> float:
    """Zero entries of the gradients the optimizer just used (Megatron's `num zeros`), over every model-parallel
    rank; gradients are the same on every data-parallel rank."""
    zeros = torch.zeros(1, dtype=torch.float64, device=state.device)
    params, world = _counted(named_params, state)
    for p in params:
        g = getattr(p, "main_grad", None)
        zeros += p.numel() if g is None else (g == 0).sum().double()
    return _mp_sum(zeros, state, world)


class IntervalStats:
    """What one log interval saw: Megatron averages the loss over the iterations that were not skipped and omits
    it when there were none; NaN losses are counted apart."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.loss_sum, self.advanced, self.iterations, self.skipped, self.nan = 0.0, 0, 0, 0, 0
        self.part_sums: dict[str, float] = {}
        self.aux_sums: dict[str, float] = {}
        self.start = time.time()

    def add(self, loss: float, successful: bool, parts: Mapping[str, float] | None = None,
            aux: Mapping[str, float] | None = None) -> None:
        """`parts`: the loss's named terms when it has several (BERT: lm loss, sop loss); `aux`: losses beside it
        (MoE's load_balancing_loss, z_loss: training/moe_logging.py)."""
        self.iterations += 1
        if not math.isfinite(loss):
            self.nan += 1
        if not successful:
            self.skipped += 1
        elif math.isfinite(loss):
            self.loss_sum += loss
            self.advanced += 1
            for key, value in (parts or {}).items():
                self.part_sums[key] = self.part_sums.get(key, 0.0) + value
            for key, value in (aux or {}).items():
                self.aux_sums[key] = self.aux_sums.get(key, 0.0) + value

    def losses(self) -> dict[str, float | None]:
        """The interval's mean losses by name, as the log line shows them: `lm loss` (the whole loss), or each
        named term, then the auxiliary losses; None values when every iteration was skipped or NaN."""
        mean = lambda sums: {key: total / self.advanced for key, total in sums.items()}  # noqa: E731
        return {**(mean(self.part_sums) if self.part_sums else {"lm loss": self.loss}), **mean(self.aux_sums)}

    @property
    def loss(self) -> float | None:
        """Mean lm loss of the iterations that stepped; None when every one was skipped or NaN."""
        return self.loss_sum / self.advanced if self.advanced else None

    def seconds_per_iteration(self) -> float:
        return (time.time() - self.start) / max(self.iterations, 1)


def format_train_log(
    *,
    iteration: int,
    train_iters: int,
    consumed_samples: int,
    elapsed_ms: float,
    learning_rate: float,
    global_batch_size: int,
    losses: Mapping[str, float],
    loss_scale: float,
    grad_norm: float | None = None,
    num_zeros: float | None = None,
    params_norm: float | None = None,
    skipped_iters: int = 0,
    nan_iters: int = 0,
    throughput: float | None = None,
    prefix: str = "",
) -> str:
    """One training log line, field for field as Megatron prints it (`losses` already averaged; a loss that is
    None is omitted, as Megatron omits an interval's loss when every iteration was skipped). `prefix`: Megatron's
    ` [date time]` (see `timestamp`)."""
    parts = [
        f"{prefix} iteration {iteration:8d}/{train_iters:8d} |",
        f" consumed samples: {consumed_samples:12d} |",
        f" elapsed time per iteration (ms): {elapsed_ms:.1f} |",
    ]
    if throughput is not None:
        parts.append(f" throughput per GPU (TFLOP/s/GPU): {throughput:.1f} |")
    parts += [
        f" learning rate: {learning_rate:.6E} |",
        f" global batch size: {global_batch_size:5d} |",
    ]
    parts += [f" {key}: {value:.6E} |" for key, value in losses.items() if value is not None]
    parts.append(f" loss scale: {loss_scale:.1f} |")
    if grad_norm is not None:
        parts.append(f" grad norm: {grad_norm:.3f} |")
    if num_zeros is not None:
        parts.append(f" num zeros: {num_zeros:.1f} |")
    if params_norm is not None:
        parts.append(f" params norm: {params_norm:.3f} |")
    parts.append(f" number of skipped iterations: {skipped_iters:3d} |")
    parts.append(f" number of nan iterations: {nan_iters:3d} |")
    return "".join(parts)


def format_validation_log(iteration: int, loss: float | Mapping[str, float], label: str | None = None) -> str:
    """`validation loss at iteration N | lm loss value: ... | lm loss PPL: ... | ` (PPL = exp(min(20, loss)))."""
    losses = loss if isinstance(loss, Mapping) else {"lm loss": loss}
    out = f"validation loss at {label or f'iteration {iteration}'} | "
    for key, value in losses.items():
        value = float(value)
        ppl = math.exp(min(20.0, value))
        out += f"{key} value: {value:.6E} | {key} PPL: {ppl:.6E} | "
    return out


class TensorBoardWriter:
    """Scalars to TensorBoard event files; does nothing without a log dir or without tensorboard."""

    def __init__(self, log_dir: str | None, max_queue: int = 1000) -> None:
        self._writer = None
        if log_dir is None:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            return
        self._writer = SummaryWriter(log_dir=log_dir, max_queue=max_queue)

    @property
    def enabled(self) -> bool:
        return self._writer is not None

    def add_scalars(self, scalars: Mapping[str, float], step: int) -> None:
        """Each entry as its own scalar series (tag = key), like Megatron's `writer.add_scalar` calls."""
        if self._writer is None:
            return
        for tag, value in scalars.items():
            if value is not None:
                self._writer.add_scalar(tag, float(value), step)

    def add_text(self, tag: str, text: str, step: int = 0) -> None:
        if self._writer is not None:
            self._writer.add_text(tag, text, step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
