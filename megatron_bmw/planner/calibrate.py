"""Calibrate the cost model on measured trials (`autoconfig.py calibrate --results results.jsonl`).

The free parameters, each a factor on what the profile (or the analytic model) says:
  unit time x            every unit's forward and backward time, and on top of it one factor per unit kind
                         (embedding, attention, MLP, head): what an achievable fraction per kind would do
  overhead x             the engine's per-action overhead, when the profile measured one
  link bandwidth x, link latency x   the profile's measured links (local cluster; other clusters take their
                         links from the cluster file, which calibrate leaves alone)
  overlap factor         slowdown of overlapped gradient reduction (only with --overlap-grad-reduce trials, dp > 1)
Fitted by least squares on log iteration time: Levenberg-Marquardt over the log of the factors with a
forward-difference Jacobian from the simulator (no scipy), errors beyond 10% counted linearly (Huber), and a pull
of every factor but the common one toward its start whose weight follows the noise a first free fit leaves
(exact trials are fitted exactly; noisy ones move a factor only as far as the trials agree on it). The memory
allowance (fixed workspace + fragmentation on top) is fitted by linear least squares of the measured CUDA memory
(device used, else reserved) against the memory model's peak without allowance.

The output is the profile with the factors applied (unit times, overhead, links), the fitted overlap factor and
memory allowance as the profile's own fields (`overlap_factor`, `memory_allowance`), which search, estimate and
simulate read unless a flag says otherwise, and a "calibration" section recording the fit, so
`search --profile calibrated.json` takes it as it is.
"""

from __future__ import annotations

import copy
import math
import statistics
from dataclasses import dataclass, field, replace

from ..errors import UsageError
from ..pipeline.build import build_schedule
from ..pipeline.replay import compile_schedule
from ..units import UNIT_KINDS
from .accuracy import error_summary
from .cluster import Cluster
from .cost_model import CostSettings
from .evaluate import simulate_run
from .memory_model import MemorySettings
from .profile_data import Profile, Profiles

KINDS = UNIT_KINDS
PRIOR = 0.5  # prior spread of a factor's log (factors within about 1.6x of the start); its weight grows with noise
HUBER = 0.1  # log errors beyond this (about 10%) count linearly
BOUNDS = {"overlap": (1.0, 4.0), "scale": (1e-4, 1e4)}  # the common factor may move a device type far
FACTOR_BOUNDS = (1e-2, 1e2)


@dataclass
class Params:
    """Factors on the base profile and cluster, and the overlap factor."""

    scale: float = 1.0  # every unit kind's time (free: no pull toward 1)
    time: dict[str, float] = field(default_factory=lambda: {k: 1.0 for k in KINDS})  # each kind's, on top
    overhead: float = 1.0
    bandwidth: float = 1.0
    latency: float = 1.0
    overlap: float = 1.3

    def get(self, name: str) -> float:
        return self.time[name[5:]] if name.startswith("time.") else getattr(self, name)

    def set(self, name: str, value: float) -> Params:
        out = copy.deepcopy(self)
        if name.startswith("time."):
            out.time[name[5:]] = value
        else:
            setattr(out, name, value)
        return out


def scaled_profile(base: Profile, p: Params) -> Profile:
    out = copy.deepcopy(base)
    for u in out.units:
        k = p.scale * p.time.get(u.kind, 1.0)
        u.forward_s, u.backward_s = u.forward_s * k, u.backward_s * k
    out.overhead = {key: v * p.overhead for key, v in out.overhead.items()}
    for link in out.links.values():
        link["bandwidth_Bps"] *= p.bandwidth
        link["latency_s"] *= p.latency
    return out


@dataclass
class Point:
    """One measured trial as the fit sees it."""

    id: str
    spec: object  # RunSpec
    schedule: object  # CompiledSchedule
    measured_s: float
    memory: dict  # stage -> measured memory entry


