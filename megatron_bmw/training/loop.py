"""Pretraining loop: set-up from a RunConfig, then iterations, evaluation, logging and checkpoints.

Divergence (Megatron stops the run where ours used to skip every step and save the result): with bf16, fp32 or a
constant fp16 --loss-scale, the first iteration whose lm loss or gradients are not finite stops the run, as
Megatron's --check-for-nan-in-loss-and-grad does. With fp16 and dynamic loss scaling an overflow only skips the
step and lowers the scale (normal early in training); the run stops when a step overflows although the scale
was already at --min-loss-scale, so nothing is left to try. A diverged model is never saved: `TrainingDiverged`
is raised on every rank at the same iteration (the ranks agree through one all-reduce), before any checkpoint.
"""

from __future__ import annotations

import gc
import math
import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist

from ..config import OptimizerConfig, RunConfig
from ..data.builder import build_bert_datasets, build_gpt_datasets
from ..errors import RunError, UsageError
from ..parallel.agree import agree
from ..parallel.random import get_rng_state, set_rng_state, set_seeds
from ..parallel.state import ParallelState
from ..pipeline.build import build_schedule
from ..pipeline.engine import PipelineEngine, reduce_loss
from ..pipeline.stages import hidden_shape, pipeline_setup
from ..pipeline.trace import Tracer
from .profiler import measure_stage_times
from ..models.bert import LOSS_NAMES, drain_reported
from .batches import MicroBatches
from .bert_batches import BertMicroBatches
from . import memory_history
from .checkpoint_dir import RELEASE, read_tracker
from .checkpointer import Checkpointer, Loaded
from .logging import (IntervalStats, TensorBoardWriter, format_train_log, format_validation_log, num_zeros_in_grad,
                      params_norm, throughput_tflops, timestamp)
from .lr_scheduler import LRScheduler
from .moe_logging import MoEAuxLosses
from .optimizer import StepResult, build_optimizer
from .plan_check import warmup_iterations
from .process_memory import ResidentPeak

TRACE_ITERATIONS = 20  # --pipeline-trace records this many iterations


class TrainingDiverged(RunError):
    """The loss or the gradients stopped being finite; every rank raises it together (the entry point prints its
    one line and exits with 1)."""


def divergence(loss: float, step: StepResult, scale_before: float, cfg: OptimizerConfig) -> str | None:
    """Why this iteration ends the run (see the module doc), or None."""
    if not step.weights_finite:
        return "the step made weights inf or nan (the learning rate is too large for the parameter dtype)"
    finite = math.isfinite(loss)
    if cfg.fp16 and not cfg.loss_scale:
        if step.successful or scale_before > cfg.min_loss_scale:
            return None
        what = f"lm loss is {loss}" if not finite else "the gradients overflow"
        return f"{what} even at the minimum loss scale {cfg.min_loss_scale:g} (--min-loss-scale)"
    if not finite:
        return f"lm loss is {loss}"
    if not step.successful:
        return "the gradients are not finite (inf or nan)"
    return None


@dataclass
class IterationResult:
    loss: float  # mean lm loss over micro-batches and data-parallel ranks (known on every rank)
    step: StepResult
    batch_size: int  # the global batch this iteration consumed
    scale_before: float  # the loss scale the iteration ran with
    parts: dict[str, float] | None = None  # BERT: lm loss and sop loss (their sum is `loss`)
    aux: dict[str, float] | None = None  # MoE: the auxiliary losses logged beside lm loss (moe_logging.py)


