"""One object holding this rank's place in the parallel layout and its process groups: ParallelState builds the
groups (a hybrid placement's too), owns and destroys them; what it records is view.py's ParallelView."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config import ParallelConfig
from ..device import choose_backend, default_device, set_device
from .layout import RankLayout
from .view import ParallelView


@dataclass
class ParallelState(ParallelView):
    """A ParallelView whose process groups `build` makes (a hybrid placement's too) and `destroy` ends."""

    @classmethod
    def serial(cls, device: torch.device | str = "cpu") -> "ParallelState":
        return cls(layout=RankLayout(1, 1, 1), device=torch.device(device))

    @classmethod
    def build(cls, cfg: ParallelConfig, device: torch.device | str | None = None,
              timeout_minutes: float | None = None, num_units: int | None = None) -> "ParallelState":
        """Create every group. All ranks must call this together (dist must be initialised if world > 1).
        timeout_minutes: of every collective in the new groups (--distributed-timeout-minutes); torch does not
        pass the default group's timeout on, and its own default is 30 minutes.
        num_units: the model's unit count, needed with cfg.unit_strategies (then `units` holds their groups)."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        dp = cfg.data_parallel_size(world)
        layout = RankLayout(cfg.tensor_model_parallel_size, dp, cfg.pipeline_model_parallel_size, cfg.rank_order,
                            cfg.context_parallel_size, cfg.expert_model_parallel_size,
                            cfg.expert_tensor_parallel_size or cfg.tensor_model_parallel_size)
        if device is None:
            device = default_device()
        state = cls(layout=layout, rank=rank, device=torch.device(device), sequence_parallel=cfg.sequence_parallel,
                    cp_comm_type=cfg.cp_comm_type)
        before = set(_live_groups())
        new_group = _group_maker(timeout_minutes)
        for attr, groups in (
            ("tp_group", layout.tp_groups()),
            ("dp_group", layout.dp_groups()),
            ("pp_group", layout.pp_groups()),
            ("mp_group", layout.mp_groups()),
            ("embedding_group", layout.embedding_groups()),
            ("cp_group", layout.cp_groups() if layout.cp > 1 else []),
            ("dp_cp_group", layout.dp_cp_groups() if layout.cp > 1 else []),
        ):
            setattr(state, attr, _new_groups(groups, rank, new_group))
        state.pp_ranks = tuple(next(g for g in layout.pp_groups() if rank in g))
        state.cp_ranks = tuple(next(g for g in layout.cp_groups() if rank in g))
        _build_expert_groups(state, layout, rank, new_group)
        if cfg.unit_strategies is not None:
            from .hybrid import Hybrid

            if num_units is None:
                raise ValueError("ParallelState.build: unit strategies need num_units")
            state.units = Hybrid.build(cfg.unit_strategies, num_units, layout, rank, state.dp_group,
                                        timeout_minutes)
        if dist.is_initialized() and dist.get_backend() == "nccl":
            state.p2p_groups = _directional_groups(layout.pp_groups(), rank, new_group)
            if layout.order == "bpipe":
                state.transfer_groups = _pair_groups(layout.pp_groups(), rank, new_group)
        state.owned_groups = [g for g in _live_groups() if g not in before]
        return state

    def destroy(self) -> None:
        """Destroy every process group `build` made (hybrid per-unit groups included); the default group is the
        caller's. Idempotent; the state must not be used for communication afterwards."""
        live = set(_live_groups())
        for g in self.owned_groups:
            if g in live:
                dist.destroy_process_group(g)
        self.owned_groups = []
        self.p2p_groups, self.transfer_groups = {}, {}
        self.units.destroy()


def _build_expert_groups(state: ParallelState, layout: RankLayout, rank: int, new_group) -> None:
    """The experts' groups (docs/moe.md). Where one kind equals a dense kind (a dense model's etp = tp, ep = 1:
    etp is tp, edp is dp or dp x cp) it reuses those groups instead of making new ones."""
    dense = {"tp_group": layout.tp_groups(), "dp_group": layout.dp_groups()}
    if layout.cp > 1:
        dense["dp_cp_group"] = layout.dp_cp_groups()
    for attr, groups in (("ep_group", layout.ep_groups()), ("etp_group", layout.etp_groups()),
                         ("edp_group", layout.edp_groups()), ("etp_ep_group", layout.etp_ep_groups())):
        same = next((name for name, d in dense.items() if sorted(d) == sorted(groups)), None)
        setattr(state, attr, getattr(state, same) if same else _new_groups(groups, rank, new_group))
    state.ep_ranks = tuple(next(g for g in layout.ep_groups() if rank in g))


def _live_groups() -> list:
    """Every process group this process holds, the default one excepted."""
    if not dist.is_initialized():
        return []
    from torch.distributed import distributed_c10d as c10d

    return [g for g in c10d._world.pg_map if g is not c10d._world.default_pg]


def _group_maker(timeout_minutes: float | None):
    timeout = None if timeout_minutes is None else datetime.timedelta(minutes=timeout_minutes)
    return lambda ranks: dist.new_group(ranks, timeout=timeout)


def _new_groups(groups: list[list[int]], rank: int, new_group):
    """Create all groups in the same order on every rank; return the one holding `rank` (None if size 1)."""
    mine = None
    for ranks in groups:
        if len(ranks) == 1:
            if rank in ranks:
                mine = None
            continue
        g = new_group(ranks)
        if rank in ranks:
            mine = g
    return mine


def _directional_groups(pipelines: list[list[int]], rank: int, new_group) -> dict:
    groups = {}
    for ranks in pipelines:
        p = len(ranks)
        pairs = {(ranks[i], ranks[(i + 1) % p]) for i in range(p)} if p > 1 else set()
        for a, b in sorted(pairs | {(b, a) for a, b in pairs}):
            g = new_group([a, b])
            if rank in (a, b):
                groups[(a, b)] = g
    return groups


def _pair_groups(pipelines: list[list[int]], rank: int, new_group) -> dict:
    groups = {}
    for ranks in pipelines:
        p = len(ranks)
        for s in range(p // 2):
            a, b = ranks[s], ranks[p - 1 - s]
            for pair in ((a, b), (b, a)):
                g = new_group(list(pair))
                if rank in pair:
                    groups[pair] = g
    return groups


def init_distributed(backend: str | None = None, timeout_minutes: float = 10.0) -> None:
    """Initialise torch.distributed from torchrun/SLURM-style environment variables.

    A timeout makes a dead rank fail the job instead of hanging it.
    """
    if dist.is_initialized():
        return
    env = os.environ
    env.update(slurm_environment(env))
    world = int(env.get("WORLD_SIZE", "1"))
    backend = choose_backend(backend)
    set_device(int(env.get("LOCAL_RANK", "0")), backend)
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if world == 1 and "MASTER_ADDR" not in env:  # one process: an in-memory store, no port to race for
        env.setdefault("RANK", "0")
        env.setdefault("WORLD_SIZE", "1")
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    dist.init_process_group(backend=backend, timeout=timeout)


def slurm_environment(env) -> dict[str, str]:
    """torch.distributed variables derived from SLURM's (srun, one task per GPU), for those not set already."""
    if "SLURM_PROCID" not in env:
        return {}
    out = {
        "RANK": env["SLURM_PROCID"],
        "WORLD_SIZE": env.get("SLURM_NTASKS", "1"),
        "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
        "MASTER_PORT": str(29500 + int(env.get("SLURM_JOB_ID", "0")) % 1000),
    }
    if "SLURM_JOB_NODELIST" in env:
        out["MASTER_ADDR"] = first_host(env["SLURM_JOB_NODELIST"])
    return {k: v for k, v in out.items() if k not in env}


def first_host(nodelist: str) -> str:
    """First host of a SLURM node list such as 'gpu[003-005,010],cpu01' -> 'gpu003'."""
    head = nodelist.split(",")[0] if "[" not in nodelist.split(",")[0] else nodelist[: nodelist.index("]") + 1]
    if "[" not in head:
        return head
    prefix, ranges = head.split("[", 1)
    first = ranges.rstrip("]").split(",")[0].split("-")[0]
    return prefix + first
