"""CPU ranks that share cores (a cluster group with cores_per_node, e.g. gloo ranks on this machine): a rank gets
min(1, cores / ranks computing on its node) of a core. Each duration is split into CPU work (compute, the
bandwidth term of a collective) and waiting (a collective's latency, a peer's lag), and only the work stretches.
A profile entry for tp > 1 was itself measured with tp processes on the profiling machine's cores: its work is
the tp=1 time / tp (at the contention it was measured under), the rest of it is waiting (cost_model.py).
Statically (the solver's estimates) every rank of the node is taken as busy (`stage_sharing`);
`simulate_sharing_cores` then replays the schedule with processor sharing, each compute stretched by the mean of
max(1, busy ranks / cores) over its span on the timeline. GPU clusters (no cores_per_node) are unaffected.
"""

from __future__ import annotations

import bisect

from ..pipeline.schedule import Action
from .cluster import Cluster


def stage_sharing(cluster: Cluster, stage_gpus: list[list[int]]
                  ) -> tuple[list[dict[int, int]], dict[int, int], list[float]]:
    """Per stage {node: its ranks there}, cores per node, and per stage its static factor (every rank busy)."""
    stage_nodes, cores = [], {}
    for gpus in stage_gpus:
        count: dict[int, int] = {}
        for g in gpus:
            node, c = cluster.node_cores(g)
            count[node] = count.get(node, 0) + 1
            if c is not None:
                cores[node] = c
        stage_nodes.append(count)
    on_node = {n: sum(c.get(n, 0) for c in stage_nodes) for n in cores}
    static = [max([1.0] + [on_node[n] / cores[n] for n in c if n in cores]) for c in stage_nodes]
    return stage_nodes, cores, static


def sharing_factors(cost, computes: list[list[tuple[Action, float, float]]]) -> dict:
    """(`cost`: the run's CostModel.) Per (rank, action): the mean of max(1, busy ranks / cores) over the action's span on its node(s), the
    busy ranks counted from the timeline `computes` (each compute action's ranks, weighted by the share of its span
    they spend on the CPU at its current factor)."""
    current = cost.action_factors or {}
    per_node: dict[int, list[tuple[float, float]]] = {n: [] for n in cost.node_cores}
    for r, line in enumerate(computes):
        for action, start, end in line:
            if end <= start:
                continue
            share = cost.busy_share(r, action, current.get((r, action), cost.static_factor[r]))
            for node, count in cost.stage_nodes[r].items():
                if node in per_node:
                    per_node[node] += [(start, count * share), (end, -count * share)]
    integrals = {}
    for node, events in per_node.items():  # piecewise constant max(1, n / cores), and its running integral
        events.sort()
        times, acc, level, area, last = [], [], 0.0, 0.0, None
        for t, delta in events:
            if last is not None:
                area += max(1.0, level / cost.node_cores[node]) * (t - last)
            times.append(t)
            acc.append(area)
            level += delta
            last = t
        integrals[node] = (times, acc)

    def integral(node: int, t: float) -> float:
        """Integral of max(1, n / cores) from the first event to t (1 outside the events)."""
        times, acc = integrals[node]
        if not times or t <= times[0]:
            return t - (times[0] if times else 0.0)
        i = bisect.bisect_right(times, t) - 1
        if i + 1 >= len(times):
            return acc[-1] + (t - times[-1])
        span = times[i + 1] - times[i]
        return acc[i] + (0.0 if span <= 0 else (acc[i + 1] - acc[i]) * (t - times[i]) / span)

    out = {}
    for r, line in enumerate(computes):
        nodes = [n for n in cost.stage_nodes[r] if n in integrals]
        for action, start, end in line:
            if end <= start or not nodes:
                continue
            out[(r, action)] = max(max(1.0, (integral(n, end) - integral(n, start)) / (end - start)) for n in nodes)
    return out


def simulate_sharing_cores(cost, run, rounds: int = 4):
    """`run()` simulates with cost.compute_time; where ranks share cores, replay `rounds` more times, each
    compute stretched by its factor from the previous timeline (damped: the geometric mean with the previous
    factor). Returns the last simulation."""
    sim = run()
    if not cost.shares_cores or cost.work_split() is None:
        return sim
    for _ in range(rounds):
        new = sharing_factors(cost, sim.computes)
        old = cost.action_factors
        if old is not None:
            new = {k: (v * old.get(k, v)) ** 0.5 for k, v in new.items()}
        cost.action_factors = new
        sim = run()
    return sim
