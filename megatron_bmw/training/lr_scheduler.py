"""Learning-rate schedule: linear warm-up from --lr-warmup-init (default 0), then constant, linear or cosine decay
to min_lr.

Counted in samples, as Megatron's optimizer-parameter scheduler: the loop calls `step(batch)` after every
successful iteration with that iteration's global batch, so a ramped-up batch advances the schedule by what
it consumed. The schedule is evaluated at the current count before it is advanced, so the first iteration of a
warm-up runs with the warm-up's initial lr (0 by default).
"""

from __future__ import annotations

import math
from typing import Protocol

from ..config import LRConfig
from ..errors import UsageError

STEP_UNIT = "samples"  # what num_steps counts in checkpoints written since the count became samples
# the settings a resumed run must agree on with its checkpoint (Megatron's _check_and_set), and their flags
CHECKED = {
    "max_lr": "--lr",
    "min_lr": "--min-lr",
    "lr_warmup_steps": "samples: --lr-warmup-iters, --lr-warmup-samples or --lr-warmup-fraction",
    "lr_decay_steps": "samples: --lr-decay-iters or --lr-decay-samples, by default --train-iters or --train-samples",
    "lr_decay_style": "--lr-decay-style",
}


class _HasLR(Protocol):
    def set_lr(self, lr: float, decoupled_lr: float | None = None) -> None: ...


class LRScheduler:
    def __init__(self, optimizer: _HasLR | None, cfg: LRConfig) -> None:
        self.optimizer = optimizer
        self.max_lr = cfg.lr
        self.min_lr = cfg.min_lr
        self.lr_decay_style = cfg.lr_decay_style
        self.lr_decay_steps = cfg.decay_steps
        self.lr_warmup_steps = cfg.warmup_steps
        self.warmup_init = cfg.warmup_init
        # --decoupled-lr: (peak, floor) of the embedding and output layer, on the same warm-up and decay
        self.decoupled = (cfg.decoupled_lr, cfg.decoupled_floor) if cfg.decoupled_lr is not None else None
        self.num_steps = 0
        self.step(0)

    def get_lr(self, peak: float | None = None, floor: float | None = None) -> float:
        """The learning rate now: of the schedule's own peak and floor, or of those given (--decoupled-lr)."""
        max_lr = self.max_lr if peak is None else peak
        min_lr = self.min_lr if floor is None else floor
        n = self.num_steps
        if self.lr_warmup_steps > 0 and n <= self.lr_warmup_steps:
            return self.warmup_init + (max_lr - self.warmup_init) * n / self.lr_warmup_steps
        if self.lr_decay_style == "constant":
            return max_lr
        if n > self.lr_decay_steps:
            return min_lr
        ratio = (n - self.lr_warmup_steps) / (self.lr_decay_steps - self.lr_warmup_steps)
        if self.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return min_lr + coeff * (max_lr - min_lr)

    def step(self, increment: int = 1) -> float:
        """Advance by `increment` samples and push the new lr to the optimizer."""
        self.num_steps += increment
        lr = self.get_lr()
        if self.optimizer is not None:
            self.optimizer.set_lr(lr, None if self.decoupled is None else self.get_lr(*self.decoupled))
        return lr

    def state_dict(self) -> dict:
        return {
            "max_lr": self.max_lr,
            "min_lr": self.min_lr,
            "lr_warmup_steps": self.lr_warmup_steps,
            "lr_decay_steps": self.lr_decay_steps,
            "lr_decay_style": self.lr_decay_style,
            "num_steps": self.num_steps,
            "step_unit": STEP_UNIT,
        }

    def load_state_dict(self, sd: dict, override: bool = False, samples_per_iteration: int = 1,
                        use_checkpoint: bool = True, where: str = "--load") -> None:
        """Resume the count. As Megatron's scheduler: `override` (--override-opt_param-scheduler) keeps this run's
        schedule, `use_checkpoint` (--use-checkpoint-opt_param-scheduler) takes the checkpoint's; with neither a
        setting that differs from the checkpoint's is an error naming it and its flags.

        A state without "step_unit" counted iterations (megatron_bmw before the count became samples) unless it
        is Megatron-LM's own (it has "start_wd"); its counts are scaled by `samples_per_iteration`, the global
        batch it was saved with."""
        legacy = "step_unit" not in sd and "start_wd" not in sd
        scale = samples_per_iteration if legacy else 1
        saved = {"max_lr": sd["max_lr"], "min_lr": sd["min_lr"], "lr_warmup_steps": sd["lr_warmup_steps"] * scale,
                 "lr_decay_steps": sd["lr_decay_steps"] * scale, "lr_decay_style": sd["lr_decay_style"]}
        if not override:
            for key, flags in CHECKED.items():
                if not use_checkpoint and saved[key] != getattr(self, key):
                    raise UsageError(
                        f"{where}: the checkpoint's learning-rate schedule has {key} = {saved[key]!r}, this run "
                        f"{getattr(self, key)!r} ({flags}); give --use-checkpoint-opt_param-scheduler to keep the "
                        "checkpoint's schedule or --override-opt_param-scheduler to use this run's")
            for key, value in saved.items():
                setattr(self, key, value)
        self.num_steps = 0
        self.step(int(sd["num_steps"]) * scale)
