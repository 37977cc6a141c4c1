"""This rank's place in the parallel layout and the process groups it talks over, as the tensor-parallel layers,
the gradient sync and the placements read it: ParallelState (state.py) builds one and owns its groups; a hybrid
unit sees its own (hybrid.UnitState)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .layout import RankLayout
from .placement import Uniform
from .random import RNGTracker


@dataclass
class ParallelView:
    layout: RankLayout
    rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    tp_group: object = None
    dp_group: object = None
    pp_group: object = None
    mp_group: object = None
    embedding_group: object = None
    cp_group: object = None  # ranks holding the other chunks of this rank's sequences (--context-parallel-size)
    dp_cp_group: object = None  # dp x cp: where gradients are reduced and ZeRO-1 shards (None when cp is 1)
    cp_ranks: tuple[int, ...] = (0,)  # global ranks of this rank's cp group, by cp rank
    cp_comm_type: str = "p2p"  # how attention crosses the cp group (--cp-comm-type)
    pp_ranks: tuple[int, ...] = (0,)  # global ranks of this rank's pipeline, by stage
    # the experts' groups (docs/moe.md; the layout's etp x ep x edp over the stage's ranks; None when size 1)
    ep_group: object = None  # ranks holding different experts (alltoall dispatcher)
    etp_group: object = None  # ranks holding tensor-parallel shards of the same experts
    edp_group: object = None  # ranks holding the same expert shards: expert gradients are summed over it
    etp_ep_group: object = None  # etp x ep (allgather dispatcher)
    ep_ranks: tuple[int, ...] = (0,)  # global ranks of this rank's ep group, by ep rank
    # the gradient of an MoE auxiliary loss (models/moe.py): the engine sets it before each backward to that
    # micro-batch's scale (loss scale / micro-batches), as Megatron's MoEAuxLossAutoScaler.set_loss_scale
    aux_loss_scale: float = 1.0
    # the share of its micro-batch the running forward or backward holds (a sliced half: 1/2), which weighs the
    # auxiliary losses a unit reports for the log; the engine sets it with aux_loss_scale
    aux_loss_share: float = 1.0
    sequence_parallel: bool = False
    rng: RNGTracker = field(default_factory=RNGTracker)
    # NCCL only: one group per direction of each neighbouring pipeline pair, keyed (src, dst) global ranks, so a
    # communicator carries one direction and per-channel FIFO order is enough to rule out cross-direction cycles.
    p2p_groups: dict = field(default_factory=dict)
    # NCCL with the bpipe rank order: one group per direction of each BPipe pair (stage s, stage p-1-s), keyed
    # (src, dst) global ranks, so evicted activations never share a communicator with stage-to-stage traffic.
    transfer_groups: dict = field(default_factory=dict)
    # where the units live on the stage's ranks (parallel/placement.py): Megatron's, or per-unit strategies
    units: Uniform = field(default_factory=Uniform)
    owned_groups: list = field(default_factory=list, repr=False)  # every group build() made: destroy() ends them

    def __post_init__(self) -> None:
        if self.rng.device != self.device:
            self.rng = RNGTracker(self.device)

    def p2p_group(self, src: int, dst: int):
        """Process group for point-to-point traffic from global rank src to dst (None: the default group)."""
        return self.p2p_groups.get((src, dst))

    def transfer_group(self, src: int, dst: int):
        """Process group for BPipe transfers from global rank src to dst (None: the default group)."""
        return self.transfer_groups.get((src, dst))

    @property
    def tp_rank(self) -> int:
        return self.layout.coords(self.rank)[0]

    @property
    def dp_rank(self) -> int:
        return self.layout.coords(self.rank)[1]

    @property
    def pp_rank(self) -> int:
        return self.layout.coords(self.rank)[2]

    @property
    def cp_rank(self) -> int:
        return self.layout.all_coords(self.rank)[1]

    @property
    def cp_size(self) -> int:
        return self.layout.cp

    @property
    def grad_group(self):
        """The group gradients are averaged over (and ZeRO-1 shards over): dp, or dp x cp with context parallelism."""
        return self.dp_cp_group if self.layout.cp > 1 else self.dp_group

    @property
    def ep_rank(self) -> int:
        return self.layout.expert_coords(self.rank)[1]

    @property
    def ep_size(self) -> int:
        return self.layout.ep

    @property
    def etp_rank(self) -> int:
        return self.layout.expert_coords(self.rank)[0]

    @property
    def etp_size(self) -> int:
        return self.layout.etp

    @property
    def edp_rank(self) -> int:
        return self.layout.expert_coords(self.rank)[2]

    @property
    def edp_size(self) -> int:
        return self.layout.edp

    @property
    def tp_size(self) -> int:
        return self.layout.tp

    @property
    def dp_size(self) -> int:
        return self.layout.dp

    @property
    def pp_size(self) -> int:
        return self.layout.pp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1
