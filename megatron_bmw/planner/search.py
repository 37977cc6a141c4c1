"""The planner's search: the fastest plan that fits, from the model, the cluster and the global batch.

1. Layouts: every (tp, pp, dp, micro-batch size, schedule, virtual stages) of the space (space.py); tensor
   parallelism stays inside a node (AMP's placement: tp innermost, then dp, then pp).
2. Each layout is solved (solver.py): partition and per-unit recomputation under every rank's memory, and an
   estimate; with tensor parallelism, with and without sequence parallelism (its collectives cost what the
   all-reduces cost, and its smaller hidden state crosses pipeline stages faster); with data parallelism, with
   and without ZeRO-1 (its gather costs time, its sharded optimizer step saves some). Layouts are taken in the
   order of a lower bound on their estimate and skipped once that bound is beyond the best estimate by more
   than the estimate's error margin. BPipe is tried only where the layout without it does not fit without
   recomputation: by the cost model its transfers only add time and buy memory. Every layout ends solved,
   pruned by its bound, or infeasible (memory proven short); no clock decides anything, so the same inputs give
   the same plan whatever the machine's load.
3. Finalists (the best estimates) are simulated exactly on the schedule that would run (simulator + exact
   memory model); their partitions are refined by AutoPipe's heuristic and a local search on the simulator,
   and AutoPipe's slicer decides micro-batch slicing. Ranked by simulated iteration time.
Zero-bubble schedules (space.zero_bubble) are layouts like any other: solved with their own estimate and
holding, simulated exactly among the finalists, so one is kept only where it wins under the memory limit; they
get no BPipe, slicing or per-unit strategies (what the runtime refuses).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field, replace

from ..config import ModelConfig, padded_vocab_size
from ..errors import UsageError
from ..pipeline.build import build_schedule
from ..pipeline.generators import TIMED
from ..pipeline.zb_search import HANDCRAFTED
from ..pipeline.schedule import gc_paused
from ..pipeline.slicing import choose_slices
from .cluster import Cluster
from .cost_model import CostSettings
from .evaluate import Evaluation, compiled_for, simulate_run, stage_capacity
from .flops import unit_forward_flops
from .hybrid_search import HybridProblem, HybridSolution, hybrid_layouts, summarize
from .memory_model import MemorySettings
from .partitioners import autopipe_refine, hill_climb
from .profile_data import Profiles
from .schedule_shapes import ScheduleShapes
from .solver import LayoutProblem, Solution, Variant, could_fit, lower_bound
from .space import Layout, SearchSpace, layouts, tp_degrees, zero_bubble
from .spec import RunSpec
from ..units import unit_kind_of, unit_names

_INF = math.inf


@dataclass(frozen=True)
class SearchSettings:
    world_size: int | None = None  # GPUs used (default: the whole cluster)
    top_k: int = 5
    estimate_margin: float = 0.12  # layouts whose bound is within this of the best estimate are solved
    finalists: int = 12  # simulated exactly (at least 2 x top_k)
    refine_evals: int = 48  # simulations per refined finalist
    refine_top: int = 4  # finalists whose partitions are refined: the fastest ones ...
    refine_margin: float = 0.05  # ... within this of the fastest
    progress: bool = False


@dataclass
class Ranked:
    """One simulated plan."""

    spec: RunSpec
    evaluation: Evaluation
    estimate: float
    fits: bool
    notes: list[str] = field(default_factory=list)
    gains: dict = field(default_factory=dict)  # what slicing / BPipe / memory savers bought (seconds)

    @property
    def time(self) -> float:
        return self.evaluation.simulation.iteration_time


@dataclass
class SearchResult:
    ranked: list[Ranked]
    stats: dict
    model: ModelConfig
    global_batch_size: int
    cluster: Cluster
    make_vocab_size_divisible_by: int = 128

    @property
    def best(self) -> Ranked | None:
        return self.ranked[0] if self.ranked else None


def padded_model(model: ModelConfig, orig_vocab: int, divisible_by: int, tp: int) -> ModelConfig:
    return replace(model, vocab_size=padded_vocab_size(orig_vocab, divisible_by, tp))


def model_flops(model: ModelConfig, samples: int) -> float:
    """Forward and backward FLOPs of `samples` sequences (no recomputation): 3 x the forward's matrix FLOPs."""
    names = unit_names(model.num_layers)
    return 3.0 * samples * sum(unit_forward_flops(unit_kind_of(model, n), model, 1) for n in names)


