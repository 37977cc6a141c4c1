"""What a CPU training process holds beyond the tensors the memory model counts, measured for a CPU profile.

The terms take the form of the memory model's allowance, a fixed part and a fraction of the counted bytes:
- runtime_bytes: the rise of the peak resident memory over the first training steps of a tiny GPT in a process
  that has run none. This is what PyTorch's CPU runtime allocates on first use (thread pools, the kernel
  libraries' scratch, the autograd engine). A process pays it once, and a training run's plan check measures it.
- fraction: then a copy of the profiled model cut to two layers runs a few steps: its largest profiled
  micro-batch size, two micro-batches, its optimizer. The fraction is that run's resident rise over what the memory
  model counts for it (model states, the activations at the schedule's peak, the worst unit backward's
  transients), minus one. This is the C allocator's part: freed blocks its arenas keep, pages of freed tensors
  reused only in part.
Both are measured through the trainer itself (`Trainer`), so the run's own allocations are the ones counted.
"""

from __future__ import annotations

from dataclasses import replace

from ..config import DataConfig, ModelConfig, ParallelConfig, PipelineConfig, RunConfig, TrainConfig
from .process_memory import ResidentPeak

STEPS = 3
TINY = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=64, seq_length=8,
                   max_position_embeddings=8, attention_backend="unfused")


def _rise(run: RunConfig) -> tuple[float, float] | None:
    """(resident rise, the trainer's tracked bytes) over STEPS iterations of `run` from here; None without /proc."""
    from ..parallel.state import ParallelState
    from .loop import Trainer

    mark = ResidentPeak()
    trainer = Trainer(run, ParallelState.build(run.parallel, device="cpu", num_units=run.model.num_units),
                      track_memory=True)
    for _ in range(STEPS):
        trainer.train_step()
    grown = mark.growth()
    tracked = trainer.memory_in_use()
    trainer.state.destroy()
    return None if grown is None else (grown, tracked)


def _serial_run(run: RunConfig, model: ModelConfig, micro_batch_size: int) -> RunConfig:
    microbatches = 2
    return replace(run, model=model, parallel=ParallelConfig(),
                   pipeline=PipelineConfig(micro_batch_size=micro_batch_size, num_microbatches=microbatches),
                   train=TrainConfig(global_batch_size=micro_batch_size * microbatches, train_iters=STEPS,
                                     eval_iters=0, log_interval=STEPS, seed=run.train.seed,
                                     gradient_accumulation_fusion=run.train.gradient_accumulation_fusion),
                   data=DataConfig(mock_data=True, vocab_size=model.vocab_size))


def measure_host_memory(run: RunConfig, micro_batch_size: int) -> dict:
    """{"runtime_bytes", "fraction"} for the profile of `run`'s model, or {} where /proc is not there. Call it in
    a process that has not trained yet: the runtime's first use is what it measures first."""
    from ..planner.evaluate import estimate_memory
    from ..planner.memory_model import MemorySettings
    from ..planner.spec import spec_from_run_config

    tiny = _rise(_serial_run(run, replace(TINY, params_dtype=run.model.params_dtype), 1))
    if tiny is None:
        return {}
    cut = _serial_run(run, replace(run.model, num_layers=min(2, run.model.num_layers)), micro_batch_size)
    rise = _rise(cut)
    if rise is None:
        return {}
    counted = estimate_memory(spec_from_run_config(cut, 1), settings=MemorySettings(device="cpu"))[0]
    total = counted.params_bytes + counted.grads_bytes + counted.optimizer_bytes + counted.activation_bytes \
        + counted.transient_bytes
    return {"runtime_bytes": max(0.0, tiny[0] - tiny[1]), "fraction": max(0.0, rise[0] / total - 1.0)}
