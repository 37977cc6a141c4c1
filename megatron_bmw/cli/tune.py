"""`autoconfig.py tune`: from a model to a measured best plan in one command, closing the planner's loop.

    profile (this machine, when no --profile is given)
    round k: search with the current profile -> its ranked plans; the contenders are its top-k and every plan
             predicted within the predictions' error of its pick (the closest rivals)
             a contender's micro-batch size the profile did not time (at its tp) is profiled first, and the
             search runs again on the extended profile (local cluster: the profile is of this machine)
             measure the contenders not yet measured (at most top-k a round) as short real trials (grid_search's
             runner: torchrun or srun, per-trial timeout, OOM/crash/hang recorded), in interleaved repeats
             (A B C A B C ...), the median over repeats, a trial repeated once more when its repeats spread too far
             calibrate the profile on every trial measured so far -> the next round's profile
    until every contender was measured already (the pick is stable, and no untried plan is predicted within the
    error of it), or --max-trials / --max-minutes is spent.

The pick is the measured fastest trial; its plan is written as <output-dir>/plan.json with the prediction of the
calibrated profile (the report's "pred now", which `pretrain_gpt.py --plan` checks against), with the report
(<output-dir>/report.txt and report.png: predicted, after calibration, against measured) and the calibrated
profile. Everything lives in --output-dir: a killed tune run again with the same command resumes (measured
repeats are kept in <output-dir>/trials.jsonl, as grid_search.py keeps its results; the profile tune measured,
with the micro-batch sizes it added, in <output-dir>/profile_0.json).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import statistics
import sys
import time
from dataclasses import dataclass, fields

from ..arguments import parse_args
from ..errors import OneLineParser, UsageError, exit_on_usage_error
from ..paths import check_output_dir
from ..planner.files import write_json
from ..planner_args import build_autoconfig_parser
from ..trials.cli import run_trial
from ..trials.grid import Trial, expand, load_plans, parse_flag_tokens
from ..trials.report import plot, table
from ..trials.results import FINAL, Results
from ..trials.runner import LaunchConfig, Runner
from .profile_commands import measure_micro_batches, profile_command, run_calibrate

ERROR_FLOOR = 0.12  # the least error a plan's prediction is given: the search's estimate margin (SearchSettings)


def build_parser() -> OneLineParser:
    p = OneLineParser(prog="autoconfig.py tune", allow_abbrev=False,
                      description="Profile, search, measure the top plans, calibrate, re-search; the measured best "
                                  "plan. Any other flag is a pretrain_gpt.py flag (model, --global-batch-size, data).")
    g = p.add_argument_group("the machine")
    g.add_argument("--nproc-per-node", type=int, required=True, help="ranks per node of every trial")
    g.add_argument("--nnodes", type=int, default=1)
    g.add_argument("--launcher", choices=["torchrun", "srun"], default="torchrun")
    g.add_argument("--cluster", default="local", help="the cluster the search plans for (built-in or YAML)")
    g.add_argument("--profile", action="append", default=[],
                   help="profile JSON(s) to start from (default: profile this machine first)")
    g.add_argument("--python", default=sys.executable, help="interpreter of the trials")
    g.add_argument("--script", default=None, help="training script of the trials (default: pretrain_gpt.py)")
    g = p.add_argument_group("the loop")
    g.add_argument("--top-k", type=int, default=3, help="plans measured per round")
    g.add_argument("--max-trials", type=int, default=12, help="plans measured in all")
    g.add_argument("--max-minutes", type=float, default=60.0,
                   help="wall-clock budget (checked before each trial; a trial started runs to its end)")
    g.add_argument("--max-rounds", type=int, default=5)
    g.add_argument("--space", action="append", default=[], help="search space restriction, as search takes it")
    g = p.add_argument_group("measuring")
    g.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every trial")
    g.add_argument("--max-spread", type=float, default=0.10,
                   help="a trial whose repeats spread more than this fraction of their median runs once more")
    g.add_argument("--trial-iters", type=int, default=10)
    g.add_argument("--warmup-iters", type=int, default=3, help="first iterations left out of a trial's median")
    g.add_argument("--trial-timeout", type=float, default=600.0, help="seconds before a trial counts as hung")
    g.add_argument("--kill-grace", type=float, default=10.0)
    g.add_argument("--output-dir", default="tune", help="plans, trials, profiles and the report (resumable)")
    return p


@dataclass
class Repeat(Trial):
    """One measurement of a trial: its own id in the results file, the trial's flags and plan."""

    repeat: int = 1

    @property
    def id(self) -> str:
        return f"{self.base_id}.{self.repeat}"

    @property
    def base_id(self) -> str:
        return Trial.id.fget(self)

    @classmethod
    def of(cls, trial: Trial, repeat: int) -> Repeat:
        return cls(**{f.name: getattr(trial, f.name) for f in fields(Trial)}, repeat=repeat)