class _Progress:
    def __init__(self, enabled: bool, total: int) -> None:
        self.enabled, self.total, self.done, self.last = enabled, total, 0, 0.0

    def step(self, text: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        now = time.time()
        if now - self.last < 0.2 and self.done < self.total:
            return
        self.last = now
        width = 30
        filled = int(width * self.done / max(self.total, 1))
        sys.stderr.write(f"\r[search] [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} candidates "
                         f"{text}"[:120])
        sys.stderr.flush()
        if self.done >= self.total:
            sys.stderr.write("\n")


def search(model: ModelConfig, orig_vocab: int, divisible_by: int, global_batch: int, cluster: Cluster,
           profiles: Profiles | None = None, space: SearchSpace = SearchSpace(),
           costs: CostSettings = CostSettings(), memory: MemorySettings = MemorySettings(),
           settings: SearchSettings = SearchSettings()) -> SearchResult:
    """Search `space` for the fastest plan of `model` (vocabulary `orig_vocab`, padded per tp) that fits.
    The cyclic garbage collector pauses meanwhile: the search makes millions of small acyclic objects, and the
    collections they trigger walk its memo tables again and again."""
    with gc_paused():
        return _search(model, orig_vocab, divisible_by, global_batch, cluster, profiles, space, costs, memory,
                       settings)


def _search(model: ModelConfig, orig_vocab: int, divisible_by: int, global_batch: int, cluster: Cluster,
            profiles: Profiles | None, space: SearchSpace, costs: CostSettings, memory: MemorySettings,
            settings: SearchSettings) -> SearchResult:
    started = time.time()
    run = _Run(model, orig_vocab, divisible_by, cluster, profiles or Profiles(), space, costs, memory, settings)
    world, todo = _uniform_layouts(run, global_batch)
    # layouts = solved + pruned + infeasible; candidates (a layout with its options: SP, ZeRO-1, recomputation
    # mode, BPipe) likewise add up, their "solved" counting those the solver ran
    stats = run.stats
    stats.update({"layouts": len(todo), "solved": 0, "pruned": 0, "infeasible": 0, "candidates": 0,
                  "candidates_solved": 0, "candidates_pruned": 0, "candidates_infeasible": 0, "simulated": 0})
    if "uniform" not in space.strategy:
        todo = []
    outcome: dict[tuple, str] = {}  # layout -> "solved", "pruned" or "infeasible"
    problems = _uniform_candidates(run, todo, outcome)
    if "hybrid" in space.strategy:  # Galvatron-BMW: tp 1 at the top, every unit its own strategy per stage
        hybrid, layouts_hybrid = _hybrid_candidates(run, world, global_batch, outcome)
        problems += hybrid
        stats["layouts"] = len(todo) + layouts_hybrid
    problems.sort(key=lambda x: x[0])  # stable: ties keep the order they were made in
    solutions = _solve_in_bound_order(run, problems, outcome)
    for state in outcome.values():
        stats[state] += 1
    stats["estimate_s"] = time.time() - started  # reported only: no clock decides anything
    profiled = run.profiles.largest_micro_batch()
    if profiled is not None:
        stats["profiled_micro_batch"] = profiled
    if not solutions:
        return SearchResult([], stats, model, global_batch, cluster, divisible_by)
    ranked = _rank_finalists(run, solutions)
    stats["elapsed_s"] = time.time() - started
    return SearchResult(ranked[:max(settings.top_k, 1)], stats, model, global_batch, cluster, divisible_by)


@dataclass
class _Run:
    """What the steps of one search read: its inputs, the tables its layouts share, and its counts."""

    model: ModelConfig
    orig_vocab: int
    divisible_by: int
    cluster: Cluster
    profiles: Profiles
    space: SearchSpace
    costs: CostSettings
    memory: MemorySettings
    settings: SearchSettings
    shapes: ScheduleShapes = field(default_factory=ScheduleShapes)
    stats: dict = field(default_factory=dict)


def _uniform_layouts(run: _Run, global_batch: int) -> tuple[int, list[Layout]]:
    """The GPUs used and the space's layouts (degrees, micro-batching, schedule); a UsageError where none is."""
    model, cluster, space = run.model, run.cluster, run.space
    world = run.settings.world_size or cluster.num_gpus
    if world < 1 or world > cluster.num_gpus:
        raise UsageError(f"--world-size {world}: cluster {cluster.name} has {cluster.num_gpus} GPUs")
    if global_batch < 1:
        raise UsageError(f"--global-batch-size must be >= 1, got {global_batch}")
    node = min(g.gpus_per_node for g in cluster.groups)
    tps = [t for t in tp_degrees(model, node, world)
           if padded_model(model, run.orig_vocab, run.divisible_by, t).vocab_size % t == 0]
    todo = layouts(space, model, world, global_batch, tps)
    if not todo and "uniform" in space.strategy:
        raise UsageError("the search space holds no layout: check --space, --global-batch-size and the world size")
    return world, todo


def _uniform_candidates(run: _Run, todo: list[Layout], outcome: dict) -> list[tuple[float, LayoutProblem]]:
    """Each layout with each recomputation mode, SP and ZeRO-1 choice that could fit, with its lower bound."""
    space, stats = run.space, run.stats
    uniform_modes: list = [False] if space.per_unit_recompute else list(space.recompute)
    bpipe = space.bpipe == (True,)
    problems = []
    for lay in todo:
        outcome[("uniform", lay)] = "infeasible"
    for lay in todo:
        split = zero_bubble(lay.schedule)  # refused with BPipe
        if split and bpipe and lay.pp >= 4:
            continue
        for mode in uniform_modes:
            for sp in (s for s in space.sp if (not s and (lay.tp == 1 or run.model.moe is None))
                       or (s and lay.tp > 1 and seq_splits(run.model, lay))):  # MoE under tp: with SP only
                for zero1 in (z for z in space.zero1 if not z or lay.dp * lay.cp > 1):
                    base = Variant(sp, zero1, bpipe and lay.pp >= 4)
                    prob = _problem(lay, base, run.model, run.orig_vocab, run.divisible_by, run.cluster,
                                    run.profiles, space, run.costs, run.memory, run.shapes, mode)
                    stats["candidates"] += 1
                    if prob is not None:
                        problems.append((lower_bound(prob), prob))
                    else:
                        stats["candidates_infeasible"] += 1
    return problems


def seq_splits(model: ModelConfig, lay: Layout) -> bool:
    """Whether sequence parallelism splits the rank's s/cp tokens over tp (a context-parallel layout's condition;
    at cp 1 the run's own check applies)."""
    return lay.cp == 1 or (model.seq_length // lay.cp) % lay.tp == 0


def _hybrid_candidates(run: _Run, world: int, global_batch: int,
                       outcome: dict) -> tuple[list[tuple[float, HybridProblem]], int]:
    """Galvatron-BMW's layouts that could fit, with their lower bounds; and how many hybrid layouts there are."""
    model, space, stats = run.model, run.space, run.stats
    if model.moe is not None and "uniform" not in space.strategy:
        raise UsageError("--space strategy=hybrid: per-unit strategies are not planned for MoE models")
    if model.moe is not None:
        return [], 0
    if model.model_type != "gpt" and "uniform" not in space.strategy:
        raise UsageError("--space strategy=hybrid: per-unit strategies run GPT models only")
    hybrid = hybrid_layouts(space, model, world, global_batch) if model.model_type == "gpt" else []
    if not hybrid and "uniform" not in space.strategy:
        raise UsageError("the search space holds no hybrid layout: check --space and --global-batch-size")
    got = _hybrid_problems(hybrid, model, run.orig_vocab, run.divisible_by, run.cluster, run.profiles, space,
                           run.costs, run.memory, run.shapes)
    for lay in hybrid:
        outcome[("hybrid", lay)] = "infeasible"
    stats["candidates"] += len(hybrid)
    stats["candidates_infeasible"] += len(hybrid) - len(got)
    return got, len(hybrid)


def _solve_in_bound_order(run: _Run, problems: list[tuple[float, LayoutProblem | HybridProblem]],
                          outcome: dict) -> list[Solution]:
    """Solve the candidates by their lower bounds, skipping those the k-th best estimate or a smaller micro-batch
    rules out."""
    settings, stats = run.settings, run.stats
    progress = _Progress(settings.progress, stats["candidates"])  # counts candidates, as the summary does
    progress.done = stats["candidates_infeasible"]
    solutions: list[Solution] = []
    best = kth_best = _INF
    estimates: list[float] = []
    too_big: dict[tuple, int] = {}  # family -> the smallest micro-batch size that fits nowhere
    for bound, prob in problems:
        lay = prob.layout
        key = ("hybrid" if isinstance(prob, HybridProblem) else "uniform", lay)
        family = (lay.tp, lay.cp, lay.pp, lay.dp, lay.schedule, lay.virtual_stages, prob.variant.sp, prob.variant.zero1,
                  prob.uniform, lay.ep, lay.etp)
        if lay.micro_batch_size >= too_big.get(family, _INF):  # more micro-batches per rank only need more memory
            stats["candidates_infeasible"] += 1
            progress.step(f"best {best:.4g} s")
            continue
        if bound > kth_best * (1 + settings.estimate_margin):  # against the k-th best: --top-k plans
            stats["candidates_pruned"] += 1
            if outcome[key] == "infeasible":
                outcome[key] = "pruned"
            progress.step(f"best {best:.4g} s")
            continue
        found = _solve_candidate(run, prob, progress)
        if not found:
            too_big[family] = min(too_big.get(family, _INF), lay.micro_batch_size)
        else:
            outcome[key] = "solved"
        for sol in found:
            solutions.append(sol)
            best = min(best, sol.estimate)
            estimates.append(sol.estimate)
        if len(estimates) >= settings.top_k:
            kth_best = sorted(estimates)[settings.top_k - 1]
        progress.step(f"best {best:.4g} s")
    return solutions


def _solve_candidate(run: _Run, prob: LayoutProblem | HybridProblem, progress: _Progress) -> list[Solution]:
    """A hybrid candidate's solution, or a uniform one's with those of its memory savers (made and counted here)."""
    stats = run.stats
    if isinstance(prob, HybridProblem):
        got = prob.solve()
        stats["candidates_solved"] += 1
        return [got] if got is not None else []
    made = stats["candidates"]
    found = _solve_with_savers(prob, run.space, run.model, run.orig_vocab, run.divisible_by, run.cluster,
                               run.profiles, run.costs, run.memory, run.shapes, stats)
    progress.total += stats["candidates"] - made  # BPipe variants: made and solved here
    progress.done += stats["candidates"] - made
    return found


def _rank_finalists(run: _Run, solutions: list[Solution]) -> list[Ranked]:
    """The best estimates simulated exactly (the fastest refined), else the next solutions until one fits; ranked."""
    settings, space = run.settings, run.space
    cluster, profiles, costs, memory, stats = run.cluster, run.profiles, run.costs, run.memory, run.stats
    solutions.sort(key=lambda s: s.estimate)
    count = max(settings.finalists, 2 * settings.top_k)
    finalists = [s for s in solutions if s.estimate <= solutions[0].estimate * (1 + settings.estimate_margin)][:count]
    if len(finalists) < settings.top_k:
        finalists = solutions[:max(settings.top_k, len(finalists))]
    by_key = {(s.layout, s.variant): s for s in solutions if not isinstance(s, HybridSolution)}
    sims, starts = [], []
    for sol in finalists:  # one simulation each
        sims.append(_Simulator(sol.problem, cluster, profiles, costs, memory, stats))
        starts.append(sims[-1].time(tuple(sol.partition)))
    first = min(starts)
    order = sorted(range(len(finalists)), key=lambda i: starts[i])
    refine = set(order[:settings.refine_top]) if first < _INF else set()
    ranked = []
    for i, (sol, sim) in enumerate(zip(finalists, sims)):
        refined = i in refine and starts[i] <= first * (1 + settings.refine_margin)
        got = _finalist(sol, sim, space, settings, by_key, refined)
        if got is not None:
            ranked.append(got)
    if not ranked:  # the estimates' memory was too hopeful everywhere: the next solutions, until one fits
        for sol in solutions[len(finalists):]:
            got = _finalist(sol, _Simulator(sol.problem, cluster, profiles, costs, memory, stats), space, settings,
                            by_key, False)
            if got is not None:
                ranked.append(got)
                break
    ranked.sort(key=lambda r: r.time)
    return ranked


def _hybrid_problems(hybrid: list[Layout], model, orig_vocab, divisible_by, cluster, profiles, space, costs, memory,
                     shapes) -> list[tuple[float, HybridProblem]]:
    out = []
    for lay in hybrid:
        wide = padded_model(model, orig_vocab, divisible_by, lay.dp)  # every unit's tp degree divides it
        prob = HybridProblem(lay, wide, cluster, profiles, space, costs, memory, shapes)
        if prob.strategies and prob.could_fit():
            out.append((prob.lower_bound(), prob))
    return out


def _problem(lay: Layout, variant: Variant, model, orig_vocab, divisible_by, cluster, profiles, space, costs, memory,
             shapes, mode) -> LayoutProblem | None:
    tp_model = padded_model(model, orig_vocab, divisible_by, lay.tp)
    prob = LayoutProblem(lay, variant, tp_model, cluster, profiles, space, costs, memory, shapes, mode)
    if not could_fit(prob, variant.zero1):
        return None
    return prob


def _variants(space: SearchSpace, base: Variant, pp: int, split: bool = False) -> list[Variant]:
    """BPipe where it applies (it moves something from 4 stages on; not with split backwards)."""
    return [Variant(base.sp, base.zero1, True)] if True in space.bpipe and pp >= 4 and not base.bpipe \
        and not split else []


def _solve_with_savers(prob: LayoutProblem, space, model, orig_vocab, divisible_by, cluster, profiles, costs, memory,
                       shapes, stats) -> list[Solution]:
    """The layout's solution, and those with memory savers when it needs recomputation or does not fit."""
    out = []
    sol = prob.solve()
    stats["candidates_solved"] += 1
    if sol is not None:
        out.append(sol)
    if sol is not None and sol.recomputed == 0:
        return out
    lay = prob.layout
    for variant in _variants(space, prob.variant, lay.pp, zero_bubble(lay.schedule)):
        other = _problem(lay, variant, model, orig_vocab, divisible_by, cluster, profiles, space, costs, memory,
                         shapes, prob.uniform)
        stats["candidates"] += 1
        if other is None:
            stats["candidates_infeasible"] += 1
            continue
        got = other.solve()
        stats["candidates_solved"] += 1
        if got is not None:
            out.append(got)
            if got.recomputed == 0:
                break
    return out


class _Simulator:
    """Exact scoring of one finalist's partitions: per-rank recomputation from the solver, then the simulator on
    the schedule that would run and the exact memory model."""

    def __init__(self, prob: LayoutProblem, cluster, profiles, costs, memory, stats) -> None:
        self.prob, self.cluster, self.profiles, self.costs, self.memory, self.stats = (prob, cluster, profiles,
                                                                                       costs, memory, stats)
        self.cache: dict[tuple, tuple[Solution | None, Evaluation | None]] = {}
        self.compiled: dict[int, object] = {}

    def run(self, partition: tuple[int, ...], slicing: int = 0, exact: bool = False):
        """The partition's solution and evaluation. ZB-1p/ZB-2p are searched for each partition's stage times only
        when `exact` (the finalist's last simulation); the partitions tried before it are timed on the handcrafted
        order of the same memory (zb_search.HANDCRAFTED: ZB-H1, ZB-H2), never faster than the searched one, compiled once."""
        key = (tuple(partition), slicing, exact)
        if key in self.cache:
            return self.cache[key]
        sol = self.prob.evaluate(tuple(partition))
        ev = None
        if sol is not None:
            spec = sol.spec(self.prob.model, slicing)
            timed = spec.pipeline.schedule in TIMED and exact  # searched for this partition's times (simulate_run)
            if slicing not in self.compiled and not timed:
                pipe = spec.pipeline
                if pipe.schedule in TIMED:
                    pipe = replace(pipe, schedule=HANDCRAFTED[pipe.schedule])
                self.compiled[slicing] = compiled_for(build_schedule(pipe, spec.pp), self.costs.engine)
            ev = simulate_run(spec, self.cluster, self.profiles, self.costs, self.memory,
                              schedule=None if timed else self.compiled[slicing], memory_over_time=False)
            self.stats["simulated"] += 1
        self.cache[key] = (sol, ev)
        return sol, ev

    def run_solution(self, sol: Solution) -> Evaluation | None:
        """Simulate a given solution of the problem (a hybrid plan other than the partition's DP pick)."""
        key = (sol.partition, getattr(sol, "strategies", None), sol.recompute)
        if key not in self.cache:
            spec = sol.spec(self.prob.model)
            timed = spec.pipeline.schedule in TIMED
            if 0 not in self.compiled and not timed:
                self.compiled[0] = compiled_for(build_schedule(spec.pipeline, spec.pp), self.costs.engine)
            self.cache[key] = (sol, simulate_run(spec, self.cluster, self.profiles, self.costs, self.memory,
                                                 schedule=None if timed else self.compiled[0],
                                                 memory_over_time=False))
            self.stats["simulated"] += 1
        return self.cache[key][1]

    def time(self, partition, slicing: int = 0) -> float:
        sol, ev = self.run(partition, slicing)
        if ev is None or not _fits(ev, self.cluster):
            return _INF
        return ev.simulation.iteration_time


def _fits(ev: Evaluation, cluster: Cluster) -> bool:
    return all(m.peak_bytes <= stage_capacity(ev.spec, cluster, s) for s, m in enumerate(ev.memory))


def _finalist(sol: Solution, sim: _Simulator, space: SearchSpace, settings: SearchSettings, by_key,
              refine: bool) -> Ranked | None:
    """Simulate a finalist exactly; when `refine`, polish its partition with AutoPipe's heuristic and the local
    search on the simulator first; then let AutoPipe's slicer decide micro-batch slicing."""
    prob = sol.problem
    part = tuple(sol.partition)
    start_time = sim.time(part)
    budget = settings.refine_evals if refine else 0
    if sol.layout.virtual_stages == 1 and sol.layout.pp > 1 and space.sublayer and budget > 0:
        def evaluate(p):
            t = sim.time(tuple(p))
            if t == _INF:
                return _INF, 0, [0.0] * len(p), [0.0] * len(p)
            ev = sim.run(tuple(p))[1]
            fwd = [sum(x) for x in ev.cost.chunk_forward]
            bwd = [sum(x) for x in ev.cost.chunk_backward]
            return t, ev.simulation.master_stage, fwd, bwd

        unit_costs = [sum(prob.times[0][i][0]) for i in range(len(prob.names))]
        part, _ = autopipe_refine(list(part), evaluate, unit_costs, max_evals=budget // 2)
        part = tuple(part)
    if budget > 0 and sol.layout.pp > 1 and space.sublayer:
        part, _ = hill_climb(list(part), lambda p: sim.time(tuple(p)), max_evals=budget)
        part = tuple(part)
    best_sol, ev = sim.run(part, exact=True)
    if isinstance(sol, HybridSolution):  # the layout's single-strategy plans, simulated beside the DP's mix
        for other in prob.single_strategy(part):
            got = sim.run_solution(other)
            if got is not None and _fits(got, sim.cluster) and (
                    ev is None or not _fits(ev, sim.cluster)
                    or got.simulation.iteration_time < ev.simulation.iteration_time):
                best_sol, ev = other, got
    if ev is None or not _fits(ev, sim.cluster):
        return None
    notes, gains = [], {}
    if start_time > ev.simulation.iteration_time:
        gains["refinement_s"] = start_time - ev.simulation.iteration_time
    lay = sol.layout
    if isinstance(best_sol, HybridSolution):
        notes.append(summarize(best_sol.strategies))
    elif True in space.slicing and lay.pp > 1 and lay.micro_batch_size % 2 == 0 and lay.schedule != "gpipe" \
            and not zero_bubble(lay.schedule):
        fwd = [sum(x) for x in ev.cost.chunk_forward]
        bwd = [sum(x) for x in ev.cost.chunk_backward]
        k = choose_slices(fwd, bwd, prob.p2p, lay.num_microbatches)
        if k:
            try:
                sliced = sim.time(part, k)
            except UsageError:  # BPipe cannot hold that many halves
                sliced = _INF
            if sliced < ev.simulation.iteration_time:
                gains["slicing_s"] = ev.simulation.iteration_time - sliced
                best_sol, ev = sim.run(part, k)
    plain = Variant(sol.variant.sp, sol.variant.zero1)
    if sol.variant.bpipe and (lay, plain) in by_key:
        gains["bpipe_s"] = by_key[(lay, plain)].estimate - best_sol.estimate
    elif sol.variant.bpipe:
        notes.append("does not fit without BPipe")
    if best_sol.recomputed:
        kinds = {}
        for i, c in enumerate(best_sol.recompute):
            if c:
                kinds[c] = kinds.get(c, 0) + 1
        notes.append("recompute " + ", ".join(f"{n} {c}" for c, n in sorted(kinds.items())))
    profiled = sim.stats.get("profiled_micro_batch")
    if profiled and lay.micro_batch_size > profiled:
        notes.append(f"mbs {lay.micro_batch_size} extrapolated (profiled up to {profiled})")
    return Ranked(ev.spec, ev, sol.estimate, True, notes, gains)


__all__ = ["Ranked", "SearchResult", "SearchSettings", "model_flops", "padded_model", "search"]