class Fit:
    """The trials, the base profile and cluster, and the objective over Params."""

    def __init__(self, points: list[Point], model, base: Profile, costs: CostSettings) -> None:
        """`model`: a trials.specs.TrialModel (cluster name, memory settings)."""
        self.points, self.model, self.base, self.costs = points, model, base, costs
        self.local = model.cluster == "local" and base.mode == "measured" and bool(base.links)
        self.memory = model.memory_settings()
        self._clusters: dict[int, Cluster] = {}  # base clusters by world size (not local: links are scaled)
        self.evaluations = 0
        self.pull = 1e-6  # weight of (log factor)^2 against the mean loss of the log errors

    def _cluster(self, world: int, prof: Profiles) -> Cluster:
        if self.local:  # built from the scaled profile's links
            return self.model.cluster_for(world, prof)
        if world not in self._clusters:
            self._clusters[world] = self.model.cluster_for(world, prof)
        return self._clusters[world]

    def predict(self, p: Params) -> list[float]:
        prof = Profiles([scaled_profile(self.base, p)])
        costs = replace(self.costs, overlap_factor=p.overlap)
        clusters: dict[int, Cluster] = {}
        out = []
        for pt in self.points:
            world = pt.spec.world_size
            if world not in clusters:
                clusters[world] = self._cluster(world, prof)
            ev = simulate_run(pt.spec, clusters[world], prof, costs, self.memory,
                              schedule=pt.schedule, memory_over_time=False)
            out.append(ev.simulation.iteration_time)
        self.evaluations += 1
        return out

    def residuals(self, p: Params, start: Params) -> list[float]:
        """Huber-transformed log errors (their squares sum to the Huber loss; one noisy trial cannot twist
        every factor), then the pull of each factor toward its start (not the common scale)."""
        pred = self.predict(p)
        n = len(pred)
        out = []
        for a, pt in zip(pred, self.points):
            e = math.log(a) - math.log(pt.measured_s)
            out.append(math.copysign(math.sqrt(2 * HUBER * abs(e) - HUBER ** 2), e) if abs(e) > HUBER else e)
        return [e / math.sqrt(n) for e in out] + \
            [math.sqrt(self.pull) * math.log(p.get(x) / start.get(x)) for x in self.free(start) if x != "scale"]

    def loss(self, p: Params, start: Params) -> float:
        return sum(r * r for r in self.residuals(p, start))

    def free(self, start: Params) -> list[str]:
        """The parameters the trials can see."""
        names = ["scale"] + [f"time.{k}" for k in KINDS]
        if any(self.base.overhead.values()):
            names.append("overhead")
        if self.local and any(pt.spec.world_size > 1 for pt in self.points):
            names += ["bandwidth", "latency"]  # only a local profile carries links; elsewhere the cluster file does
        if self._overlap_visible(start):
            names.append("overlap")
        return names

    def _overlap_visible(self, start: Params) -> bool:
        """Whether the overlap factor changes any prediction: only when some trial's gradient buckets are reduced
        while compute still runs (a small model has one bucket per rank, reduced after its last backward)."""
        if not any(pt.spec.overlap_grad_reduce and pt.spec.dp > 1 for pt in self.points):
            return False
        if not hasattr(self, "_visible"):
            self._visible = self.predict(replace(start, overlap=1.0)) != self.predict(replace(start, overlap=2.0))
        return self._visible


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (the small normal equations of the fit)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        pivot = max(range(c, n), key=lambda r: abs(m[r][c]))
        m[c], m[pivot] = m[pivot], m[c]
        if abs(m[c][c]) < 1e-300:
            continue
        for r in range(c + 1, n):
            f = m[r][c] / m[c][c]
            for k in range(c, n + 1):
                m[r][k] -= f * m[c][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][k] * x[k] for k in range(r + 1, n))) / m[r][r] if abs(m[r][r]) > 1e-300 else 0.0
    return x


def levenberg_marquardt(fit: Fit, start: Params, iterations: int = 40) -> Params:
    """Least squares on log time over the log of the free parameters: Levenberg-Marquardt with a forward-difference
    Jacobian (the simulator is piecewise linear in unit times, so the steps are damped), within bounds."""
    names = fit.free(start)
    lo = [math.log(BOUNDS.get(n, FACTOR_BOUNDS)[0]) for n in names]
    hi = [math.log(BOUNDS.get(n, FACTOR_BOUNDS)[1]) for n in names]
    x0 = [math.log(start.get(n)) for n in names]

    def params(x: list[float]) -> Params:
        p = start
        for n, v in zip(names, x):
            p = p.set(n, math.exp(v))
        return p

    def residuals(x: list[float]) -> list[float]:
        return fit.residuals(params(x), start)

    x, r = x0[:], residuals(x0)
    cost, lam, h = sum(v * v for v in r), 1e-2, 1e-4
    for _ in range(iterations):
        cols = []
        for k in range(len(x)):
            xk = x[:]
            xk[k] += h if xk[k] + h <= hi[k] else -h
            rk = residuals(xk)
            cols.append([(b - a) / (xk[k] - x[k]) for a, b in zip(r, rk)])
        jtj = [[sum(a * b for a, b in zip(ci, cj)) for cj in cols] for ci in cols]
        jtr = [sum(a * b for a, b in zip(ci, r)) for ci in cols]
        improved = False
        for _ in range(8):
            a = [[jtj[i][j] + (lam * jtj[i][i] + 1e-12 if i == j else 0.0) for j in range(len(x))] for i in range(len(x))]
            step = _solve(a, [-g for g in jtr])
            xn = [min(u, max(l_, v + d)) for v, d, l_, u in zip(x, step, lo, hi)]
            rn = residuals(xn)
            cn = sum(v * v for v in rn)
            if cn < cost:
                improved = cost - cn > 1e-12 * max(cost, 1e-30)
                x, r, cost, lam = xn, rn, cn, max(lam / 3, 1e-7)
                break
            lam *= 4
        if not improved:
            break
    return params(x)


