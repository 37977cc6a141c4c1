"""Pipeline schedule IR: per pipeline rank, an ordered list of actions.

Generators build a `Schedule`, transforms rewrite it, and both the runtime engine and the
replay simulator execute the same object. Pure Python, no torch.

Virtual stages: rank r holds model chunks 0..v-1; chunk c of rank r is virtual stage
c * p + r (Megatron's placement). Activations flow from virtual stage k to k + 1, gradients
from k + 1 to k. Virtual stage 0 reads the data, virtual stage p * v - 1 computes the loss.
"""

from __future__ import annotations

import enum
import gc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector: building many small tuples otherwise triggers it constantly."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class ScheduleError(Exception):
    """A schedule is malformed or cannot run."""


class DeadlockError(ScheduleError):
    """No rank can make progress before all actions are done."""


class Kind(str, enum.Enum):
    """What an action does."""

    FORWARD = "F"
    BACKWARD = "B"
    SEND_ACT = "SEND_ACT"  # activations flow to the next virtual stage
    RECV_ACT = "RECV_ACT"
    SEND_GRAD = "SEND_GRAD"  # gradients flow to the previous virtual stage
    RECV_GRAD = "RECV_GRAD"
    # BPipe transfers of one (micro-batch, chunk, half)'s saved activations between an evictor and its
    # acceptor `peer`: the evictor EVICTs (sends) and later LOADs (receives back) its own activations; the
    # acceptor ACCEPTs (receives and holds) them and RETURNs (sends back) them. Matching pairs:
    # EVICT <-> ACCEPT, RETURN <-> LOAD.
    EVICT = "EVICT"
    LOAD = "LOAD"
    ACCEPT = "ACCEPT"
    RETURN = "RETURN"

    def __str__(self) -> str:
        return self.value


COMPUTE_KINDS = frozenset({Kind.FORWARD, Kind.BACKWARD})
SEND_KINDS = frozenset({Kind.SEND_ACT, Kind.SEND_GRAD})
RECV_KINDS = frozenset({Kind.RECV_ACT, Kind.RECV_GRAD})
COMM_KINDS = SEND_KINDS | RECV_KINDS
TRANSFER_KINDS = frozenset({Kind.EVICT, Kind.LOAD, Kind.ACCEPT, Kind.RETURN})
OUTGOING_KINDS = SEND_KINDS | {Kind.EVICT, Kind.RETURN}

_SHORT = {
    Kind.SEND_ACT: "SA",
    Kind.RECV_ACT: "RA",
    Kind.SEND_GRAD: "SG",
    Kind.RECV_GRAD: "RG",
    Kind.EVICT: "EV",
    Kind.LOAD: "LD",
    Kind.ACCEPT: "AC",
    Kind.RETURN: "RT",
}

Key = tuple[int, int, int | None]  # (microbatch, chunk, half)


@dataclass(frozen=True)
class Action:
    """One step of a rank's schedule.

    For SEND/RECV, `chunk` is the chunk on this rank that produces/consumes the tensor and
    `peer` is the pipeline rank at the other end. For EVICT/LOAD the key is the evictor's own,
    for ACCEPT/RETURN it is the key on the evictor `peer` (whose activations the acceptor holds).
    `half` is None for a whole micro-batch, 0 or 1 for one half of a sliced micro-batch.
    """

    kind: Kind
    microbatch: int
    chunk: int = 0
    peer: int | None = None
    half: int | None = None

    @property
    def key(self) -> Key:
        return (self.microbatch, self.chunk, self.half)

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM_KINDS

    def label(self, show_chunk: bool = True) -> str:
        """Short text such as F3, B3.1 (chunk 1), F3a (half 0), SA3>2 (send activation to rank 2), EV3>5."""
        chunk = f".{self.chunk}" if show_chunk else ""
        half = "" if self.half is None else "ab"[self.half]
        if self.kind in COMPUTE_KINDS:
            return f"{self.kind.value}{self.microbatch}{chunk}{half}"
        text = f"{_SHORT[self.kind]}{self.microbatch}{chunk}{half}"
        if self.peer is not None:
            text += (">" if self.kind in OUTGOING_KINDS else "<") + str(self.peer)
        return text

    def __str__(self) -> str:
        return self.label()


