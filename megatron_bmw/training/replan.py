"""--plan auto: the run's plan searched at start-up for the world it finds, so a run restarted on fewer (or more)
ranks re-plans and continues from its torch_dist checkpoint. The global batch, the LR schedule and the data order
come from the flags and do not change with the layout: only the speed does.

Every rank checks the search's inputs (profile, cluster, space) before the process group exists, so bad input is
one line and exit code 2 as for any flag. Then rank 0 searches and broadcasts the plan as JSON bytes (no pickle;
over a gloo group of its own, whose timeout leaves the search time where --distributed-timeout-minutes may not);
a search that fails (no layout fits this world) is broadcast as its one line instead, and every rank stops with
code 2. Rank 0 prints the plan in one block, beside the plan the checkpoint ran (`--load`/latest_plan.json) where
there is one, and writes it to `--save`/latest_plan.json.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import re
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config.planner import PlannerConfig, PlanRequest
from ..errors import Reported, UsageError, say
from ..parallel.state import init_distributed
from ..paths import check_output_dir
from ..planner.cluster import Cluster, load_cluster
from ..planner.cost_model import CostSettings
from ..planner.engine import EngineConfig
from ..planner.files import read_json
from ..planner.memory_model import MemorySettings
from ..planner.plan import Plan
from ..planner.profile_data import Profiles
from ..planner.report import plan_from
from ..planner.search import SearchSettings, search
from ..planner.space import SearchSpace
from ..planner_args import cluster_from, cost_settings, engine_of, load_profiles, memory_settings
from .plan_summary import plan_block

PLAN_FILE = "latest_plan.json"  # beside the checkpoint: the plan the run that saved it ran
MAX_DOUBLINGS = 10  # a world that fits nothing: how far up (x 2**k) to look for one that does
SEARCH_WAIT_MIN = 30.0  # how long the other ranks wait for rank 0's search
_ERROR, _FAILED = "error:", "failed:"


@dataclass(frozen=True)
class SearchInputs:
    """What the search runs on, read and checked on every rank before the process group exists."""

    request: PlanRequest
    planner: PlannerConfig
    profiles: Profiles
    cluster: Cluster  # sized for the request's world
    engine: EngineConfig
    space: SearchSpace
    memory: MemorySettings
    costs: CostSettings


def cluster_for(planner: PlannerConfig, profiles: Profiles, world: int) -> Cluster:
    """The cluster holding `world` ranks: the local one sized to them, a described one resized if it is one group of
    nodes."""
    if planner.cluster == "local":
        return cluster_from(PlannerConfig(cluster="local", world_size=world), profiles)
    cluster = load_cluster(planner.cluster)
    if cluster.num_gpus >= world:
        return cluster
    if len(cluster.groups) == 1:
        return cluster.with_nodes(math.ceil(world / cluster.groups[0].gpus_per_node))
    raise UsageError(f"--plan-cluster {planner.cluster}: {cluster.num_gpus} GPUs in node groups of several kinds, the "
                     f"run has {world} ranks (describe the cluster it runs on)")


def search_inputs(request: PlanRequest) -> SearchInputs:
    """The profile, cluster, space and settings of `request`, read and checked (a UsageError names the flag)."""
    auto = request.auto
    planner = PlannerConfig(cluster=auto.plan_cluster or "local", world_size=request.world_size,
                            profile=[auto.plan_profile] if auto.plan_profile else [])
    try:
        check_output_dir("--save", request.save)
        if request.save is not None and request.ckpt_format != "torch_dist":
            raise UsageError(f"--plan auto saves a checkpoint any layout loads: add --ckpt-format torch_dist (got "
                             f"{request.ckpt_format})")
        profiles = load_profiles(planner.profile)
        engine = engine_of(planner, request.gradient_accumulation_fusion)
        space = SearchSpace.parse(auto.plan_space).for_engine(engine.name)
        cluster = cluster_for(planner, profiles, request.world_size)
        return SearchInputs(request, planner, profiles, cluster, engine, space,
                            memory_settings(planner, profiles, cluster, engine),
                            cost_settings(planner, profiles, model_of=lambda: request.model, engine=engine))
    except UsageError as exc:
        raise UsageError(_our_flags(str(exc))) from None


def _our_flags(text: str) -> str:
    """The planner's own flag names in a message (autoconfig.py's) as pretrain_gpt.py spells them."""
    return re.sub(r"--(profile|cluster|space)\b(?!-)", r"--plan-\1", text)


def search_plan(inputs: SearchInputs, world: int) -> Plan | None:
    """The search's best plan for `world` ranks; None where no layout of the space fits."""
    r = inputs.request
    cluster = cluster_for(inputs.planner, inputs.profiles, world)
    result = search(r.model, r.orig_vocab_size, r.make_vocab_size_divisible_by, r.global_batch_size, cluster,
                    inputs.profiles, inputs.space, inputs.costs, inputs.memory,
                    SearchSettings(world_size=world, top_k=1))
    if result.best is None:
        return None
    return plan_from(result.best, result, inputs.profiles, r.orig_vocab_size, inputs.engine)


