"""Pretraining loop: set-up from a RunConfig, then iterations, evaluation, logging and checkpoints."""

from __future__ import annotations

import math
import signal
import time
from dataclasses import asdict

import torch
import torch.distributed as dist

from ..config import RunConfig
from ..data.builder import build_gpt_datasets
from ..errors import UsageError
from ..parallel.grad_sync import GradSync
from ..parallel.random import get_rng_state, set_rng_state, set_seeds
from ..parallel.state import ParallelState
from ..pipeline.engine import PipelineEngine, reduce_loss
from ..pipeline.stages import hidden_shape, pipeline_setup
from ..pipeline.trace import Tracer
from ..planner.profiler import measure_stage_times
from .batches import MicroBatches
from .checkpointing import load_checkpoint, read_tracker, save_checkpoint
from .logging import TensorBoardWriter, format_train_log, format_validation_log
from .lr_scheduler import LRScheduler
from .optimizer import build_optimizer

TRACE_ITERATIONS = 20  # --pipeline-trace records this many iterations


def print_last(state: ParallelState, text: str) -> None:
    """Megatron logs from the last rank, which holds the loss."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if state.rank == world - 1:
        print(text, flush=True)


def print_first(state: ParallelState, text: str) -> None:
    if state.rank == 0:
        print(text, flush=True)


class _Signal:
    """SIGTERM sets a flag; ranks agree on it at the end of each iteration, then save and exit."""

    def __init__(self) -> None:
        self.received = False
        try:
            signal.signal(signal.SIGTERM, self._handle)
        except ValueError:  # not in the main thread
            pass

    def _handle(self, signum, frame) -> None:
        self.received = True


def _any_rank(flag: bool, state: ParallelState) -> bool:
    t = torch.tensor([1.0 if flag else 0.0], device=state.device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


class Trainer:
    def __init__(self, run: RunConfig, state: ParallelState, tokenizer=None, track_memory: bool = False) -> None:
        """track_memory: keep an activation store so `memory_in_use` can report the peak (for --plan)."""
        self.run, self.state, self.tokenizer = run, state, tokenizer
        tr, model, pl = run.train, run.model, run.pipeline
        set_seeds(tr.seed, state.tp_rank, state.pp_rank, state.rng)
        self.build_data()
        shape = hidden_shape(model, state, pl.micro_batch_size)

        def measured_stage_times(chunks):  # for --microbatch-slicing auto
            batches = self.train_data.iteration(0, pl.num_microbatches)
            return measure_stage_times(chunks, state, batches, shape, model.torch_dtype)

        self.chunks, self.schedule, self.partition = pipeline_setup(model, state, tr.seed, pl,
                                                                    stage_times=measured_stage_times)
        self.named_params = [(n, p) for c in self.chunks for n, p in c.named_parameters()]
        self.grad_sync = GradSync([p for _, p in self.named_params], state, overlap=tr.overlap_grad_reduce)
        self.optimizer = build_optimizer(self.named_params, run.optimizer, state)
        self.scheduler = LRScheduler(self.optimizer, run.lr)
        self.tracer = Tracer(state.rank, state.pp_rank) if tr.pipeline_trace else None
        self.engine = PipelineEngine(self.chunks, state, self.schedule, shape, model.torch_dtype, tracer=self.tracer,
                                     track_activations=tr.log_activation_memory or track_memory)
        self.iteration = 0
        self.consumed_train = 0
        self.consumed_valid = 0
        self.tb = TensorBoardWriter(tr.tensorboard_dir if state.rank == _world() - 1 else None)
        self.skipped = 0
        self.history: list[tuple[int, float, float | None]] = []  # (iteration, lm loss, grad norm)
        self.step_times: list[float] = []  # wall seconds of every training iteration
        self.plan_check: list[str] = []  # with --plan: predicted against measured (pretrain.py fills it)

    # -- checkpoints ---------------------------------------------------------------------------------------
    def _model_state(self) -> dict:
        if len(self.chunks) == 1:
            return {"model": self.chunks[0].state_dict()}
        return {f"model{i}": c.state_dict() for i, c in enumerate(self.chunks)}

    def save(self) -> None:
        tr = self.run.train
        payload = {
            "iteration": self.iteration,
            "consumed_train_samples": self.consumed_train,
            "args": self._args_dict(),
            "opt_param_scheduler": self.scheduler.state_dict(),
            "checkpoint_version": 3.0,
            **self._model_state(),
        }
        if tr.save_rng:
            payload["rng_state"] = get_rng_state(self.state.rng)
        start = time.time()
        save_checkpoint(tr.save, self.iteration, self.state, payload, self.optimizer, save_optim=tr.save_optim)
        print_first(self.state, f"  successfully saved checkpoint at iteration {self.iteration:7d} to {tr.save} "
                                f"[ t {time.time() - start:.2f}s ]")

    def _args_dict(self) -> dict:
        r = self.run
        d = {k: v for k, v in asdict(r.model).items() if k != "params_dtype"}
        d.update(tensor_model_parallel_size=self.state.tp_size, pipeline_model_parallel_size=self.state.pp_size,
                 data_parallel_size=self.state.dp_size, padded_vocab_size=r.model.vocab_size,
                 orig_vocab_size=r.orig_vocab_size, micro_batch_size=r.pipeline.micro_batch_size,
                 global_batch_size=r.train.global_batch_size, seed=r.train.seed, pipeline_partition=self.partition,
                 params_dtype=str(r.model.torch_dtype))
        return d

    def load(self) -> None:
        tr = self.run.train
        if tr.load is None:
            return
        if read_tracker(tr.load) is None:
            if tr.finetune or tr.load == tr.save:
                print_first(self.state, f"WARNING: no checkpoint found in --load {tr.load}; starting from scratch")
                return
            raise UsageError(
                f"--load {tr.load}: no checkpoint found (no latest_checkpointed_iteration.txt); "
                "remove --load to start from scratch, or pass --finetune to start from scratch anyway"
            )
        load_optim = tr.load_optim and not tr.finetune
        payload = load_checkpoint(tr.load, self.state, self.optimizer, load_optim=load_optim)
        for i, chunk in enumerate(self.chunks):
            key = "model" if len(self.chunks) == 1 else f"model{i}"
            if key not in payload:
                raise UsageError(f"--load {tr.load}: checkpoint has no {key!r} (saved with another virtual pipeline size?)")
            try:
                chunk.load_state_dict(payload[key], strict=True)
            except RuntimeError as exc:
                first = str(exc).strip().splitlines()[0]
                raise UsageError(f"--load {tr.load}: model weights do not fit this model: {first}") from None
        if not load_optim:
            self.optimizer.reload_model_params()
        if tr.finetune:
            print_first(self.state, f" loaded weights from {tr.load} for finetuning (iteration reset to 0)")
            return
        self.iteration = int(payload.get("iteration", 0))
        self.consumed_train = int(payload.get("consumed_train_samples", self.iteration * tr.global_batch_size))
        if "opt_param_scheduler" in payload and load_optim:
            self.scheduler.load_state_dict(payload["opt_param_scheduler"])
        if tr.load_rng and "rng_state" in payload:
            set_rng_state(payload["rng_state"], self.state.rng)
        print_first(self.state, f"  successfully loaded checkpoint from {tr.load} at iteration {self.iteration}")

    # -- data ------------------------------------------------------------------------------------------------
    def build_data(self) -> None:
        tr, st = self.run.train, self.state
        evals = (tr.train_iters // tr.eval_interval + 1) * tr.eval_iters
        num = (tr.train_iters * tr.global_batch_size, evals * tr.global_batch_size, tr.eval_iters * tr.global_batch_size)
        seq = self.run.model.seq_length
        # rank 0 builds the index caches first and checks once that every token id fits the vocabulary
        datasets = None
        if st.rank == 0:
            datasets = build_gpt_datasets(self.run.data, seq, tr.seed, num,
                                          check_vocab_size=None if self.run.data.mock_data else self.run.orig_vocab_size)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
        if datasets is None:
            datasets = build_gpt_datasets(self.run.data, seq, tr.seed, num)
        eod = self.tokenizer.eod if self.tokenizer is not None else None
        self.train_data, self.valid_data, self.test_data = (
            MicroBatches(d, self.run.pipeline.micro_batch_size, st.dp_size, st.dp_rank, st.device, eod, tr.eod_mask_loss)
            if d is not None else None for d in datasets)
        if self.train_data is None:
            raise UsageError("--split gives the training split no data")

    # -- steps -----------------------------------------------------------------------------------------------
    def train_step(self) -> tuple[float, object]:
        tr = self.run.train
        start = time.perf_counter()
        self.grad_sync.zero()
        batches = self.train_data.iteration(self.consumed_train, self.run.pipeline.num_microbatches)
        tracing = self.tracer is not None and len(self.tracer.events) < TRACE_ITERATIONS * len(
            self.schedule.actions[self.state.pp_rank])
        self.engine.tracer = self.tracer if tracing else None
        result = self.engine.run(batches, loss_scale=self.optimizer.loss_scale if self.run.optimizer.fp16 else 1.0,
                                 grad_sync=self.grad_sync)
        step = self.optimizer.step()
        if step.successful:
            self.scheduler.step(1)
        else:
            self.skipped += 1
        loss = reduce_loss(result, self.state, self.run.pipeline.num_microbatches)
        self.step_times.append(time.perf_counter() - start)
        self.iteration += 1
        self.consumed_train += tr.global_batch_size
        return loss, step

    def evaluate(self, data, iters: int) -> float | None:
        if data is None or iters <= 0:
            return None
        for c in self.chunks:
            c.eval()
        total = 0.0
        for _ in range(iters):
            batches = data.iteration(self.consumed_valid, self.run.pipeline.num_microbatches)
            total += reduce_loss(self.engine.run(batches, forward_only=True), self.state,
                                 self.run.pipeline.num_microbatches)
            self.consumed_valid += self.run.train.global_batch_size
        for c in self.chunks:
            c.train()
        return total / iters

    # -- loop ------------------------------------------------------------------------------------------------
    def train(self) -> None:
        tr, st = self.run.train, self.state
        sig = _Signal()
        start = time.time()
        interval_loss, interval_count, interval_nan, interval_skipped = 0.0, 0, 0, 0
        t_interval = time.time()
        iters_in_interval = 0
        while self.iteration < tr.train_iters:
            loss, step = self.train_step()
            self.history.append((self.iteration, loss, step.grad_norm))
            iters_in_interval += 1
            if not step.successful:
                interval_skipped += 1
            if math.isfinite(loss):
                if step.successful:
                    interval_loss += loss
                    interval_count += 1
            else:
                interval_nan += 1
            if self.iteration % tr.log_interval == 0:
                elapsed = (time.time() - t_interval) / iters_in_interval
                avg = interval_loss / max(interval_count, 1)
                print_last(st, format_train_log(
                    iteration=self.iteration, train_iters=tr.train_iters, consumed_samples=self.consumed_train,
                    elapsed_ms=elapsed * 1000.0, learning_rate=self.optimizer.get_lr(),
                    global_batch_size=tr.global_batch_size, losses={"lm loss": avg},
                    loss_scale=step.loss_scale, grad_norm=step.grad_norm, skipped_iters=interval_skipped,
                    nan_iters=interval_nan))
                tokens = tr.global_batch_size * self.run.model.seq_length
                self.tb.add_scalars({"lm loss": avg, "learning-rate": self.optimizer.get_lr(),
                                     "loss-scale": step.loss_scale, "grad-norm": step.grad_norm or 0.0,
                                     "samples-per-second": tr.global_batch_size / elapsed,
                                     "tokens-per-second": tokens / elapsed}, self.iteration)
                interval_loss, interval_count, interval_nan, interval_skipped = 0.0, 0, 0, 0
                iters_in_interval = 0
                t_interval = time.time()
            if tr.eval_interval and self.iteration % tr.eval_interval == 0 and self.valid_data is not None:
                self._validate()
            saved = False
            if tr.save and tr.save_interval and self.iteration % tr.save_interval == 0:
                self.save()
                saved = True
            stop = _any_rank(sig.received, st)
            if tr.exit_duration_in_mins is not None:
                stop = stop or _any_rank((time.time() - start) / 60.0 > tr.exit_duration_in_mins, st)
            if tr.exit_interval and self.iteration % tr.exit_interval == 0:
                stop = True
            if stop:
                if tr.save and not saved:
                    self.save()
                print_first(st, f" exiting program at iteration {self.iteration}")
                return
        if tr.save and not (tr.save_interval and self.iteration % tr.save_interval == 0):
            self.save()

    def _validate(self) -> None:
        loss = self.evaluate(self.valid_data, self.run.train.eval_iters)
        if loss is None:
            return
        line = format_validation_log(self.iteration, loss)
        bar = "-" * (len(line) + 1)
        print_last(self.state, f"{bar}\n {line}\n{bar}")
        self.tb.add_scalars({"lm loss validation": loss}, self.iteration)

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
        store = self.engine.activation_stats()["peak_bytes"] if self.engine.store is not None else 0.0
        return float(params + self.grad_sync.buffer_bytes() + self.optimizer.state_bytes() + store)

    def finish(self) -> None:
        if self.run.train.log_activation_memory and self.state.tp_rank == 0 and self.state.dp_rank == 0:
            for line in self.engine.activation_report():
                print(line, flush=True)
        if self.tracer is not None:
            self.tracer.write(self.run.train.pipeline_trace)
            print_first(self.state, f" pipeline trace written to {self.run.train.pipeline_trace}")
        self.tb.close()


def build_trainer(argv: list[str], tokenizer=None) -> Trainer:
    """Parse flags and set up a Trainer inside an initialised process group (used by tests and tools)."""
    from ..arguments import configs_from_args, parse_args

    run = configs_from_args(parse_args(argv), _world(), vocab_size=tokenizer.vocab_size if tokenizer else None)
    trainer = Trainer(run, ParallelState.build(run.parallel), tokenizer)
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