@dataclass
class Schedule:
    """Per-rank action lists for one pipeline-parallel iteration."""

    name: str  # "gpipe" | "1f1b" | "interleaved"
    num_stages: int  # p (pipeline ranks)
    num_microbatches: int  # m
    virtual_stages: int  # v (model chunks per rank)
    actions: list[list[Action]] = field(default_factory=list)  # actions[rank] in execution order
    # Set by the BPipe transform: no rank may hold more chunk-micro-batches of saved activations (own
    # resident ones plus accepted ones; a half counts 0.5). The checker enforces it.
    activation_limit: float | None = None

    @property
    def num_virtual_stages(self) -> int:
        return self.num_stages * self.virtual_stages

    def virtual_stage(self, rank: int, chunk: int) -> int:
        return chunk * self.num_stages + rank

    def location(self, vstage: int) -> tuple[int, int]:
        """(rank, chunk) holding virtual stage `vstage`."""
        chunk, rank = divmod(vstage, self.num_stages)
        return rank, chunk

    def is_first(self, rank: int, chunk: int) -> bool:
        return rank == 0 and chunk == 0

    def is_last(self, rank: int, chunk: int) -> bool:
        return rank == self.num_stages - 1 and chunk == self.virtual_stages - 1

    def next_location(self, rank: int, chunk: int) -> tuple[int, int]:
        """Where the activations of (rank, chunk) go; only for a non-last virtual stage."""
        return self.location(self.virtual_stage(rank, chunk) + 1)

    def prev_location(self, rank: int, chunk: int) -> tuple[int, int]:
        """Where the gradients of (rank, chunk) go; only for a non-first virtual stage."""
        return self.location(self.virtual_stage(rank, chunk) - 1)

    def source(self, rank: int, action: Action) -> tuple[int, int] | None:
        """(rank, chunk) producing the input a compute action needs, or None (data / loss)."""
        if action.kind is Kind.FORWARD:
            return None if self.is_first(rank, action.chunk) else self.prev_location(rank, action.chunk)
        if action.kind is Kind.BACKWARD:
            return None if self.is_last(rank, action.chunk) else self.next_location(rank, action.chunk)
        return None

    def destination(self, rank: int, action: Action) -> tuple[int, int] | None:
        """(rank, chunk) consuming the output of a compute action, or None (loss / data side)."""
        if action.kind is Kind.FORWARD:
            return None if self.is_last(rank, action.chunk) else self.next_location(rank, action.chunk)
        if action.kind is Kind.BACKWARD:
            return None if self.is_first(rank, action.chunk) else self.prev_location(rank, action.chunk)
        return None

    def compute_actions(self, rank: int) -> list[Action]:
        return [a for a in self.actions[rank] if a.kind in COMPUTE_KINDS]

    def comm_actions(self, rank: int) -> list[Action]:
        return [a for a in self.actions[rank] if a.kind in COMM_KINDS]

    def transfer_actions(self, rank: int) -> list[Action]:
        return [a for a in self.actions[rank] if a.kind in TRANSFER_KINDS]

    def copy(self, actions: list[list[Action]] | None = None) -> Schedule:
        """Same schedule with new (or copied) action lists; actions are immutable and shared."""
        new = [list(a) for a in (self.actions if actions is None else actions)]
        return Schedule(self.name, self.num_stages, self.num_microbatches, self.virtual_stages, new,
                        self.activation_limit)

    def to_text(self, comm: bool = False) -> str:
        """One line per rank, e.g. 'rank 0: F0 F1 B0 F2 B1 B2'; `comm` adds SEND/RECV and BPipe transfers."""
        width = len(str(max(self.num_stages - 1, 0)))
        show_chunk = self.virtual_stages > 1
        lines = []
        for rank, acts in enumerate(self.actions):
            shown = acts if comm else [a for a in acts if a.kind in COMPUTE_KINDS]
            body = " ".join(a.label(show_chunk) for a in shown)
            lines.append(f"rank {rank:>{width}}: {body}".rstrip())
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_text()