def _check(opts) -> None:
    for name in ("nproc_per_node", "nnodes", "top_k", "max_trials", "max_rounds", "repeats", "trial_iters"):
        if getattr(opts, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(opts, name)}")
    if not opts.max_minutes > 0:
        raise UsageError(f"--max-minutes must be > 0, got {opts.max_minutes:g}")
    if not opts.max_spread > 0:
        raise UsageError(f"--max-spread must be > 0, got {opts.max_spread:g}")
    if not 0 <= opts.kill_grace < math.inf:
        raise UsageError(f"--kill-grace must be >= 0 seconds, got {opts.kill_grace:g}")
    if not 0 <= opts.warmup_iters < opts.trial_iters:
        raise UsageError(f"--warmup-iters {opts.warmup_iters} must be in [0, --trial-iters {opts.trial_iters})")
    if opts.script is not None and not os.path.isfile(opts.script):
        raise UsageError(f"--script {opts.script}: no such file")
    if opts.launcher == "srun" and "SLURM_JOB_ID" not in os.environ:
        raise UsageError("--launcher srun runs inside a SLURM allocation (sbatch/salloc)")


def predicted(t: Trial) -> float | None:
    """A trial's plan's predicted iteration time."""
    return (t.plan.get("prediction") or {}).get("iteration_time_s") if t.plan else None


def contenders(ranked: list[Trial], top_k: int, margin: float) -> list[Trial]:
    """The plans a round measures, best predicted first: the search's top k, and every plan beyond them whose
    prediction is within `margin` (the predictions' error) of the pick's: its closest rivals."""
    best = predicted(ranked[0]) if ranked else None
    rivals = [t for t in ranked[top_k:] if best and (predicted(t) or math.inf) <= best * (1 + margin)]
    return ranked[:top_k] + rivals


def aggregate(base: str, records: list[dict]) -> dict | None:
    """One trial's record from its repeats' records (None before any finished): the median over the ok repeats'
    medians, their spread (max - min over median); a failure of any repeat is the trial's status."""
    done = [r for r in records if r.get("status") in FINAL]
    if not done:
        return None
    bad = [r for r in done if r["status"] != "ok"]
    first = dict(bad[0] if bad else done[0])
    first.update(id=base, repeats=len(done))
    if bad:
        first.update(median_iteration_s=None, tokens_per_s=None, samples_per_s=None, spread=0.0)
        return first
    medians = [r["median_iteration_s"] for r in done]
    median = statistics.median(medians)
    lay = first.get("layout") or {}
    first.update(median_iteration_s=median, repeat_medians_s=medians, spread=(max(medians) - min(medians)) / median,
                 iteration_times_s=[t for r in done for t in r.get("iteration_times_s", [])],
                 peak_memory_bytes=max((r.get("peak_memory_bytes") or 0) for r in done) or None)
    if lay:
        first["tokens_per_s"] = lay["global_batch_size"] * lay["seq_length"] / median
        first["samples_per_s"] = lay["global_batch_size"] / median
    return first


