"""Where the model's units live on a pipeline stage's ranks: one interface, two placements.

`Uniform` is Megatron's layout: every unit on the run's tp x dp ranks, each dp rank with its own micro-batch.
`parallel/hybrid.Hybrid` (Galvatron-BMW, `--unit-strategies`) gives every unit its own strategy over the stage's
ranks. `ParallelState.units` holds one or the other; the model builder, the engine, the trainer and the
checkpoints ask it, never which one it is. `Uniform` documents the interface.
"""

from __future__ import annotations

from collections.abc import Callable

from ..units import hidden_shape as _hidden_shape, unit_names


class Uniform:
    """Megatron's placement (the default)."""

    # where a norm's counted elements lie: the model-parallel group (dp ranks hold copies), or every rank
    norms_over_world = False

    def names(self) -> list[str] | None:
        """The unit strategies as text (checkpoints record them), None for a uniform layout."""
        return None

    # -- building the model ------------------------------------------------------------------------------------
    def check(self, cfg) -> None:
        """Refuse, in one line, a model this placement cannot run."""

    def seed(self, tracker, seed: int) -> None:
        """Add the RNG streams the units need beyond random.set_seeds' (none here)."""

    def unit_state(self, state, index: int):
        """The ParallelState unit `index` is built with."""
        return state

    def chunks(self, cfg, state, units: dict, chunk_units: list[list[int]], make_chunk: Callable) -> list:
        """This rank's chunks (`make_chunk({name: unit})` each) from its built units."""
        names = unit_names(cfg.num_layers)
        return [make_chunk({names[i]: units[names[i]] for i in c}) for c in chunk_units]

    # -- data and loss -----------------------------------------------------------------------------------------
    def loader(self, state, micro_batch_size: int) -> tuple[int, int, int]:
        """(samples per micro-batch, data-parallel size, data-parallel rank) this rank loads."""
        return micro_batch_size, state.dp_size, state.dp_rank

    def hidden_shape(self, cfg, state, micro_batch_size: int) -> tuple[int, int, int]:
        """[seq, batch, hidden] of the hidden state between pipeline stages."""
        return _hidden_shape(cfg.seq_length // state.cp_size, micro_batch_size, cfg.hidden_size, state.tp_size,
                             state.sequence_parallel)

    def weigh(self, batch: dict) -> dict:
        """The micro-batch as the head needs it (hybrid adds per-sample loss weights)."""
        return batch

    def loss_divisor(self, state) -> int:
        """What the sum of the ranks' losses over the gradient group (dp, or dp x cp) is divided by to give the mean
        loss."""
        return state.dp_size * state.cp_size

    # -- parameters, gradients, norms ------------------------------------------------------------------------
    def trainable(self, named: list) -> list:
        """(name, tensor) pairs the optimizer updates."""
        return named

    def grad_sync(self, params: list, state, overlap: bool = False, fusion: bool = True):
        from .grad_sync import GradSync

        return GradSync(params, state, overlap=overlap, fusion=fusion)

    def activation_params(self, chunks: list) -> Callable[[], set[int]] | None:
        """Storages that look like activations but are parameters (gathered shards), for the activation store."""
        return None

    # -- checkpoints ---------------------------------------------------------------------------------------------
    def checkpoint_shard(self, state) -> tuple[int, int, bool]:
        """(rank, size) naming this rank's mp_rank_* directory, and whether this rank writes one."""
        return state.tp_rank, state.tp_size, state.dp_rank == 0 and state.cp_rank == 0

    def state_dict(self, chunk) -> dict:
        return chunk.state_dict()

    def load_state_dict(self, chunk, sd: dict) -> None:
        chunk.load_state_dict(sd, strict=True)

    def destroy(self) -> None:
        """Release what the placement holds beyond ParallelState's groups."""