def print_last(state: ParallelState, text: str) -> None:
    """Megatron logs from the last rank, which holds the loss."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if state.rank == world - 1:
        print(text, flush=True)


def print_first(state: ParallelState, text: str) -> None:
    if state.rank == 0:
        print(text, flush=True)


class _Signal:
    """While entered, SIGTERM or SIGINT (Ctrl-C) sets a flag; ranks agree on it at the end of each iteration, then
    save and exit. On exit the previous handlers are back.

    Under torchrun the launcher's death sets it too: a worker whose parent is gone (the launcher was killed with
    SIGKILL and could not stop it) would otherwise train on alone. A daemon thread polls the parent pid."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)
    POLL_S = 1.0

    def __init__(self, watch_parent: bool | None = None) -> None:
        self.received = False
        self._previous: dict = {}
        self._watch = bool(os.environ.get("TORCHELASTIC_RUN_ID")) if watch_parent is None else watch_parent
        self._done = threading.Event()

    def __enter__(self) -> "_Signal":
        try:
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        except ValueError:  # not in the main thread
            pass
        if self._watch:
            threading.Thread(target=self._watch_parent, args=(os.getppid(),), name="parent-watch", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _handle(self, signum, frame) -> None:
        self.received = True

    def _watch_parent(self, parent: int) -> None:
        while not self._done.wait(self.POLL_S):
            if os.getppid() != parent:
                rank = os.environ.get("RANK", "0")
                print(f"rank {rank}: the launcher (pid {parent}) is gone: saving if --save is set, then stopping",
                      file=sys.stderr, flush=True)
                self.received = True
                return


def _agree(flags: list[bool], state: ParallelState) -> list[bool]:
    """Each flag set on any rank, in one all-reduce."""
    t = torch.tensor([1.0 if f else 0.0 for f in flags], device=state.device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(x) for x in t.tolist()]


class Trainer:
    def __init__(self, run: RunConfig, state: ParallelState, tokenizer=None, track_memory: bool = False) -> None:
        """track_memory: keep an activation store so `memory_in_use` can report the peak (for --plan)."""
        self.run, self.state, self.tokenizer = run, state, tokenizer
        self.exited_early = False  # stopped by a signal, --exit-interval or --exit-duration-in-mins
        tr, model, pl = run.train, run.model, run.pipeline
        set_seeds(tr.seed, state.tp_rank, state.pp_rank, state.rng)
        state.units.seed(state.rng, tr.seed)
        self.build_data()
        self.shape = hidden_shape(model, state, pl.micro_batch_size)

        def measured_stage_times(chunks):  # for --microbatch-slicing auto
            batches = self.train_data.iteration(0, pl.num_microbatches)
            return measure_stage_times(chunks, state, batches, self.shape, model.torch_dtype)

        # the CPU plan check: what the process holds from here on (model, optimizer, activations, buffers)
        self.resident = ResidentPeak() if track_memory and state.device.type != "cuda" else None
        self.chunks, self.schedule, self.partition = pipeline_setup(model, state, tr.seed, pl,
                                                                    stage_times=measured_stage_times)
        self.named_params = state.units.trainable([(n, p) for c in self.chunks for n, p in c.named_parameters()])
        self.grad_sync = state.units.grad_sync([p for _, p in self.named_params], state, overlap=tr.overlap_grad_reduce,
                                               fusion=tr.gradient_accumulation_fusion)
        self.optimizer = build_optimizer(self.named_params, run.optimizer, state, modules=self.chunks)
        self.scheduler = LRScheduler(self.optimizer, run.lr)
        self.moe_aux = MoEAuxLosses(model, state) if model.moe is not None else None
        self.checkpoints = Checkpointer(state, self.chunks, self.optimizer)
        self.loaded: Loaded | None = None  # what --load read
        self.tracer = Tracer(state.rank, state.pp_rank) if tr.pipeline_trace else None
        # --plan's memory check: CUDA asks its allocator; the CPU counts the activation store's peak, whose
        # saved-tensor hooks cost host time, so (at one batch size) only over the warm-up iterations the time
        # check skips
        self.tracked_iterations = 0
        if tr.log_activation_memory or (track_memory and state.device.type != "cuda"):
            one_size = len(tr.batch_schedule.sizes()) == 1
            self.tracked_iterations = (max(1, warmup_iterations(tr.train_iters))
                                       if one_size and not tr.log_activation_memory else tr.train_iters)
        self.track_activations = self.tracked_iterations > 0
        self.activation_peak = 0.0  # the tracked engines' peak, once tracking has stopped
        self.engine = self._new_engine(self.schedule)
        # one schedule and engine per micro-batch count (a ramped-up batch changes the count), cached; the smallest
        # count's schedule is built now so a count that cannot be scheduled fails at start-up
        self.pipelines = {pl.num_microbatches: (self.schedule, self.engine)}
        self._pipeline(self._microbatches(tr.batch_schedule.sizes()[0]), build_engine=False)
        self.iteration = 0
        self.consumed_train = 0
        self.consumed_valid = 0
        self.tb = TensorBoardWriter(tr.tensorboard_dir if state.rank == _world() - 1 else None)
        self.skipped = 0
        self.traced = 0
        self.history: list[tuple[int, float, float | None]] = []  # (iteration, lm loss, grad norm)
        self.aux_history: list[dict[str, float]] = []  # MoE: each iteration's auxiliary losses, as logged
        self.step_times: list[float] = []  # wall seconds of every training iteration
        self.plan_check: list[str] = []  # with --plan: predicted against measured (pretrain.py fills it)
        self.eval_losses: dict[str, float] | None = None  # the last evaluation's losses by name

    # -- pipelines -------------------------------------------------------------------------------------------
    def _new_engine(self, schedule) -> PipelineEngine:
        return PipelineEngine(self.chunks, self.state, schedule, self.shape, self.run.model.torch_dtype,
                              tracer=self.tracer, track_activations=self.track_activations)

    def _microbatches(self, global_batch: int) -> int:
        return global_batch // (self.run.pipeline.micro_batch_size * self.state.dp_size)

    def _pipeline(self, m: int, build_engine: bool = True) -> tuple:
        """(schedule, engine) for m micro-batches per iteration (slicing and BPipe applied as for the full one)."""
        schedule, engine = self.pipelines.get(m, (None, None))
        if schedule is None:
            schedule = build_schedule(replace(self.run.pipeline, num_microbatches=m), self.state.pp_size)
        if engine is None and build_engine:
            engine = self._new_engine(schedule)
        self.pipelines[m] = (schedule, engine)
        return schedule, engine

    # -- checkpoints ---------------------------------------------------------------------------------------
    def save(self) -> None:
        tr = self.run.train
        payload = {
            "iteration": self.iteration,
            "consumed_train_samples": self.consumed_train,
            "consumed_valid_samples": self.consumed_valid,
            "args": self._args_dict(),
            "opt_param_scheduler": self.scheduler.state_dict(),
            "checkpoint_version": 3.0,
        }
        rng = get_rng_state(self.state.rng) if tr.save_rng else None
        start = time.time()
        self.checkpoints.save(tr.save, self.iteration, payload, tr.ckpt_format, tr.save_optim, rng)
        print_first(self.state, f"  successfully saved checkpoint at iteration {self.iteration:7d} to {tr.save} "
                                f"[ t {time.time() - start:.2f}s ]")

    def _args_dict(self) -> dict:
        r = self.run
        d = {k: v for k, v in asdict(r.model).items() if k != "params_dtype"}
        d.update(tensor_model_parallel_size=self.state.tp_size, pipeline_model_parallel_size=self.state.pp_size,
                 data_parallel_size=self.state.dp_size, padded_vocab_size=r.model.vocab_size,
                 orig_vocab_size=r.orig_vocab_size, make_vocab_size_divisible_by=r.make_vocab_size_divisible_by,
                 micro_batch_size=r.pipeline.micro_batch_size,
                 global_batch_size=r.train.global_batch_size, seed=r.train.seed, pipeline_partition=self.partition,
                 params_dtype=str(r.model.torch_dtype), consumed_train_samples=self.consumed_train,
                 consumed_valid_samples=self.consumed_valid, train_iters=r.train.train_iters,
                 train_samples=r.train.train_samples, tokenizer_type=r.data.tokenizer_type,
                 tokenizer_model=r.data.tokenizer_model, vocab_file=r.data.vocab_file, merge_file=r.data.merge_file)
        if self.state.units.names() is not None:
            d["unit_strategies"] = self.state.units.names()
        return d

    def load(self) -> None:
        """--load: the weights and optimizer (checkpointer.py), then where training resumes: the iteration, the
        samples consumed, the LR schedule and the RNG streams (Megatron's rules for --finetune and a release)."""
        tr = self.run.train
        if tr.load is None:
            return
        self.optimizer.finish_param_sync()  # a gather still running would overwrite the loaded weights
        load_optim = tr.load_optim and not tr.finetune
        self.loaded = self.checkpoints.load(tr.load, load_optim, self._args_dict(), tr.load_fallback)
        if self.loaded is None:
            return
        if tr.finetune:
            print_first(self.state, f" loaded weights from {tr.load} for finetuning (iteration reset to 0)")
            return
        payload, release = self.loaded.payload, self.loaded.iteration == RELEASE  # a release: weights, iteration 0
        raw = payload.get("args")  # a dict here, an argparse.Namespace in Megatron-LM's checkpoints
        args = raw if isinstance(raw, dict) else vars(raw) if hasattr(raw, "__dict__") else {}
        saved_batch = int(args.get("global_batch_size") or tr.global_batch_size)
        self.iteration = 0 if release else int(payload.get("iteration", 0))
        self.consumed_train = int(payload.get("consumed_train_samples",
                                              args.get("consumed_train_samples", self.iteration * saved_batch)))
        self.consumed_valid = int(payload.get("consumed_valid_samples", args.get("consumed_valid_samples", 0)))
        if "opt_param_scheduler" in payload and load_optim and not release:
            agree(self.scheduler.load_state_dict, payload["opt_param_scheduler"], samples_per_iteration=saved_batch,
                  override=tr.override_opt_param_scheduler, use_checkpoint=tr.use_checkpoint_opt_param_scheduler,
                  where=f"--load {tr.load}")
        if tr.load_rng and not release:
            if "rng_state" in payload:
                set_rng_state(payload["rng_state"], self.state.rng)
            elif payload.get("rng_layout_changed"):
                self._reseed(payload.get("saved_layout"))
            else:  # Megatron stops here too
                raise UsageError(f"--load {tr.load}: the checkpoint has no RNG state (saved with --no-save-rng?); "
                                 "load with --no-load-rng or --finetune")
        print_first(self.state, f"  successfully loaded checkpoint from {tr.load} at iteration {self.iteration}")

    def convert_checkpoint(self) -> str:
        """Megatron's --ckpt-convert-format: save what was loaded in that format to --ckpt-convert-save/<format>."""
        tr = self.run.train

        def source() -> str:
            if self.loaded is None:
                raise UsageError(f"--ckpt-convert-format: --load {tr.load} holds no checkpoint to convert")
            return self.loaded.format

        source = agree(source)
        where = os.path.join(tr.ckpt_convert_save, tr.ckpt_convert_format)
        self.run = replace(self.run, train=replace(tr, save=where, ckpt_format=tr.ckpt_convert_format))
        self.save()
        print_first(self.state, f"> converted checkpoint: {source} -> {tr.ckpt_convert_format}.")
        return where

    def _reseed(self, saved: dict | None) -> None:
        """The checkpoint's RNG streams belong to another layout's ranks: seed them afresh from --seed and the
        iteration (so the masks of the first iterations are not repeated), and say so in one line."""
        seed = self.run.train.seed + self.iteration
        set_seeds(seed, self.state.tp_rank, self.state.pp_rank, self.state.rng)
        self.state.units.seed(self.state.rng, seed)
        was = ", ".join(f"{k} {v}" for k, v in (saved or {}).items() if k in ("tp", "pp", "dp", "order"))
        print_first(self.state, f" re-seeded RNG streams python, numpy, torch and {', '.join(self.state.rng.states)} "
                                f"with --seed + iteration ({seed}): the checkpoint's layout ({was}) differs")

    # -- data ------------------------------------------------------------------------------------------------
    def build_data(self) -> None:
        tr, st = self.run.train, self.state
        train = tr.train_samples if tr.train_samples is not None else tr.train_iters * tr.global_batch_size
        evals = (tr.train_iters // tr.eval_interval + 1) * tr.eval_iters
        num = (train, evals * tr.global_batch_size, tr.eval_iters * tr.global_batch_size)
        bert = self.run.model.model_type == "bert"
        # rank 0 builds the index caches first and checks once that every token id fits the vocabulary; the
        # agreements stand in for barriers, so a data error on any rank stops all of them with its own line
        check = None if self.run.data.mock_data else self.run.orig_vocab_size
        first = agree(lambda: self._datasets(num, check) if st.rank == 0 else None)
        datasets = agree(lambda: first if first is not None else self._datasets(num, None))
        eod = self.tokenizer.eod if self.tokenizer is not None else None
        batches = BertMicroBatches if bert else MicroBatches
        mbs, dp, dp_rank = st.units.loader(st, self.run.pipeline.micro_batch_size)
        self.train_data, self.valid_data, self.test_data = (
            batches(d, mbs, dp, dp_rank, st.device, eod, tr.eod_mask_loss, cp=(st.cp_size, st.cp_rank))
            if d is not None else None
            for d in datasets)
        if self.train_data is None:
            raise UsageError("--split gives the training split no data")

    def _datasets(self, num: tuple[int, int, int], check_vocab_size: int | None):
        run = self.run
        if run.model.model_type != "bert":
            return build_gpt_datasets(run.data, run.model.seq_length, run.train.seed, num,
                                      check_vocab_size=check_vocab_size)
        from ..data.bert_dataset import BertSampleConfig

        d = run.data
        sample = BertSampleConfig(seq_length=run.model.seq_length, mask_prob=d.mask_prob,
                                  short_seq_prob=d.short_seq_prob, binary_head=run.model.bert_binary_head,
                                  whole_word=d.whole_word_masking, max_ngram=d.masking_max_ngram, seed=run.train.seed)
        return build_bert_datasets(d, sample, num, self.tokenizer, check_vocab_size=check_vocab_size)

    def _loss_parts(self, m: int) -> dict[str, float] | None:
        """BERT: the iteration's mean lm loss and sop loss (over micro-batches and data-parallel ranks) from what
        the head recorded, known on every rank; None for GPT."""
        if self.run.model.model_type != "bert":
            return None
        st = self.state
        t = torch.zeros(2, dtype=torch.float32, device=st.device)
        reported = drain_reported(self.chunks)
        src = st.pp_ranks[self.engine.schedule.loss_rank]  # where the head runs
        if st.rank == src and reported is not None:
            t += reported.float().to(st.device) / m
        if st.pp_group is not None:
            dist.broadcast(t, src=src, group=st.pp_group)
        if st.grad_group is not None:
            dist.all_reduce(t, group=st.grad_group)
            t /= st.units.loss_divisor(st)
        names = LOSS_NAMES if self.run.model.bert_binary_head else LOSS_NAMES[:1]
        return dict(zip(names, t.tolist()))

    # -- steps -----------------------------------------------------------------------------------------------
    def train_step(self) -> IterationResult:
        """One iteration at the global batch the batch schedule gives for the samples consumed so far."""
        batch = self.run.train.batch_schedule.at(self.consumed_train)
        m = self._microbatches(batch)
        _, self.engine = self._pipeline(m)
        start = time.perf_counter()
        self.grad_sync.zero()
        batches = self.train_data.iteration(self.consumed_train, m)
        self.engine.tracer = self.tracer if self.traced < TRACE_ITERATIONS else None
        self.traced += 1
        scale = self.optimizer.loss_scale
        drain_reported(self.chunks)  # forget forwards run outside iterations (e.g. measuring stage times)
        if self.moe_aux is not None:
            self.moe_aux.forget(self.chunks)
        result = self.engine.run(batches, loss_scale=scale if self.run.optimizer.fp16 else 1.0,
                                 grad_sync=self.grad_sync)
        step = self.optimizer.step()
        if step.successful:
            self.scheduler.step(batch)  # the schedule counts samples, as Megatron's
        else:
            self.skipped += 1
        loss = reduce_loss(result, self.state, m)
        parts = self._loss_parts(m)
        aux = self.moe_aux.reduce(self.chunks, m) if self.moe_aux is not None else None
        self.step_times.append(time.perf_counter() - start)
        self.iteration += 1
        if self.track_activations and len(self.step_times) >= self.tracked_iterations:
            self._stop_tracking()
        self.consumed_train += batch
        return IterationResult(loss, step, batch, scale, parts, aux)

    def _stop_tracking(self) -> None:
        """Later iterations run engines without the activation store (BPipe's keep theirs: they move with it)."""
        self.activation_peak = max(self.activation_peak, self.engine.activation_stats()["peak_bytes"])
        self.track_activations = False
        self.pipelines = {m: (schedule, e if e is not None and e.transfers is not None else None)
                          for m, (schedule, e) in self.pipelines.items()}

    def evaluate(self, data, iters: int) -> float | None:
        """Mean loss over `iters` full global batches, continuing from the validation samples consumed so far."""
        if data is None or iters <= 0:
            return None
        m = self.run.pipeline.num_microbatches
        _, engine = self._pipeline(m)
        for c in self.chunks:
            c.eval()
        total, parts = 0.0, {}
        drain_reported(self.chunks)
        for _ in range(iters):
            batches = data.iteration(self.consumed_valid, m)
            total += reduce_loss(engine.run(batches, forward_only=True), self.state, m)
            for key, value in (self._loss_parts(m) or {}).items():
                parts[key] = parts.get(key, 0.0) + value / iters
            self.consumed_valid += self.run.train.global_batch_size
        for c in self.chunks:
            c.train()
        self.eval_losses = parts or {"lm loss": total / iters}
        return total / iters

    # -- loop ------------------------------------------------------------------------------------------------
    def train(self) -> None:
        manual_gc = self.run.train.manual_gc
        if manual_gc:  # the collector runs between steps, at the same moments on every rank (Megatron's)
            gc.disable()
            gc.collect()
        try:
            with _Signal() as sig:
                self._train(sig)
            self.optimizer.finish_param_sync()  # --overlap-param-gather: the model holds the last step's weights
        except BaseException:
            self.tb.close()  # what was logged reaches the disk even when the run stops on an error
            raise
        finally:
            if manual_gc:
                gc.enable()

    def _train(self, sig: _Signal) -> None:
        tr, st = self.run.train, self.state
        start = time.time()
        interval = IntervalStats()
        while self.iteration < tr.train_iters:
            it = self.train_step()
            if tr.manual_gc and tr.manual_gc_interval and self.iteration % tr.manual_gc_interval == 0:
                gc.collect()
            self.history.append((self.iteration, it.loss, it.step.grad_norm))
            if it.aux is not None:
                self.aux_history.append(it.aux)
            interval.add(it.loss, it.step.successful, it.parts, it.aux)
            why = divergence(it.loss, it.step, it.scale_before, self.run.optimizer)
            late = tr.exit_duration_in_mins is not None and (time.time() - start) / 60.0 > tr.exit_duration_in_mins
            diverged, signalled, late = _agree([why is not None, sig.received, late], st)
            if self.iteration % tr.log_interval == 0:
                self._log(it, interval)
                interval.reset()
            if diverged:
                raise TrainingDiverged(self._diverged_message(why))
            if tr.eval_interval and self.iteration % tr.eval_interval == 0 and self.valid_data is not None:
                self._validate()
            saved = False
            if tr.save and tr.save_interval and self.iteration % tr.save_interval == 0:
                self.save()
                saved = True
            stop = signalled or late or bool(tr.exit_interval and self.iteration % tr.exit_interval == 0)
            if stop:
                if tr.save and not saved:
                    self.save()
                self.exited_early = True  # as Megatron: exit right after the save, no test-set evaluation
                print_last(st, f" exiting program at iteration {self.iteration}")  # after the log line, same rank
                return
        if tr.save and not (tr.save_interval and self.iteration % tr.save_interval == 0):
            self.save()

    def _diverged_message(self, why: str | None) -> str:
        save = self.run.train.save
        saved = read_tracker(save) if save and os.path.isdir(save) else None
        kept = f"the last checkpoint is iteration {saved} in {save}" if saved is not None else "nothing was saved"
        return (f"training diverged at iteration {self.iteration}: {why or 'on another rank'}; the diverged model "
                f"is not saved ({kept}); try a lower --lr")

    def _log(self, it: IterationResult, interval: IntervalStats) -> None:
        tr, model = self.run.train, self.run.model
        seconds = interval.seconds_per_iteration()
        zeros = num_zeros_in_grad(self.named_params, self.state) \
            if tr.log_num_zeros_in_grad and it.step.successful else None
        if tr.log_params_norm:
            self.optimizer.finish_param_sync()
        norm = params_norm(self.named_params, self.state) if tr.log_params_norm else None
        tflops = throughput_tflops(model, it.batch_size, seconds, _world()) if tr.log_throughput else None
        lr = self.optimizer.get_lr()
        print_last(self.state, format_train_log(
            iteration=self.iteration, train_iters=tr.train_iters, consumed_samples=self.consumed_train,
            elapsed_ms=seconds * 1000.0, learning_rate=lr, global_batch_size=it.batch_size,
            losses=interval.losses(), loss_scale=it.step.loss_scale, grad_norm=it.step.grad_norm,
            num_zeros=zeros, params_norm=norm, skipped_iters=interval.skipped, nan_iters=interval.nan,
            throughput=tflops, prefix=timestamp()))
        if tr.record_memory_history and self.state.rank == _world() - 1:  # Megatron: the last rank
            memory_history.write_snapshot(tr.memory_snapshot_path, torch.cuda)
        tokens = it.batch_size * model.seq_length
        self.tb.add_scalars({**interval.losses(), "learning-rate": lr, "batch-size": it.batch_size,
                             "loss-scale": it.step.loss_scale, "grad-norm": it.step.grad_norm,
                             "num-zeros": zeros, "params-norm": norm, "throughput": tflops,
                             "samples-per-second": it.batch_size / seconds,
                             "tokens-per-second": tokens / seconds}, self.iteration)

    def _validate(self) -> None:
        collect = self.run.train.manual_gc and self.run.train.manual_gc_eval
        if collect:
            gc.collect()
        loss = self.evaluate(self.valid_data, self.run.train.eval_iters)
        if collect:
            gc.collect(generation=0)  # what the evaluation made
        if loss is None:
            return
        line = format_validation_log(self.iteration, self.eval_losses)
        bar = "-" * (len(line) + 1)
        print_last(self.state, f"{bar}\n {line}\n{bar}")
        self.tb.add_scalars({f"{k} validation": v for k, v in self.eval_losses.items()}, self.iteration)

    def memory_in_use(self) -> float:
        """This rank's peak bytes: CUDA's peak allocation; on the CPU the model states' tensors plus the activation
        store's peak (what the memory model predicts, without an allocator to ask)."""
        if self.state.device.type == "cuda":
            return float(torch.cuda.max_memory_allocated(self.state.device))
        seen, params = set(), 0
        for _, p in self.named_params:
            if id(p) not in seen:
                seen.add(id(p))
                params += p.numel() * p.element_size()
        store = self.activation_peak
        if self.engine.store is not None:
            store = max(store, self.engine.activation_stats()["peak_bytes"])
        return float(params + self.grad_sync.buffer_bytes() + self.optimizer.state_bytes() + store)

    def finish(self) -> None:
        self.optimizer.finish_param_sync()
        if self.run.train.log_activation_memory and self.state.tp_rank == 0 and self.state.dp_rank == 0:
            for line in self.engine.activation_report():
                print(line, flush=True)
        if self.tracer is not None:
            self.tracer.write(self.run.train.pipeline_trace)
            print_first(self.state, f" pipeline trace written to {self.run.train.pipeline_trace}")
        self.tb.close()


def build_trainer(argv: list[str], tokenizer=None, model_type: str = "gpt") -> Trainer:
    """Parse flags (pretrain_gpt.py's, or pretrain_bert.py's with model_type "bert") and set up a Trainer inside an
    initialised process group (used by tests and tools)."""
    from ..arguments import run_config_from_argv

    run = run_config_from_argv(argv, _world(), model_type, vocab_size=tokenizer.vocab_size if tokenizer else None).run
    trainer = Trainer(run, ParallelState.build(run.parallel, num_units=run.model.num_units), tokenizer)
    trainer.load()
    return trainer


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def count_parameters(trainer: Trainer) -> int:
    seen, total = set(), 0
    for _, p in trainer.named_params:
        if id(p) not in seen and not getattr(p, "shared_embedding_copy", False):
            seen.add(id(p))
            total += p.numel()
    return total