def fit_params(fit: Fit, start: Params) -> Params:
    """Two passes: a nearly free fit tells the noise of the measurements (its residuals over the degrees of freedom
    left), which sets the pull toward the start for the final fit (MAP with a log-normal prior of spread PRIOR):
    exact trials are fitted exactly, noisy ones move the factors only as far as they agree."""
    first = levenberg_marquardt(fit, start, iterations=12)
    n, k = len(fit.points), len(fit.free(start))
    errors = fit.residuals(first, start)[:n]
    noise = sum(e * e for e in errors) * n / max(1, n - k)  # residuals are divided by sqrt(n)
    fit.pull = min(1.0, max(1e-8, noise / (n * PRIOR ** 2)))
    return levenberg_marquardt(fit, start)


# ---- memory allowance ------------------------------------------------------------------------------------------
def _measured_total(entry: dict) -> float | None:
    for key in ("device_used", "peak_reserved"):
        if entry.get(key):
            return float(entry[key])
    return None


def fit_allowance(points: list[Point]) -> tuple[float, float, int] | None:
    """(workspace bytes, fragmentation, samples) from CUDA measurements: measured = w + (1 + f) x model."""
    from .evaluate import estimate_memory

    xs, ys = [], []
    bare = MemorySettings(device="cuda")
    for pt in points:
        if not pt.memory:
            continue
        memory = estimate_memory(pt.spec, pt.schedule.schedule, bare)
        for stage, entry in pt.memory.items():
            total = _measured_total(entry)
            if total is not None and 0 <= int(stage) < len(memory):
                xs.append(memory[int(stage)].peak_bytes)
                ys.append(total)
    if not xs:
        return None
    n = len(xs)
    mx, my = statistics.mean(xs), statistics.mean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 1.0
    slope = max(1.0, slope)
    workspace = max(0.0, my - slope * mx)
    return workspace, slope - 1.0, n


# ---- the command ---------------------------------------------------------------------------------------------
def _points(records: list[dict], model) -> tuple[list[Point], list[str]]:
    points, notes = [], []
    for r in records:
        if r.get("status") != "ok" or not r.get("median_iteration_s"):
            continue
        try:
            spec = model.spec(r)
            schedule = compile_schedule(build_schedule(spec.pipeline, spec.pp))  # replayed at every step
            points.append(Point(r["id"], spec, schedule, float(r["median_iteration_s"]),
                                {k: v for k, v in (r.get("stage_memory") or {}).items() if int(k) >= 0}))
        except UsageError as exc:
            notes.append(f"trial {r['id']} left out: {exc}")
    return points, notes


def _base_profile(model, points: list[Point]) -> Profile:
    """The one profile given, else an analytic one for the cluster's device type."""
    types = model.profiles.by_type
    if len(types) > 1 or sum(len(v) for v in types.values()) > 1:
        raise UsageError("calibrate takes one --profile (one device type) at a time")
    if types:
        return next(iter(types.values()))[0]
    from .analytic import ProfileSettings, analytic_profile

    cluster = model.cluster_for(points[0].spec.world_size)
    devices = {g.device.name: g.device for g in cluster.groups}
    if len(devices) > 1:
        raise UsageError(f"calibrate without --profile needs a cluster of one device type ({cluster.name} has "
                         f"{', '.join(devices)})")
    device = next(iter(devices.values()))
    model_cfg = points[0].spec.model
    return analytic_profile(model_cfg, device, ProfileSettings(micro_batch_sizes=(1, 2, 4, 8)),
                            model.costs.fraction(device))


