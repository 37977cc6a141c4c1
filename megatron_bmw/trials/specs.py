"""A trial as the planner sees it: its RunSpec and cluster, built as `autoconfig.py simulate` builds them from
the same flags (--cluster, --profile), and its predicted iteration time and memory. Torch-free."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from ..arguments import parse_args
from ..config.planner import PlannerConfig
from ..errors import UsageError
from .. import planner_args as cli
from ..planner.cluster import Cluster, load_cluster, local_cluster
from ..planner.cost_model import CostSettings
from ..planner.evaluate import simulate_run
from ..planner.memory_model import MemorySettings
from ..planner.plan import Plan
from ..planner.profile_data import Profile, Profiles
from ..planner.spec import RunSpec
from .grid import _resolve_vocab


class _QuietParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UsageError(message)


def _simulate_parser() -> argparse.ArgumentParser:
    """autoconfig.py simulate's flags, its errors raised."""
    p = _QuietParser(prog="autoconfig.py simulate", allow_abbrev=False, add_help=False)
    from ..arguments import add_megatron_args

    add_megatron_args(p)
    cli.add_planner_args(p, True)
    p.set_defaults(mock_data=True, vocab_size=50257)
    return p


@dataclass
class TrialModel:
    """How trials are predicted: the cluster (name or file), profiles, cost and memory settings."""

    cluster: str = "local"
    profiles: Profiles = field(default_factory=Profiles)
    costs: CostSettings = field(default_factory=CostSettings)
    memory: MemorySettings | None = None  # None: autoconfig.py's default for the cluster and profiles

    @classmethod
    def from_paths(cls, cluster: str, profile_paths: list[str], costs: CostSettings | None = None) -> TrialModel:
        """`costs` None: the defaults with the profiles' overlap factor (a calibrated profile's), as search has."""
        profiles = Profiles([Profile.load(p) for p in profile_paths])
        if costs is None:
            costs = CostSettings(overlap_factor=profiles.overlap_factor or CostSettings().overlap_factor)
        return cls(cluster, profiles, costs)

    def planner(self, world: int) -> PlannerConfig:
        return PlannerConfig(cluster=self.cluster, world_size=world)

    def cluster_for(self, world: int, profiles: Profiles | None = None) -> Cluster:
        profiles = self.profiles if profiles is None else profiles
        cluster = cli.cluster_from(self.planner(world), profiles, placeholder_ok=True)
        if cluster.num_gpus < world and self.cluster == "local":  # the analytic local machine, grown to the trial
            group = load_cluster("local").groups[0]
            cluster = local_cluster(world, group.device, group.intra_node, cores=group.cores_per_node)
        if cluster.num_gpus < world:
            raise UsageError(f"--cluster {self.cluster} has {cluster.num_gpus} GPUs, the trial runs on {world}")
        return cluster

    def memory_settings(self) -> MemorySettings:
        return self.memory or cli.memory_settings(self.planner(1), self.profiles, self.cluster_for(1))

    def spec(self, record: dict) -> RunSpec:
        """The RunSpec of a trial record (its plan, or its flags on its world size)."""
        if record.get("plan"):
            return Plan.from_json(record["plan"], f"plan of trial {record['id']}").spec
        world = int(record["world_size"])
        args = parse_args(record["argv"], _simulate_parser())
        _resolve_vocab(args)
        return cli.spec_from_flags(args, self.planner(world), self.cluster_for(world), self.profiles, self.costs)

    def predict(self, record: dict) -> dict:
        """{iteration_time_s, stages: [{peak_bytes, allowance_bytes, capacity_bytes}], fits}."""
        spec = self.spec(record)
        cluster = self.cluster_for(spec.world_size)
        ev = simulate_run(spec, cluster, self.profiles, self.costs, self.memory_settings(), memory_over_time=False)
        from ..planner.evaluate import stage_capacity

        stages = [{"peak_bytes": m.peak_bytes, "allowance_bytes": m.allowance_bytes,
                   "capacity_bytes": stage_capacity(spec, cluster, s)} for s, m in enumerate(ev.memory)]
        return {"iteration_time_s": ev.simulation.iteration_time, "stages": stages,
                "fits": all(s["peak_bytes"] <= s["capacity_bytes"] for s in stages)}


def planned_time(record: dict) -> float | None:
    """The iteration time a plan trial's plan file predicted."""
    plan = record.get("plan") or {}
    return (plan.get("prediction") or {}).get("iteration_time_s")
