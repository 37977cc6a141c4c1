"""Optimizer and learning-rate schedule settings, with Megatron's defaults and checks."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UsageError

LR_DECAY_STYLES = ("constant", "linear", "cosine")


def _check_lr(lr: float, min_lr: float) -> None:
    if lr < 0:
        raise UsageError(f"--lr must be >= 0, got {lr}")
    if min_lr < 0:
        raise UsageError(f"--min-lr must be >= 0, got {min_lr}")
    if min_lr > lr:
        raise UsageError(f"--min-lr {min_lr} exceeds --lr {lr}")


@dataclass
class OptimizerConfig:
    lr: float
    min_lr: float = 0.0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    fp16: bool = False
    bf16: bool = False
    loss_scale: float | None = None  # a constant scale for fp16; None = dynamic
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    use_distributed_optimizer: bool = False

    def __post_init__(self) -> None:
        if self.fp16 and self.bf16:
            raise UsageError("--fp16 and --bf16 are mutually exclusive")
        _check_lr(self.lr, self.min_lr)
        if self.weight_decay < 0:
            raise UsageError(f"--weight-decay must be >= 0, got {self.weight_decay}")
        for flag, beta in (("--adam-beta1", self.adam_beta1), ("--adam-beta2", self.adam_beta2)):
            if not 0.0 <= beta < 1.0:
                raise UsageError(f"{flag} must be in [0, 1), got {beta}")
        if self.adam_eps <= 0:
            raise UsageError(f"--adam-eps must be > 0, got {self.adam_eps}")
        if self.clip_grad < 0:
            raise UsageError(f"--clip-grad must be >= 0 (0 disables clipping), got {self.clip_grad}")
        if self.loss_scale is not None and self.loss_scale <= 0:
            raise UsageError(f"--loss-scale must be > 0, got {self.loss_scale}")
        if self.min_loss_scale <= 0:
            raise UsageError(f"--min-loss-scale must be > 0, got {self.min_loss_scale}")
        if self.initial_loss_scale < self.min_loss_scale:
            raise UsageError(
                f"--initial-loss-scale {self.initial_loss_scale} is below --min-loss-scale {self.min_loss_scale}"
            )
        if self.loss_scale_window < 1:
            raise UsageError(f"--loss-scale-window must be >= 1, got {self.loss_scale_window}")
        if self.hysteresis < 1:
            raise UsageError(f"--hysteresis must be >= 1, got {self.hysteresis}")


@dataclass
class LRConfig:
    lr: float
    min_lr: float = 0.0
    lr_decay_style: str = "linear"
    lr_decay_iters: int | None = None  # None = train_iters
    lr_warmup_iters: int = 0
    lr_warmup_fraction: float | None = None  # fraction of lr_decay_iters; excludes lr_warmup_iters
    train_iters: int | None = None

    def __post_init__(self) -> None:
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise UsageError(
                f"--lr-decay-style must be one of {', '.join(LR_DECAY_STYLES)}, not {self.lr_decay_style!r}"
            )
        _check_lr(self.lr, self.min_lr)
        if self.lr_decay_iters is None:
            self.lr_decay_iters = self.train_iters
        if self.lr_decay_iters is None:
            raise UsageError("--lr-decay-iters is required when --train-iters is not given")
        if self.lr_decay_iters <= 0:
            raise UsageError(f"--lr-decay-iters must be > 0, got {self.lr_decay_iters}")
        if self.lr_warmup_iters < 0:
            raise UsageError(f"--lr-warmup-iters must be >= 0, got {self.lr_warmup_iters}")
        if self.lr_warmup_fraction is not None:
            if self.lr_warmup_iters:
                raise UsageError("--lr-warmup-fraction and --lr-warmup-iters are mutually exclusive")
            if not 0.0 <= self.lr_warmup_fraction < 1.0:
                raise UsageError(f"--lr-warmup-fraction must be in [0, 1), got {self.lr_warmup_fraction}")
        if self.warmup_steps >= self.lr_decay_iters:
            raise UsageError(
                f"--lr-warmup-iters {self.warmup_steps:g} must be smaller than --lr-decay-iters {self.lr_decay_iters}"
            )

    @property
    def warmup_steps(self) -> float:
        """Warm-up length in iterations (fractional when given by --lr-warmup-fraction, like Megatron)."""
        if self.lr_warmup_fraction is not None:
            return self.lr_warmup_fraction * self.lr_decay_iters
        return float(self.lr_warmup_iters)