def calibrate(records: list[dict], model, costs: CostSettings = CostSettings()) -> dict:
    """Fit; returns {params, start, base, before, after, allowance, points, notes}."""
    points, notes = _points(records, model)
    if len(points) < 2:
        raise UsageError(f"calibrate needs at least 2 measured (ok) trials, the results have {len(points)}")
    base = _base_profile(model, points)
    model.profiles = Profiles([base])
    fit = Fit(points, model, base, costs)
    start = Params(overlap=costs.overlap_factor)
    before = fit.predict(start)
    params = fit_params(fit, start)
    after = fit.predict(params)
    measured = [pt.measured_s for pt in points]
    return {"params": params, "start": start, "base": base, "points": points, "notes": notes, "fit": fit,
            "before": error_summary(before, measured), "after": error_summary(after, measured),
            "predicted_before": before, "predicted_after": after, "allowance": fit_allowance(points)}


def calibrated_profile_json(out: dict, results_path: str) -> dict:
    p, fit = out["params"], out["fit"]
    prof = scaled_profile(out["base"], p)
    prof.overlap_factor = p.overlap
    if out["allowance"]:
        prof.memory_workspace_bytes, prof.memory_fragmentation = out["allowance"][0], out["allowance"][1]
    data = prof.to_json()
    if prof.mode == "analytic":
        data["device"] = {**data["device"], "calibrated": True}
    flags = [f"--overlap-factor {p.overlap:.3g}"]
    allowance = out["allowance"]
    if allowance:
        flags += [f"--memory-workspace-gb {allowance[0] / 2**30:.3g}", f"--memory-fragmentation {allowance[1]:.3g}"]
    data["calibration"] = {
        "results": results_path, "trials": len(out["points"]),
        "time_factors": {k: p.scale * v for k, v in p.time.items()}, "overhead_factor": p.overhead,
        "link_bandwidth_factor": p.bandwidth, "link_latency_factor": p.latency,
        "links": "fitted on the profile's links (local cluster)" if fit.local else "from the cluster file, not fitted",
        "overlap_factor": p.overlap,
        "memory_workspace_bytes": allowance[0] if allowance else None,
        "memory_fragmentation": allowance[1] if allowance else None,
        "before": _summary_json(out["before"]), "after": _summary_json(out["after"]),
        "search_flags": " ".join(flags),
    }
    return data


def _summary_json(s: dict) -> dict:
    return {k: s[k] for k in ("n", "median_abs_error", "spearman", "pick_vs_best") if k in s}


def calibration_table(out: dict) -> str:
    p, s, fit = out["params"], out["start"], out["fit"]
    free = set(fit.free(s))
    rows = [("unit time x (all)", s.scale, p.scale, "scale")]
    rows += [(f"{k} time x", s.time[k], p.time[k], f"time.{k}") for k in KINDS]
    rows += [("overhead x", s.overhead, p.overhead, "overhead"), ("link bandwidth x", s.bandwidth, p.bandwidth,
             "bandwidth"), ("link latency x", s.latency, p.latency, "latency"),
             ("overlap factor", s.overlap, p.overlap, "overlap")]
    lines = [f"calibrated on {len(out['points'])} trials ({fit.evaluations} evaluations of the model)",
             f"{'parameter':<22} {'before':>8} {'after':>8}"]
    for label, a, b, name in rows:
        lines.append(f"{label:<22} {a:8.3f} {b:8.3f}" + ("" if name in free else "   (not seen by these trials)"))
    allowance = out["allowance"]
    if allowance:
        lines.append(f"{'memory workspace GiB':<22} {'-':>8} {allowance[0] / 2**30:8.3f}   ({allowance[2]} stage samples)")
        lines.append(f"{'memory fragmentation':<22} {'-':>8} {allowance[1]:8.3f}")
    else:
        lines.append("memory allowance: no CUDA memory measurements in the results; unchanged")
    b, a = out["before"], out["after"]
    lines.append(f"{'median |error|':<22} {100 * b['median_abs_error']:7.1f}% {100 * a['median_abs_error']:7.1f}%")
    lines.append(f"{'Spearman':<22} {b['spearman']:8.3f} {a['spearman']:8.3f}")
    lines.append(f"{'pick vs best':<22} {100 * b['pick_vs_best']:7.1f}% {100 * a['pick_vs_best']:7.1f}%")
    lines += out["notes"]
    return "\n".join(lines)