class Tuner:
    def __init__(self, opts, tokens: list[str]) -> None:
        self.opts = opts
        axes, self.fixed = parse_flag_tokens(tokens)
        if axes:
            raise UsageError(f"{axes[0][0]}: tune searches the layout itself; give each flag one value")
        self.world = opts.nproc_per_node * opts.nnodes
        self.out = opts.output_dir
        check_output_dir("--output-dir", self.out)
        self._same_run(opts)
        self.results = Results(os.path.join(self.out, "trials.jsonl"), "--output-dir")
        self.trials: dict[str, Trial] = {}  # base id -> trial, in the order measured
        self.proposed: dict[str, tuple[int, float | None]] = {}  # base id -> (round, predicted time then)
        self.base: list[str] = []  # the profile(s) every calibration starts from (profile())
        self.start = time.monotonic()
        self.runner = Runner(LaunchConfig(opts.launcher, opts.nproc_per_node, opts.nnodes, opts.python, opts.script,
                                          opts.trial_timeout, opts.kill_grace))

    def _same_run(self, opts) -> None:
        """An --output-dir holds one tune: the same command resumes it; another model, batch, world, cluster or
        space is refused instead of mixing its trials and overwriting the plan and report (tune.json records
        what the folder's tune is of)."""
        path = os.path.join(self.out, "tune.json")
        mine = {"flags": self.search_flags(), "world_size": self.world, "cluster": opts.cluster,
                "space": list(opts.space)}
        if not os.path.isfile(path):
            write_json(path, mine, "--output-dir", "tune record")
            return
        try:
            with open(path) as f:
                theirs = json.load(f)
        except (OSError, ValueError):
            theirs = None
        if not isinstance(theirs, dict):
            raise UsageError(f"--output-dir {self.out}: tune.json is unreadable (edited by hand?); give another "
                             "--output-dir")
        if theirs != mine:
            key = next(k for k in (*mine, *theirs) if theirs.get(k) != mine.get(k))
            shown = " ".join(theirs[key]) if key == "flags" and isinstance(theirs.get(key), list) else theirs.get(key)
            raise UsageError(f"--output-dir {self.out} holds a tune of another run ({key}: {shown}); the same "
                             "command resumes it, another one needs another --output-dir")

    # -- pieces --------------------------------------------------------------------------------------------------
    def search_flags(self) -> list[str]:
        return Trial(flags=self.fixed, world_size=self.world).argv()

    def profile(self) -> list[str]:
        path = os.path.join(self.out, "profile_0.json")
        if self.opts.profile:
            given = [os.path.abspath(p) for p in self.opts.profile]
            if os.path.isfile(path) and _read_device(path).get("extends") == given:
                return [path]  # the given profile with the micro-batch sizes this tune added (extend())
            return list(self.opts.profile)
        if not os.path.isfile(path):
            if self.opts.cluster != "local":
                raise UsageError(f"--cluster {self.opts.cluster}: give --profile (a profile of its devices, "
                                 "autoconfig.py profile on one of them); tune profiles this machine only")
            print(f"[tune] no --profile: profiling this machine into {path}", flush=True)
            tps = ",".join(str(t) for t in (1, 2, 4, 8) if t <= self.world and self.world % t == 0)
            argv = ["profile", *self.search_flags(), "--profile-tp", tps, "--output", path]
            profile_command(parse_args(argv, build_autoconfig_parser()))
        return [path]

    def search(self, round_: int, profiles: list[str], top_k: int) -> list[Trial]:
        from ..trials.plans import search_plans

        folder = os.path.join(self.out, f"round_{round_}")
        paths = search_plans(self.search_flags(), self.opts.cluster, profiles, self.world, top_k,
                             self.opts.space, folder, progress=False)
        return [t for t in expand([], self.fixed, self.world, load_plans(paths))]

    def ranked(self, round_: int, profiles: list[str]) -> list[Trial]:
        """The search's plans, best predicted first, failed ones left out: enough of them that the top-k and the
        rivals beyond every plan measured so far are among them."""
        failed = self._failed()  # searched past: plans that failed are replaced by the next ones
        return [t for t in self.search(round_, profiles, self.opts.top_k + len(self.trials))
                if Trial.id.fget(t) not in failed]

    def margin(self, profiles: list[str]) -> float:
        """The error of the predictions: the median |predicted / measured - 1| of `profiles` over the trials
        measured so far (after calibration, the error left), never below ERROR_FLOOR."""
        from ..trials.specs import TrialModel

        ok = [m for b in self.trials if (m := self.measured(b)) and m["status"] == "ok"]
        if not ok:
            return ERROR_FLOOR
        model = TrialModel.from_paths(self.opts.cluster, profiles)
        errors = []
        for r in ok:
            try:
                errors.append(abs(model.predict(r)["iteration_time_s"] / r["median_iteration_s"] - 1))
            except UsageError:
                pass
        return max(ERROR_FLOOR, statistics.median(errors)) if errors else ERROR_FLOOR

    # -- micro-batch sizes the profile did not time ----------------------------------------------------------------
    def unprofiled(self, trials: list[Trial], profiles: list[str]) -> dict[int, set[int]]:
        """tp degree -> the micro-batch sizes `trials` run that the profile(s) did not time at it (their unit
        times would be interpolated or extrapolated): the trial's tp where the profile timed that tp, and tp 1
        (a tp > 1 unit on shared CPU cores, and a tp the profile lacks, are priced from it)."""
        from ..planner.profile_data import Profile

        profs = [Profile.load(p) for p in profiles]
        need: dict[int, set[int]] = {}
        for t in trials:
            lay = t.layout or {}
            if not lay or t.skip_reason or (t.plan or {}).get("parallel", {}).get("unit_strategies"):
                continue  # hybrid plans time units at their strategies' own sizes
            tp, b = lay["tp"], lay["micro_batch_size"]  # (a sliced half is priced as half the whole's time)
            for degree in sorted({1, tp}):
                timed = [{u.micro_batch_size for u in p.units if u.kind in ("attention", "mlp") and u.tp == degree
                          and u.recompute is None} for p in profs]
                if degree > 1 and not any(timed):
                    continue
                if any(b not in sizes for sizes in timed):
                    need.setdefault(degree, set()).add(b)
        return need

    def extend(self, need: dict[int, set[int]]) -> str | None:
        """Profile the micro-batch sizes `need` on this machine into the base profile (written as profile_0.json);
        None when done, else why it cannot be (the sizes stay interpolated or extrapolated)."""
        from ..planner.profile_data import Profile, model_signature
        from ..planner_args import configs_from_args

        if self.opts.cluster != "local":
            return f"--cluster {self.opts.cluster}: its devices are not this machine's"
        if len(self.base) != 1:
            return f"{len(self.base)} --profile files: tune extends one profile"
        base = Profile.load(self.base[0])
        args = parse_args(["profile", *self.search_flags(), "--output", "-"], build_autoconfig_parser())
        model = configs_from_args(args, 1).model
        if base.mode != "measured" or base.model != model_signature(model):
            return f"--profile {self.base[0]} is not a measured profile of this model"
        if base.calibration:
            return f"--profile {self.base[0]} is calibrated: its times are fitted, new timings would not be"
        what = ", ".join(f"{','.join(map(str, sorted(sizes)))} at tp {tp}" for tp, sizes in sorted(need.items()))
        print(f"[tune] profiling micro-batch sizes {what}: the plans to measure run them, the profile timed "
              "others", flush=True)
        started = time.monotonic()
        units = measure_micro_batches(args, base, need)
        fresh = {(u.kind, u.tp, u.micro_batch_size, u.unit, u.recompute) for u in units}
        base.units = [u for u in base.units if (u.kind, u.tp, u.micro_batch_size, u.unit, u.recompute)
                      not in fresh] + units
        if "extends" not in base.device and self.opts.profile:
            base.device = {**base.device, "extends": [os.path.abspath(p) for p in self.opts.profile]}
        path = os.path.join(self.out, "profile_0.json")
        base.save(path)
        self.base = [path]
        print(f"[tune] profiled in {time.monotonic() - started:.0f} s into {path}", flush=True)
        return None

    def measured(self, base: str) -> dict | None:
        reps = [self.results.latest[k] for k in self.results.latest if k.rsplit(".", 1)[0] == base]
        return aggregate(base, reps)

    def out_of_time(self) -> bool:
        return (time.monotonic() - self.start) / 60 > self.opts.max_minutes

    def out_of_budget(self) -> str | None:
        if self.out_of_time():
            return f"--max-minutes {self.opts.max_minutes:g} spent"
        if len(self.trials) >= self.opts.max_trials:
            return f"--max-trials {self.opts.max_trials} measured"
        return None

    def measure(self, trials: list[Trial]) -> None:
        """Interleaved repeats of `trials` (A B C A B C ...); one more repeat of a trial whose repeats spread more
        than --max-spread. Repeats measured already (an earlier, interrupted tune) are kept."""
        for r in range(1, self.opts.repeats + 1):
            for t in trials:
                self._run(t, r)
        for t in trials:
            m = self.measured(Trial.id.fget(t))
            if m and m["status"] == "ok" and m["spread"] > self.opts.max_spread and m["repeats"] <= self.opts.repeats:
                self._run(t, self.opts.repeats + 1)

    def _run(self, t: Trial, repeat: int) -> None:
        rep = Repeat.of(t, repeat)
        so_far = self.measured(rep.base_id)
        if self.results.done(rep.id) or (so_far is not None and so_far["status"] != "ok"):
            return  # measured already, or failed (OOM, crash, hang) once: no repeat of a failure
        if self.out_of_time():  # the loop stops at its next check; repeats not run are left for a resume
            return
        if t.skip_reason:
            rec = {"id": rep.id, "status": "infeasible", "reason": t.skip_reason, "plan": t.plan,
                   "plan_path": t.plan_path, "layout": t.layout, "world_size": t.world_size, "argv": t.argv()}
            self.results.append(rec)
        else:
            log_dir = os.path.join(self.out, "logs")
            os.makedirs(log_dir, exist_ok=True)
            rec = run_trial(rep, self.runner, self.opts, self.results, log_dir)
        what = f"{rec['median_iteration_s']:.4f} s/iteration" if rec["status"] == "ok" else rec.get("reason")
        print(f"[tune] {rep.base_id} {t.label()} (repeat {repeat}): {rec['status']}: {what}", flush=True)

    def write_measured(self) -> str:
        path = os.path.join(self.out, "measured.jsonl")
        rows = [m for b in self.trials if (m := self.measured(b)) is not None]
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        os.replace(tmp, path)
        return path

    def calibrate(self, round_: int, profiles: list[str]) -> list[str]:
        """The base profile fitted to every trial measured so far, as profile_<round>.json (from the base, not the
        last fit: a profile extended by new micro-batch sizes is fitted whole); `profiles` where it cannot be."""
        from ..planner.cost_model import CostSettings

        ok = [m for b in self.trials if (m := self.measured(b)) and m["status"] == "ok"]
        if len(ok) < 2:
            print(f"[tune] round {round_}: {len(ok)} trial(s) ran; calibration needs 2, the profile stays", flush=True)
            return profiles
        path = os.path.join(self.out, f"profile_{round_}.json")
        try:
            text = run_calibrate(self.write_measured(), self.opts.cluster, self.base, path, CostSettings())
        except UsageError as exc:
            print(f"[tune] round {round_}: calibration failed ({exc}); the profile stays", flush=True)
            return profiles
        print(text.splitlines()[-1] if text else "", flush=True)
        return [path]

    # -- the loop ---------------------------------------------------------------------------------------------
    def run(self) -> int:
        self.results.lock()
        try:
            return self._loop()
        finally:
            self.results.unlock()

    def _failed(self) -> set[str]:
        return {b for b in self.trials if (m := self.measured(b)) is not None and m["status"] != "ok"}

    def _contenders(self, round_: int, profiles: list[str]) -> tuple[list[Trial], list[str], float]:
        """The round's contenders on a profile that timed their micro-batch sizes (extended and searched again
        where it did not, as often as the new sizes bring others in), the profiles, the margin."""
        ranked = self.ranked(round_, profiles)
        margin = self.margin(profiles)
        for _ in range(4):  # each pass adds sizes; the space has few
            chosen = contenders(ranked, self.opts.top_k, margin)
            need = self.unprofiled(chosen, profiles)
            if not need:
                break
            why = self.extend(need)
            if why:
                sizes = sorted({b for bs in need.values() for b in bs})
                print(f"[tune] round {round_}: micro-batch size(s) {', '.join(map(str, sizes))} not profiled "
                      f"({why}): their unit times are interpolated or extrapolated", flush=True)
                break
            profiles = self.calibrate(round_ - 1, self.base) if round_ > 1 else list(self.base)
            ranked = self.ranked(round_, profiles)
            margin = self.margin(profiles)
        return contenders(ranked, self.opts.top_k, margin), profiles, margin

    def _loop(self) -> int:
        self.base = self.profile()
        profiles = list(self.base)
        why = None
        for round_ in range(1, self.opts.max_rounds + 1):
            proposed, profiles, margin = self._contenders(round_, profiles)
            for t in proposed:
                self.proposed.setdefault(Trial.id.fget(t), (round_, predicted(t)))
            new = [t for t in proposed if Trial.id.fget(t) not in self.trials]
            top = min(self.opts.top_k, len(proposed))
            if not new:
                why = (f"round {round_}: the search's top {top} were all measured, and no untried plan is predicted "
                       f"within {100 * margin:.1f}% (the predictions' error) of its pick (the pick is stable)")
                break
            budget = self.out_of_budget()
            if budget:
                why = budget
                break
            new = new[:min(self.opts.top_k, self.opts.max_trials - len(self.trials))]
            for t in new:
                self.trials[Trial.id.fget(t)] = t
            rivals = sum(1 for t in new if proposed.index(t) >= top)
            print(f"[tune] round {round_}: measuring {len(new)} plan(s): {len(new) - rivals} of the search's top "
                  f"{top}, {rivals} more predicted within {100 * margin:.1f}% (the predictions' error) of its pick",
                  flush=True)
            self.measure(new)
            self.write_measured()
            profiles = self.calibrate(round_, profiles)
        else:
            why = f"--max-rounds {self.opts.max_rounds} done"
        return self.finish(why, profiles)

    def finish(self, why: str, profiles: list[str]) -> int:
        from ..trials.specs import TrialModel

        rows = [m for b in self.trials if (m := self.measured(b)) is not None]
        ok = [r for r in rows if r["status"] == "ok"]
        print(f"[tune] stopped: {why}", flush=True)
        if not ok:
            raise UsageError(f"no trial ran ({', '.join(sorted({r['status'] for r in rows})) or 'none measured'}); "
                             f"see the logs in {os.path.join(self.out, 'logs')}")
        best = min(ok, key=lambda r: r["median_iteration_s"])
        plan_path = os.path.join(self.out, "plan.json")
        model = TrialModel.from_paths(self.opts.cluster, profiles)
        calibrated = self.write_plan(best, model, profiles, plan_path)
        predicted = {}
        for r in ok:
            try:
                predicted[r["id"]] = model.predict(r)["iteration_time_s"]
            except UsageError:
                pass
        lines = [table(rows, predicted), "",
                 f"{'trial':<12} {'round':>5} {'pred then':>10} {'pred now':>9} {'measured':>9} {'spread':>7}"]
        for r in rows:
            rnd, then = self.proposed.get(r["id"], (0, None))
            now = predicted.get(r["id"])
            shown = [f"{x:{w}.4f}" if x else f"{r['status'] if i == 2 else '-':>{w}}"
                     for i, (x, w) in enumerate(((then, 10), (now, 9), (r.get("median_iteration_s"), 9)))]
            lines.append(f"{r['id']:<12} {rnd:>5} {' '.join(shown)} {100 * r.get('spread', 0):6.1f}%")
        spreads = [r.get("spread", 0) for r in ok]
        lines.append(f"noise: repeats spread {100 * statistics.median(spreads):.1f}% (median), "
                     f"{100 * max(spreads):.1f}% (largest) over {len(ok)} trials")
        lines.append(f"pick: {best['id']} {best.get('label', '')}: {best['median_iteration_s']:.4f} s/iteration; "
                     f"plan written to {plan_path} ({calibrated}); profile {profiles[0]}")
        report = "\n".join(lines)
        with open(os.path.join(self.out, "report.txt"), "w") as f:
            f.write(report + "\n")
        print(report)
        print(plot(rows, predicted, os.path.join(self.out, "report.png")))
        return 0

    def write_plan(self, best: dict, model, profiles: list[str], path: str) -> str:
        """The pick's plan as plan.json, its prediction that of the calibrated profile (the report's "pred now",
        which the plan check of `pretrain_gpt.py --plan` compares the run with), where the plan the search wrote
        holds the prediction of the profile it was found on (round 1's: uncalibrated). What the prediction is."""
        from ..planner.evaluate import simulate_run
        from ..planner.plan import Plan
        from ..planner.report import evaluation_prediction

        try:
            plan = Plan.from_json(best["plan"], f"plan of trial {best['id']}")
            cluster = model.cluster_for(plan.spec.world_size)
            ev = simulate_run(plan.spec, cluster, model.profiles, model.costs, model.memory_settings(),
                              memory_over_time=False)
        except UsageError as exc:
            shutil.copyfile(best["plan_path"], path)
            return f"the search's prediction: the calibrated profile does not simulate it ({exc})"
        then = plan.prediction.get("iteration_time_s")
        plan.prediction = evaluation_prediction(ev, cluster, plan.spec)
        plan.profiles = model.profiles.identity()
        plan.search = {**plan.search, "tune": {
            "profile": profiles[0], "measured_s": best["median_iteration_s"], "predicted_when_searched_s": then,
            "trials": sum(1 for b in self.trials if (m := self.measured(b)) and m["status"] == "ok")}}
        plan.save(path)
        return f"predicted {plan.prediction['iteration_time_s']:.4f} s by the calibrated profile"


def _read_device(path: str) -> dict:
    """A profile file's device section, {} where it has none."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data.get("device") or {} if isinstance(data, dict) else {}


@exit_on_usage_error
def main(argv: list[str]) -> int:
    opts, tokens = build_parser().parse_known_args(argv)
    _check(opts)
    tuner = Tuner(opts, tokens)

    def stop(signum, _frame):
        tuner.runner.stop()
        print(f"[tune] stopped by signal {signum}; run the same command again to resume from "
              f"{tuner.out}", file=sys.stderr, flush=True)
        raise SystemExit(128 + signum)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return tuner.run()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
