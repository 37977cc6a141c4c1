"""What a CPU training process holds beyond the tensors the memory model counts, measured for a CPU profile.

The terms take the form of the memory model's allowance, a fixed part and a fraction of the counted bytes. Both
are read from the rise of the process's resident peak over a few training steps of the profiled model cut to one
layer and to two layers, each trainer (`Trainer`, so the run's own allocations are the ones counted) started after
the previous one's memory went back to the system:
- fraction: the two-layer run's rise over the one-layer run's, against what the memory model counts more for it
  (model states, activations at the schedule's peak, the worst unit backward's transients), minus one. This is
  the C allocator's part, blocks its arenas keep and pages of freed tensors reused only in part. A difference
  leaves out what does not grow with the model.
- runtime_bytes: the first one-layer run, in a process that has trained nothing, less what the second one-layer
  run counted with that fraction. This is what PyTorch's CPU runtime allocates on first use (thread pools, the
  kernel libraries' scratch, the autograd engine), paid once per process and so in every training run's rise.
The same trainers serve other measures of the cut model (`then`: the optimizer step, optimizer_time.py).
"""

from __future__ import annotations

import ctypes
import gc
from collections.abc import Callable
from dataclasses import replace

from ..config import DataConfig, ParallelConfig, PipelineConfig, RunConfig, TrainConfig
from .process_memory import ResidentPeak

STEPS, MICROBATCHES = 3, 2


def _release() -> None:
    """Hand freed memory back to the system (glibc's malloc_trim), so that the next run's rise is its own."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _rise(run: RunConfig, trainer_class: Callable, then: Callable | None = None) -> tuple[float | None, object]:
    """The resident peak's rise over STEPS iterations of `run` from here (None without /proc), and `then(trainer)`
    after it was read (None without `then`)."""
    from ..parallel.state import ParallelState

    _release()
    mark = ResidentPeak()
    trainer = trainer_class(run, ParallelState.build(run.parallel, device="cpu", num_units=run.model.num_units))
    for _ in range(STEPS):
        trainer.train_step()
    grown = mark.growth()
    after = then(trainer) if then is not None else None
    trainer.state.destroy()
    del trainer
    _release()
    return grown, after


def cut_run(run: RunConfig, layers: int, micro_batch_size: int) -> RunConfig:
    """`run` on one CPU process with its model cut to `layers`: MICROBATCHES micro-batches, STEPS iterations, mock
    data. An MoE model keeps its first layers' pattern of MoE and dense layers (cyclically where it has fewer)."""
    model = replace(run.model, num_layers=layers)
    if model.moe is not None:
        pattern = run.model.moe.layers(run.model.num_layers)
        cut = ",".join(str(int(pattern[i % len(pattern)])) for i in range(layers))
        model = replace(model, moe=replace(model.moe, layer_freq=f"[{cut}]"))
    return replace(run, model=model, parallel=ParallelConfig(),
                   pipeline=PipelineConfig(micro_batch_size=micro_batch_size, num_microbatches=MICROBATCHES),
                   train=TrainConfig(global_batch_size=micro_batch_size * MICROBATCHES, train_iters=STEPS,
                                     eval_iters=0, log_interval=STEPS, seed=run.train.seed,
                                     gradient_accumulation_fusion=run.train.gradient_accumulation_fusion),
                   data=DataConfig(mock_data=True, vocab_size=model.vocab_size))


def _counted(run: RunConfig) -> float:
    """What the memory model counts for `run` on the CPU, without an allowance."""
    from ..planner.evaluate import estimate_memory
    from ..planner.memory_model import MemorySettings
    from ..planner.spec import spec_from_run_config

    m = estimate_memory(spec_from_run_config(run, 1), settings=MemorySettings(device="cpu"))[0]
    return m.params_bytes + m.grads_bytes + m.optimizer_bytes + m.activation_bytes + m.transient_bytes


def measure_host_memory(run: RunConfig, micro_batch_size: int, trainer_class: Callable,
                        then: Callable | None = None) -> tuple[dict, list]:
    """{"runtime_bytes", "fraction"} for the profile of `run`'s model at `micro_batch_size` ({} where /proc is not
    there), and `then(trainer)` of the second one-layer and the two-layer runs (other measures on the same
    trainers: optimizer_time.py). trainer_class: training/loop.Trainer, passed in (the loop imports the profiler,
    which imports this module). Call it in a process that has not trained yet: the runtime's first use is part of
    what it reads."""
    one, two = cut_run(run, 1, micro_batch_size), cut_run(run, 2, micro_batch_size)
    (first, _), (again, a), (deeper, b) = (_rise(one, trainer_class), _rise(one, trainer_class, then),
                                           _rise(two, trainer_class, then))
    if first is None or again is None or deeper is None:
        return {}, [a, b]
    per_byte = max(1.0, (deeper - again) / (_counted(two) - _counted(one)))
    return {"runtime_bytes": max(0.0, first - per_byte * _counted(one)), "fraction": per_byte - 1.0}, [a, b]
