"""The training loop's settings: length, batch schedule, logging, checkpoints."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UsageError
from .schema import check_ranges, flag


@dataclass(frozen=True)
class BatchSchedule:
    """The global batch size as training consumes samples (Megatron's micro-batch calculator): constant,
    a linear ramp-up (`--rampup-batch-size start increment samples`) or steps (`--step-batch-size-schedule`)."""

    global_batch_size: int  # the final (full) batch
    rampup: tuple[int, int, int] | None = flag(
        "--rampup-batch-size", group="training", default=None, nargs=3, type=int, dest="rampup_batch_size",
        metavar=("START", "INCREMENT", "SAMPLES"),
        help="grow the global batch from START by INCREMENT over SAMPLES consumed samples")
    steps: tuple[tuple[int, int], ...] | None = flag(  # (from this many consumed samples, batch); first from 0
        "--step-batch-size-schedule", group="training", default=None, type=str, dest="step_batch_size_schedule",
        help="global batch by consumed tokens, e.g. '0:256 2M:512' (K/M/B/T suffixes)")

    def __post_init__(self) -> None:
        if self.rampup is not None:
            start, inc, ramp = self.rampup
            if start < 1 or inc < 1 or ramp < 0:
                raise UsageError(f"--rampup-batch-size {start} {inc} {ramp}: needs start >= 1, increment >= 1 "
                                 "and ramp-up samples >= 0")
            if start > self.global_batch_size or (self.global_batch_size - start) % inc:
                raise UsageError(f"--rampup-batch-size {start} {inc} {ramp}: --global-batch-size "
                                 f"{self.global_batch_size} must be the start plus a whole number of increments")
        if self.steps is not None:
            if not self.steps or self.steps[0][0] != 0:
                raise UsageError("--step-batch-size-schedule: the first threshold must be 0")
            if any(b < 1 for _, b in self.steps) or any(a[0] >= b[0] for a, b in zip(self.steps, self.steps[1:])):
                raise UsageError("--step-batch-size-schedule: thresholds must increase and batch sizes be >= 1")

    @property
    def varies(self) -> bool:
        return len(self.sizes()) > 1

    def sizes(self) -> list[int]:
        """Every batch size the schedule can use, ascending."""
        if self.rampup is not None:
            return list(range(self.rampup[0], self.global_batch_size + 1, self.rampup[1]))
        if self.steps is not None:
            return sorted({b for _, b in self.steps})
        return [self.global_batch_size]

    def at(self, consumed: int) -> int:
        """The batch of the iteration that starts after `consumed` samples (Megatron's arithmetic)."""
        if self.rampup is not None:
            start, inc, ramp = self.rampup
            increments = (self.global_batch_size - start) // inc
            if consumed > ramp or increments == 0 or ramp == 0:
                return self.global_batch_size
            return start + int(consumed / (ramp / increments)) * inc
        if self.steps is not None:
            return [b for t, b in self.steps if consumed >= t][-1]
        return self.global_batch_size

    def iterations(self, train_samples: int) -> int:
        """Iterations that fit in `train_samples` (a last partial batch is dropped, as in Megatron)."""
        last_change = self.rampup[2] if self.rampup else self.steps[-1][0] if self.steps else 0
        consumed = iters = 0
        while consumed <= last_change:  # the varying part, one iteration at a time
            batch = self.at(consumed)
            if consumed + batch > train_samples:
                return iters
            consumed, iters = consumed + batch, iters + 1
        return iters + (train_samples - consumed) // self.global_batch_size


T, C, L, P, D = "training", "checkpointing", "logging and evaluation", "parallelism", "data"  # flag groups


@dataclass
class TrainConfig:
    global_batch_size: int = flag("--global-batch-size", group=T, cli_default=None,
                                  minimum=1)  # the full batch (after any ramp-up)
    train_iters: int = flag("--train-iters", group=T, cli_default=None, minimum=1,
                            help="iterations (default 10 without --train-samples)")
    seed: int = flag("--seed", group=T, default=1234)
    pipeline_trace: str | None = flag("--pipeline-trace", group=P, default=None,
                                      help="write a Chrome trace of the pipeline actions")
    overlap_grad_reduce: bool = flag("--overlap-grad-reduce", group=P, default=False, action="store_true")
    gradient_accumulation_fusion: bool = flag(  # weight gradients added into main_grad by their GEMM (wgrad_accum)
        "--no-gradient-accumulation-fusion", group=P, default=True, action="store_false",
        help="add each weight gradient into the fp32 main_grad after its GEMM, not inside it (the planner then counts "
             "e + 8 bytes per parameter and micro-batch, for ours and megatron-core)")
    eod_mask_loss: bool = flag("--eod-mask-loss", group=D, default=False, action="store_true")
    log_interval: int = flag("--log-interval", group=L, default=100, minimum=1)
    eval_interval: int = flag("--eval-interval", group=L, default=1000, minimum=1)
    eval_iters: int = flag("--eval-iters", group=L, default=100, minimum=0)
    exit_interval: int | None = flag("--exit-interval", group=T, default=None, minimum=1)
    exit_duration_in_mins: float | None = flag("--exit-duration-in-mins", group=T, default=None)
    manual_gc: bool = flag(  # Python's collector off during training, collected by hand (Megatron's --manual-gc)
        "--manual-gc", group=T, default=False, action="store_true",
        help="Python's garbage collector off during training, run by hand (as Megatron: at the start, every "
             "--manual-gc-interval iterations, around each validation)")
    manual_gc_interval: int = flag(  # iterations between collections; 0: only at the start and around validation
        "--manual-gc-interval", group=T, default=0, minimum=0, help="iterations between collections (0: none)")
    manual_gc_eval: bool = flag("--no-manual-gc-eval", group=T, default=True, action="store_false",
                                help="with --manual-gc, no collection around validation")
    tensorboard_dir: str | None = flag("--tensorboard-dir", group=L, default=None)
    log_throughput: bool = flag("--log-throughput", group=L, default=False, action="store_true")
    record_memory_history: bool = flag(  # the CUDA allocator's history, a snapshot per log interval (last rank)
        "--record-memory-history", group=L, default=False, action="store_true",
        help="record the CUDA caching allocator's allocations and frees from start-up; the last rank writes a "
             "snapshot to --memory-snapshot-path at every log interval (open it at pytorch.org/memory_viz, or "
             "summarise it with tools/memory_snapshot.py)")
    memory_snapshot_path: str = flag("--memory-snapshot-path", group=L, default="snapshot.pickle")
    log_params_norm: bool = flag("--log-params-norm", group=L, default=False, action="store_true")
    log_num_zeros_in_grad: bool = flag("--log-num-zeros-in-grad", group=L, default=False, action="store_true")
    save: str | None = flag("--save", group=C, default=None)
    load: str | None = flag("--load", group=C, default=None)
    save_interval: int | None = flag("--save-interval", group=C, default=None, minimum=1)
    save_optim: bool = flag("--no-save-optim", group=C, default=True, action="store_false")
    save_rng: bool = flag("--no-save-rng", group=C, default=True, action="store_false")
    load_optim: bool = flag("--no-load-optim", group=C, default=True, action="store_false")
    load_rng: bool = flag("--no-load-rng", group=C, default=True, action="store_false")
    load_fallback: bool = flag("--load-fallback", group=C, default=False, action="store_true",
                               help="a damaged tracked checkpoint loads the previous one")
    finetune: bool = flag("--finetune", group=C, default=False, action="store_true")
    ckpt_format: str = flag(  # what --save writes: torch (Megatron's legacy) or torch_dist (layout-free)
        "--ckpt-format", group=C, default="torch",
        help="torch (Megatron's legacy format, the default) or torch_dist (layout-free, torch.distributed.checkpoint);"
             " --load reads either")
    override_opt_param_scheduler: bool = flag(  # on --load: this run's LR schedule, not the checkpoint's
        "--override-opt_param-scheduler", group=C, default=False, action="store_true",
        help="on --load, use this run's LR schedule flags instead of the checkpoint's")
    use_checkpoint_opt_param_scheduler: bool = flag(  # on --load: the checkpoint's LR schedule, whatever the flags
        "--use-checkpoint-opt_param-scheduler", group=C, default=False, action="store_true",
        help="on --load, keep the checkpoint's LR schedule whatever this run's flags say")
    ckpt_convert_format: str | None = flag(  # load, save in this format, exit (Megatron's)
        "--ckpt-convert-format", group=C, default=None, choices=("torch", "torch_dist"),
        help="load --load, save it in this format to --ckpt-convert-save/<format>, and exit")
    ckpt_convert_save: str | None = flag("--ckpt-convert-save", group=C, default=None,
                                         help="where --ckpt-convert-format saves")
    distributed_backend: str | None = flag("--distributed-backend", group=P, default=None, choices=("nccl", "gloo"))
    distributed_timeout_minutes: float = flag("--distributed-timeout-minutes", group=P, default=10.0)
    log_activation_memory: bool = flag("--log-activation-memory", group=P, default=False, action="store_true",
                                       help="every pipeline rank prints its peak saved activations at the end")
    train_samples: int | None = flag(  # train_iters is then derived from it
        "--train-samples", group=T, default=None, help="sample-based training length")
    batch_schedule: BatchSchedule | None = None  # None: constant global_batch_size

    def __post_init__(self) -> None:
        check_ranges(self)
        if self.exit_duration_in_mins is not None and not self.exit_duration_in_mins > 0:
            raise UsageError(f"--exit-duration-in-mins must be > 0, got {self.exit_duration_in_mins:g}")
        if not 0 <= self.seed < 2**32:
            raise UsageError(f"--seed must be in [0, 2**32), got {self.seed}")
        if not self.distributed_timeout_minutes > 0:
            raise UsageError(f"--distributed-timeout-minutes must be > 0, got {self.distributed_timeout_minutes:g}")
        if self.batch_schedule is None:
            self.batch_schedule = BatchSchedule(self.global_batch_size)
        elif self.batch_schedule.global_batch_size != self.global_batch_size:
            raise UsageError(f"--global-batch-size {self.global_batch_size} differs from the batch schedule's "
                             f"final batch {self.batch_schedule.global_batch_size}")

