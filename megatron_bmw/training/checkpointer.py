"""The Trainer's checkpoints: `Checkpointer` saves this rank's model chunks and optimizer in the run's format and
loads whatever format the tracked iteration was saved in.

The formats (checkpoint_dir.CheckpointFormat) are checkpointing.TorchFormat (`torch`, Megatron's per-rank files)
and dist_checkpoint.DistFormat (`torch_dist`, any layout); the tracker, the atomic save, the checksums and the
verified read are checkpoint_dir.py's. Here: which format and which iteration. A damaged iteration (a file whose
checksum or size differs, or that is missing or unreadable) stops --load with one line naming the file; with
--load-fallback the latest earlier iteration in the folder is loaded instead, and the run says so in one line.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import Reported, UsageError, say
from ..parallel.agree import agree
from ..parallel.state import ParallelState
from . import checkpoint_dir
from .checkpoint_dir import (DIST_FORMAT, RELEASE, TORCH_FORMAT, TRACKER, CheckpointFormat, Damaged, IterationDir,
                             agree_damage, earlier_iterations, format_of, inside_checkpoint, iteration_dir_name,
                             read_tracker, resolve_iteration_dir, world)
from .checkpointing import TorchFormat
from .optimizer import MixedPrecisionOptimizer


@dataclass(frozen=True)
class Loaded:
    """What --load read: the iteration (or "release"), the format it was saved in, and its payload (the model and
    the optimizer are loaded already)."""

    iteration: int | str
    format: str
    payload: dict


class Checkpointer:
    """Checkpoints of one rank's model chunks and optimizer."""

    def __init__(self, state: ParallelState, chunks: list, optimizer: MixedPrecisionOptimizer | None) -> None:
        self.state, self.chunks, self.optimizer = state, chunks, optimizer

    def format(self, name: str) -> CheckpointFormat:
        if name == DIST_FORMAT:
            from .dist_checkpoint import DistFormat  # torch.distributed.checkpoint takes seconds to import

            return DistFormat(self.state, self.chunks, self.optimizer)
        return TorchFormat(self.state, self.chunks, self.optimizer)

    def save(self, save_dir: str, iteration: int, payload: dict, fmt: str = TORCH_FORMAT, save_optim: bool = True,
             rng_state: dict | None = None) -> str:
        """Save `iteration` (every rank calls it): `payload` without the model, `rng_state` this rank's streams.
        Returns the iteration folder."""
        return checkpoint_dir.save(self.format(fmt), self.state, save_dir, iteration, payload, rng_state, save_optim)

    def load(self, load_dir: str, load_optim: bool = True, model_args: dict | None = None,
             fallback: bool = False) -> Loaded | None:
        """The tracker's iteration, loaded (the optimizer's state only with `load_optim`, never from a release);
        None, with Megatron's warning, when `load_dir` has no tracker. A damaged iteration is an error naming the
        file; with `fallback` the latest earlier one is loaded instead."""
        iteration = agree(_tracked, load_dir)
        if iteration is None:
            self._say(f"WARNING: could not find the metadata file {os.path.join(load_dir, TRACKER)}\n"
                      "    will not load any checkpoints and will start from random")
            return None
        while True:
            try:
                source, name = agree_damage(_source, load_dir, iteration)
                payload = checkpoint_dir.read(self.format(name), source, load_optim and iteration != RELEASE,
                                              model_args)
                return Loaded(iteration, name, payload)
            except Damaged as exc:
                earlier = earlier_iterations(load_dir, iteration)
                if not (fallback and earlier):
                    raise _refused(exc, load_dir, earlier, fallback) from None
                self._say(f" > --load-fallback: {iteration_dir_name(iteration)} is damaged ({exc.detail}); loading "
                          f"{iteration_dir_name(earlier[0])}")
                iteration = earlier[0]

    def _say(self, text: str) -> None:
        if self.state.rank == 0:
            print(text, flush=True)


def _refused(exc: Damaged, load_dir: str, earlier: list[int], fallback: bool) -> Exception:
    """The damaged iteration's line, saying what --load-fallback would do; printed once, by the rank that met it
    (as parallel/agree.py prints)."""
    if fallback:
        hint = f"; --load-fallback found no earlier checkpoint in {load_dir}"
    else:
        hint = f"; --load-fallback would load iteration {earlier[0]} instead" if earlier else ""
    message = f"{exc}{hint}"
    if world()[1] == 1:
        return Damaged(message, exc.detail)
    rank = getattr(exc, "rank", world()[0])
    if rank == world()[0]:
        say(f"rank {rank}: {message}")
    return Reported(UsageError.exit_code)


def _tracked(load_dir: str) -> int | str | None:
    """The tracker's iteration; None where there is none (a folder inside a checkpoint, or a file, is an error)."""
    iteration = read_tracker(load_dir)
    if iteration is not None:
        return iteration
    if os.path.exists(load_dir) and not os.path.isdir(load_dir):
        raise UsageError(f"--load {load_dir}: not a directory (give the checkpoint directory)")
    inside = inside_checkpoint(load_dir)
    if inside:
        raise UsageError(f"--load {load_dir}: this folder is inside a checkpoint (it holds {inside}); give the "
                         f"checkpoint's top directory, which holds {TRACKER}")
    return None


def _source(load_dir: str, iteration: int | str) -> tuple[IterationDir, str]:
    """The iteration's folder and the format it was saved in."""
    path = resolve_iteration_dir(load_dir, iteration)
    return IterationDir(load_dir, iteration, path), format_of(load_dir, path)