def plan_or_refusal(inputs: SearchInputs) -> Plan:
    """The plan for the request's world; a UsageError where nothing fits, saying how many GPUs would do (the
    first of 2, 4, ... times this world where a layout fits)."""
    world = inputs.request.world_size
    try:
        plan = search_plan(inputs, world)
    except UsageError as exc:
        raise UsageError(f"--plan auto: {_our_flags(str(exc))}") from None
    if plan is not None:
        return plan
    where, tried = f"cluster {inputs.cluster.name}", world
    for k in range(1, MAX_DOUBLINGS + 1):
        try:
            bigger = search_plan(inputs, world << k)
        except UsageError:  # no layout of that many ranks (the batch or the space is too small for it)
            break
        tried = world << k
        if bigger is not None:
            s = bigger.spec
            raise UsageError(f"--plan auto: the model does not fit on {_ranks(world)} of {where}; it needs "
                             f"{tried} GPUs (tp {s.tp} x pp {s.pp} x dp {s.dp} fits on {tried}; nothing fits on "
                             f"{tried >> 1})")
    raise UsageError(f"--plan auto: the model does not fit on {_ranks(world)} of {where}"
                     + (f", nor on up to {tried}" if tried > world else "")
                     + " (a smaller --global-batch-size or model, or relax --plan-space)")


def _ranks(n: int) -> str:
    return f"{n} rank" + ("s" if n != 1 else "")


def agreed_plan(request: PlanRequest) -> Plan:
    """--plan auto's plan on every rank: searched by rank 0, broadcast as JSON; printed and written beside the
    checkpoint by rank 0. Joins the process group (the inputs are checked before)."""
    inputs = search_inputs(request)
    init_distributed(request.distributed_backend, request.distributed_timeout_minutes)
    rank = dist.get_rank()
    started = time.monotonic()
    # the others wait for rank 0's search (a minute at a thousand GPUs) longer than a collective may take
    wait = datetime.timedelta(minutes=max(request.distributed_timeout_minutes, SEARCH_WAIT_MIN))
    group = dist.new_group(backend="gloo", timeout=wait)
    text, failure = "", None
    if rank == 0:
        try:
            text = json.dumps(plan_or_refusal(inputs).to_json())
        except UsageError as exc:
            text = f"{_ERROR}{exc}"
        except Exception as exc:  # noqa: BLE001 - a bug: the others stop, rank 0 raises it with its traceback
            text, failure = f"{_FAILED}{type(exc).__name__}", exc
    try:
        text = broadcast_text(text, group)
    finally:
        dist.destroy_process_group(group)
    if failure is not None:
        raise failure
    if text.startswith((_ERROR, _FAILED)):
        if rank == 0:
            say(text[len(_ERROR):])
        raise Reported(UsageError.exit_code if text.startswith(_ERROR) else 1)
    plan = Plan.from_json(json.loads(text), "--plan auto")
    if rank == 0:
        _report(inputs, plan, time.monotonic() - started)
    return plan


def _report(inputs: SearchInputs, plan: Plan, seconds: float) -> None:
    """Rank 0: the plan beside the checkpoint's, printed in one block; written to --save."""
    r = inputs.request
    old_path = os.path.join(r.load, PLAN_FILE) if r.load else None
    old, note = previous_plan(old_path)
    written = None
    if r.save is not None:
        written = os.path.join(r.save, PLAN_FILE)
        plan.save(written)
    times = "analytic unit times" if not inputs.profiles else f"profile {r.auto.plan_profile}"
    head = (f"> --plan auto: searched {_ranks(r.world_size)} of cluster {inputs.cluster.name} ({times}) in "
            f"{seconds:.2f} s" + (f"; written to {written}" if written else ""))
    print("\n".join([head, *([f"> {note}"] if note else []), *plan_block(plan, old, old_path)]), flush=True)


def previous_plan(path: str | None) -> tuple[Plan | None, str | None]:
    """The plan written beside the checkpoint (None where there is none), and a note when it cannot be read (the
    run goes on: it is only compared with)."""
    if path is None or not os.path.exists(path):
        return None, None if path is None else f"no earlier plan at {path}"
    try:
        return Plan.from_json(read_json(path, "--load", "plan"), path), None
    except UsageError as exc:
        return None, f"WARNING: the earlier plan is unreadable, not compared ({exc})"


def broadcast_text(text: str, group=None, src: int = 0) -> str:
    """`text` of rank `src` on every rank of the gloo `group`: its length, then its UTF-8 bytes as a uint8 tensor
    (no pickle)."""
    mine = dist.get_rank() == src
    data = text.encode() if mine else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, src, group=group)
    n = int(size.item())
    if n == 0:
        return ""
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if mine else torch.empty(n, dtype=torch.uint8)
    dist.broadcast(buf, src, group=group)
    return buf.numpy().tobytes().decode()
