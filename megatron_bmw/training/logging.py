"""Megatron-format log lines and a TensorBoard writer that degrades to a no-op."""

from __future__ import annotations

import math
from collections.abc import Mapping


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
) -> str:
    """One training log line, field for field as Megatron prints it (`losses` already averaged)."""
    parts = [
        f" iteration {iteration:8d}/{train_iters:8d} |",
        f" consumed samples: {consumed_samples:12d} |",
        f" elapsed time per iteration (ms): {elapsed_ms:.1f} |",
        f" learning rate: {learning_rate:.6E} |",
        f" global batch size: {global_batch_size:5d} |",
    ]
    parts += [f" {key}: {value:.6E} |" for key, value in losses.items()]
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
