"""The optimizer, mixed precision and the learning-rate schedule."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UsageError
from .schema import check_ranges, flag

LR_DECAY_STYLES = ("constant", "linear", "cosine")


def _check_lr(lr: float, min_lr: float, lr_flag: str = "--lr", min_flag: str = "--min-lr") -> None:
    if lr < 0:
        raise UsageError(f"{lr_flag} must be >= 0, got {lr}")
    if min_lr < 0:
        raise UsageError(f"{min_flag} must be >= 0, got {min_lr}")
    if min_lr > lr:
        raise UsageError(f"{min_flag} {min_lr} exceeds {lr_flag} {lr}")


O, T, P = "optimizer and learning rate", "training", "parallelism"  # flag groups


@dataclass
class OptimizerConfig:
    lr: float = flag("--lr", group=O, cli_default=1e-4)  # LRConfig's peak is the same flag's
    min_lr: float = flag("--min-lr", group=O, default=0.0)
    weight_decay: float = flag("--weight-decay", group=O, default=0.01, minimum=0.0)
    adam_beta1: float = flag("--adam-beta1", group=O, default=0.9, minimum=0.0, below=1.0)
    adam_beta2: float = flag("--adam-beta2", group=O, default=0.999, minimum=0.0, below=1.0)
    adam_eps: float = flag("--adam-eps", group=O, default=1e-8, above=0.0)
    clip_grad: float = flag("--clip-grad", group=O, default=1.0)
    fp16: bool = flag("--fp16", group=T, default=False, action="store_true")
    bf16: bool = flag("--bf16", group=T, default=False, action="store_true")
    loss_scale: float | None = flag("--loss-scale", group=T, default=None,
                                    above=0.0)  # a constant scale for fp16; None = dynamic
    initial_loss_scale: float = flag("--initial-loss-scale", group=T, default=2.0**32)
    min_loss_scale: float = flag("--min-loss-scale", group=T, default=1.0, above=0.0)
    loss_scale_window: int = flag("--loss-scale-window", group=T, default=1000, minimum=1)
    hysteresis: int = flag("--hysteresis", group=T, default=2, minimum=1)
    use_distributed_optimizer: bool = flag("--use-distributed-optimizer", group=P, default=False, action="store_true")
    overlap_param_gather: bool = flag(  # the ZeRO-1 parameter all-gather runs during the next forward
        "--overlap-param-gather", group=P, default=False, action="store_true",
        help="with --use-distributed-optimizer: all-gather the updated parameters during the next forward")
    param_bucket_size: int = 40_000_000  # elements per ZeRO-1 gather bucket (no flag; as GradSync's buckets)

    def __post_init__(self) -> None:
        if self.fp16 and self.bf16:
            raise UsageError("--fp16 and --bf16 are mutually exclusive")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise UsageError("--overlap-param-gather is only supported with the distributed optimizer "
                             "(give --use-distributed-optimizer)")
        _check_lr(self.lr, self.min_lr)
        check_ranges(self)
        if self.clip_grad < 0:
            raise UsageError(f"--clip-grad must be >= 0 (0 disables clipping), got {self.clip_grad}")
        if self.initial_loss_scale < self.min_loss_scale:
            raise UsageError(
                f"--initial-loss-scale {self.initial_loss_scale} is below --min-loss-scale {self.min_loss_scale}"
            )


@dataclass
class LRConfig:
    """The learning-rate schedule. As in Megatron it counts samples: iteration-based lengths (--lr-decay-iters,
    --lr-warmup-iters) are multiplied by `global_batch_size`; with --train-samples the lengths are samples."""

    lr: float  # OptimizerConfig's --lr and --min-lr
    min_lr: float = 0.0
    lr_decay_style: str = flag("--lr-decay-style", group=O, default="linear", choices=LR_DECAY_STYLES)
    lr_decay_iters: int | None = flag("--lr-decay-iters", group=O, default=None)  # None = train_iters
    lr_warmup_iters: int = flag("--lr-warmup-iters", group=O, default=0)
    lr_warmup_fraction: float | None = flag(  # fraction of the decay length; excludes the other warm-up flags
        "--lr-warmup-fraction", group=O, default=None)
    train_iters: int | None = None  # TrainConfig's
    global_batch_size: int = 1  # samples per iteration, for the iteration-based lengths
    train_samples: int | None = None  # sample-based training (TrainConfig's --train-samples)
    lr_decay_samples: int | None = flag("--lr-decay-samples", group=O, default=None)  # None = train_samples
    lr_warmup_samples: int = flag("--lr-warmup-samples", group=O, default=0)
    # Megatron's --decoupled-lr/--decoupled-min-lr: the word embedding's and output layer's own peak and floor
    # (the floor defaults to min_lr), on the same warm-up and decay
    decoupled_lr: float | None = flag(
        "--decoupled-lr", group=O, default=None,
        help="peak learning rate of the word embedding and output layer (same warm-up and decay)")
    decoupled_min_lr: float | None = flag("--decoupled-min-lr", group=O, default=None,
                                          help="their final learning rate (default --min-lr)")
    warmup_init: float = flag("--lr-warmup-init", group=O, default=0.0, dest="lr_warmup_init",
                              help="the learning rate the warm-up starts from")

    def __post_init__(self) -> None:
        if self.warmup_init < 0:
            raise UsageError(f"--lr-warmup-init must be >= 0, got {self.warmup_init}")
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise UsageError(
                f"--lr-decay-style must be one of {', '.join(LR_DECAY_STYLES)}, not {self.lr_decay_style!r}"
            )
        _check_lr(self.lr, self.min_lr)
        if self.decoupled_min_lr is not None and self.decoupled_lr is None:
            raise UsageError("--decoupled-min-lr needs --decoupled-lr")
        if self.decoupled_lr is not None:
            _check_lr(self.decoupled_lr, self.decoupled_floor, "--decoupled-lr",
                      "--decoupled-min-lr" if self.decoupled_min_lr is not None else "--min-lr")
        if self.global_batch_size < 1:
            raise UsageError(f"--global-batch-size must be >= 1, got {self.global_batch_size}")
        if self.lr_warmup_fraction is not None:
            if self.lr_warmup_iters or self.lr_warmup_samples:
                flag = "--lr-warmup-iters" if self.lr_warmup_iters else "--lr-warmup-samples"
                raise UsageError(f"--lr-warmup-fraction and {flag} are mutually exclusive")
            if not 0.0 <= self.lr_warmup_fraction < 1.0:
                raise UsageError(f"--lr-warmup-fraction must be in [0, 1), got {self.lr_warmup_fraction}")
        if self.train_samples is not None:
            self._check_samples()
        else:
            self._check_iterations()
        if self.warmup_steps >= self.decay_steps:
            unit = "samples" if self.train_samples is not None else "iters"
            raise UsageError(f"--lr-warmup-{unit} must end before --lr-decay-{unit} ends (warm-up "
                             f"{self.warmup_steps:g} samples, decay {self.decay_steps:g} samples)")

    @property
    def decoupled_floor(self) -> float:
        """The decoupled parameters' final learning rate."""
        return self.decoupled_min_lr if self.decoupled_min_lr is not None else self.min_lr

    def _check_iterations(self) -> None:
        if self.lr_decay_samples is not None or self.lr_warmup_samples:
            flag = "--lr-decay-samples" if self.lr_decay_samples is not None else "--lr-warmup-samples"
            raise UsageError(f"{flag} needs sample-based training (--train-samples); with --train-iters use "
                             f"{flag.replace('samples', 'iters')}")
        if self.lr_decay_iters is None:
            self.lr_decay_iters = self.train_iters
        if self.lr_decay_iters is None:
            raise UsageError("--lr-decay-iters is required when --train-iters is not given")
        if self.lr_decay_iters <= 0:
            raise UsageError(f"--lr-decay-iters must be > 0, got {self.lr_decay_iters}")
        if self.lr_warmup_iters < 0:
            raise UsageError(f"--lr-warmup-iters must be >= 0, got {self.lr_warmup_iters}")

    def _check_samples(self) -> None:
        if self.lr_decay_iters is not None or self.lr_warmup_iters:
            flag = "--lr-decay-iters" if self.lr_decay_iters is not None else "--lr-warmup-iters"
            raise UsageError(f"{flag} counts iterations; with --train-samples use "
                             f"{flag.replace('iters', 'samples')}")
        if self.lr_decay_samples is None:
            self.lr_decay_samples = self.train_samples
        if self.lr_decay_samples <= 0:
            raise UsageError(f"--lr-decay-samples must be > 0, got {self.lr_decay_samples}")
        if self.lr_warmup_samples < 0:
            raise UsageError(f"--lr-warmup-samples must be >= 0, got {self.lr_warmup_samples}")

    @property
    def decay_steps(self) -> int:
        """Decay length in samples."""
        if self.train_samples is not None:
            return self.lr_decay_samples
        return self.lr_decay_iters * self.global_batch_size

    @property
    def warmup_steps(self) -> float:
        """Warm-up length in samples (fractional when given by --lr-warmup-fraction, like Megatron)."""
        if self.lr_warmup_fraction is not None:
            return self.lr_warmup_fraction * self.decay_steps
        if self.train_samples is not None:
            return float(self.lr_warmup_samples)
        return float(self.lr_warmup_iters * self.global_batch_size)

