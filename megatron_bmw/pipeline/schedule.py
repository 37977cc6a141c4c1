"""Pipeline schedule IR: per pipeline rank, an ordered list of actions.

Generators build a `Schedule`, transforms rewrite it, and both the runtime engine and the
replay simulator execute the same object. Pure Python, no torch.

Virtual stages: rank r holds model chunks 0..v-1. The schedule's `placement` says where each of the p * v
virtual stages sits: "interleaved" (Megatron's): chunk c of rank r is virtual stage c * p + r; "v" (zero-bubble
V schedules): the stages zig-zag over the ranks, chunk c of rank r is c * p + r for even c and c * p + p-1-r for
odd c, so with two chunks rank 0 holds the first and the last stage. Activations flow from virtual stage k to
k + 1, gradients from k + 1 to k. Virtual stage 0 reads the data, virtual stage p * v - 1 computes the loss.
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
    # Zero-bubble split of a BACKWARD: the input gradient (shown as B; it consumes and produces what BACKWARD
    # does) and the deferred weight gradient W (no communication), which runs later on the same rank.
    BACKWARD_INPUT = "BI"
    BACKWARD_WEIGHT = "W"
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


COMPUTE_KINDS = frozenset({Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT})
GRAD_KINDS = frozenset({Kind.BACKWARD, Kind.BACKWARD_INPUT})  # computes consuming and producing gradients
SEND_KINDS = frozenset({Kind.SEND_ACT, Kind.SEND_GRAD})
RECV_KINDS = frozenset({Kind.RECV_ACT, Kind.RECV_GRAD})
COMM_KINDS = SEND_KINDS | RECV_KINDS
TRANSFER_KINDS = frozenset({Kind.EVICT, Kind.LOAD, Kind.ACCEPT, Kind.RETURN})
OUTGOING_KINDS = SEND_KINDS | {Kind.EVICT, Kind.RETURN}

_SHORT = {
    Kind.FORWARD: "F",
    Kind.BACKWARD: "B",
    Kind.BACKWARD_INPUT: "B",
    Kind.BACKWARD_WEIGHT: "W",
    Kind.SEND_ACT: "SA",
    Kind.RECV_ACT: "RA",
    Kind.SEND_GRAD: "SG",
    Kind.RECV_GRAD: "RG",
    Kind.EVICT: "EV",
    Kind.LOAD: "LD",
    Kind.ACCEPT: "AC",
    Kind.RETURN: "RT",
}

PLACEMENTS = ("interleaved", "v")


def stage_index(rank: int, chunk: int, p: int, placement: str = "interleaved") -> int:
    """Virtual stage of model chunk `chunk` on pipeline rank `rank` of `p`."""
    if placement == "v" and chunk % 2:
        return chunk * p + p - 1 - rank
    return chunk * p + rank


def stage_location(vstage: int, p: int, placement: str = "interleaved") -> tuple[int, int]:
    """(rank, chunk) holding virtual stage `vstage` on `p` pipeline ranks."""
    chunk, pos = divmod(vstage, p)
    return (p - 1 - pos if placement == "v" and chunk % 2 else pos), chunk


Key = tuple[int, int, int | None]  # (microbatch, chunk, half)
# A tensor crossing between virtual stages: (is_grad, producer virtual stage, microbatch, half).
Tensor = tuple[bool, int, int, int | None]
_TAG_LIMIT = 2**31 - 1


def half_code(half: int | None) -> int:
    return 0 if half is None else half + 1


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
    def weight(self) -> float:
        """Share of a whole micro-batch: 1, or 0.5 for a half of a sliced one."""
        return 1.0 if self.half is None else 0.5

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    def label(self, show_chunk: bool = True) -> str:
        """Short text such as F3, B3.1 (chunk 1), F3a (half 0), W3 (weight gradient), SA3>2 (send activation to
        rank 2), EV3>5. An input-gradient BACKWARD_INPUT shows as B, like a whole BACKWARD."""
        chunk = f".{self.chunk}" if show_chunk else ""
        half = "" if self.half is None else "ab"[self.half]
        if self.kind in COMPUTE_KINDS:
            return f"{_SHORT[self.kind]}{self.microbatch}{chunk}{half}"
        text = f"{_SHORT[self.kind]}{self.microbatch}{chunk}{half}"
        if self.peer is not None:
            text += (">" if self.kind in OUTGOING_KINDS else "<") + str(self.peer)
        return text

    def __str__(self) -> str:
        return self.label()


@dataclass
class Schedule:
    """Per-rank action lists for one pipeline-parallel iteration."""

    name: str  # "gpipe" | "1f1b" | "interleaved" | "zb-h1" | "zb-h2" | "zb-1p" | "zb-2p" | "zbv"
    pp: int  # pipeline ranks (the number of stages is pp x virtual_stages)
    num_microbatches: int  # m
    virtual_stages: int  # v (model chunks per rank)
    actions: list[list[Action]] = field(default_factory=list)  # actions[rank] in execution order
    # Set by the BPipe transform: no rank may hold more chunk-micro-batches of saved activations (own
    # resident ones plus accepted ones; a half counts 0.5). The checker enforces it.
    activation_limit: float | None = None
    placement: str = "interleaved"  # where the virtual stages sit (PLACEMENTS; see the module docstring)

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ScheduleError(f"unknown stage placement {self.placement!r} (choose {', '.join(PLACEMENTS)})")

    @property
    def num_virtual_stages(self) -> int:
        return self.pp * self.virtual_stages

    # ---- tensor identity: the one place that says which virtual stage runs where and what flows -------------
    def stage_of(self, rank: int, chunk: int) -> int:
        """Virtual stage of model chunk `chunk` on pipeline rank `rank`."""
        return stage_index(rank, chunk, self.pp, self.placement)

    def location(self, vstage: int) -> tuple[int, int]:
        """(rank, chunk) holding virtual stage `vstage`."""
        return stage_location(vstage, self.pp, self.placement)

    def rank_of(self, vstage: int) -> int:
        return stage_location(vstage, self.pp, self.placement)[0]

    @property
    def loss_rank(self) -> int:
        """The pipeline rank holding the last virtual stage (the loss)."""
        return self.rank_of(self.num_virtual_stages - 1)

    def tensor(self, rank: int, chunk: int, microbatch: int, half: int | None, grad: bool,
               output: bool) -> Tensor | None:
        """The activation (or, with `grad`, gradient) that chunk `chunk` of `rank` consumes from a neighbouring
        virtual stage, or with `output` produces for one; None at the ends of the pipeline (data, loss)."""
        vs = stage_index(rank, chunk, self.pp, self.placement)
        if output:
            return None if vs == (0 if grad else self.pp * self.virtual_stages - 1) else \
                (grad, vs, microbatch, half)
        if grad:
            return None if vs == self.pp * self.virtual_stages - 1 else (True, vs + 1, microbatch, half)
        return None if vs == 0 else (False, vs - 1, microbatch, half)

    def input_tensor(self, rank: int, a: Action) -> Tensor | None:
        """What a FORWARD (activation) or BACKWARD/BACKWARD_INPUT (gradient) consumes from a neighbouring virtual
        stage."""
        if a.kind is not Kind.FORWARD and a.kind not in GRAD_KINDS:
            return None
        return self.tensor(rank, a.chunk, a.microbatch, a.half, a.kind in GRAD_KINDS, False)

    def output_tensor(self, rank: int, a: Action) -> Tensor | None:
        """What a FORWARD or BACKWARD/BACKWARD_INPUT produces for a neighbouring virtual stage."""
        if a.kind is not Kind.FORWARD and a.kind not in GRAD_KINDS:
            return None
        return self.tensor(rank, a.chunk, a.microbatch, a.half, a.kind in GRAD_KINDS, True)

    def wire_tensor(self, rank: int, a: Action) -> Tensor | None:
        """The tensor a SEND carries (its chunk's output) or a RECV takes (its chunk's input)."""
        kind = a.kind
        if kind not in COMM_KINDS:
            raise ValueError(f"{a} does not carry a tensor")
        return self.tensor(rank, a.chunk, a.microbatch, a.half, kind is Kind.SEND_GRAD or kind is Kind.RECV_GRAD,
                           kind in SEND_KINDS)

    def consumer_rank(self, tensor: Tensor) -> int:
        grad, producer = tensor[0], tensor[1]
        return self.rank_of(producer - 1 if grad else producer + 1)

    @property
    def num_tensor_ids(self) -> int:
        return 6 * self.num_microbatches * self.num_virtual_stages

    def tensor_id(self, tensor: Tensor) -> int:
        """Dense id of a tensor (replay's index, the engine's point-to-point tag): the same micro-batch's tensors
        of neighbouring virtual stages are 6 ids apart."""
        grad, producer, mb, half = tensor
        return ((mb * self.num_virtual_stages + producer) * 3 + half_code(half)) * 2 + int(grad)

    # ---- BPipe transfers: ids and tags above every tensor's ------------------------------------------------
    @property
    def num_keys(self) -> int:
        """(micro-batch, chunk, whole/half 0/half 1) keys of one rank."""
        return 3 * self.num_microbatches * self.virtual_stages

    def key_index(self, key: Key) -> int:
        mb, chunk, half = key
        return (mb * self.virtual_stages + chunk) * 3 + half_code(half)

    def p2p_tag(self, tensor: Tensor) -> int:
        return self.tensor_id(tensor) % _TAG_LIMIT

    def transfer_tag(self, direction: int, key: Key) -> int:
        """Tag of a BPipe move of `key` (direction 0: EVICT -> ACCEPT, 1: RETURN -> LOAD)."""
        return (self.num_tensor_ids + direction * self.num_keys + self.key_index(key)) % _TAG_LIMIT

    def header_tag(self, chunk: int, half: bool) -> int:
        """Tag of the one-int64 header announcing a (chunk, whole/half) class's byte size."""
        return (self.num_tensor_ids + 2 * self.num_keys + 2 * chunk + int(half)) % _TAG_LIMIT

    def compute_actions(self, rank: int) -> list[Action]:
        return [a for a in self.actions[rank] if a.kind in COMPUTE_KINDS]

    def copy(self, actions: list[list[Action]] | None = None) -> Schedule:
        """Same schedule with new (or copied) action lists; actions are immutable and shared."""
        new = [list(a) for a in (self.actions if actions is None else actions)]
        return Schedule(self.name, self.pp, self.num_microbatches, self.virtual_stages, new,
                        self.activation_limit, self.placement)

    def to_text(self, comm: bool = False) -> str:
        """One line per rank, e.g. 'rank 0: F0 F1 B0 F2 B1 B2'; `comm` adds SEND/RECV and BPipe transfers."""
        width = len(str(max(self.pp - 1, 0)))
        show_chunk = self.virtual_stages > 1
        lines = []
        for rank, acts in enumerate(self.actions):
            shown = acts if comm else [a for a in acts if a.kind in COMPUTE_KINDS]
            body = " ".join(a.label(show_chunk) for a in shown)
            lines.append(f"rank {rank:>{width}}: {body}".rstrip())
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_text()
