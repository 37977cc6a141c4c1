"""tools/grid_search.py: run a grid of configurations (or planner plans) for real, resumably, and report them
against the planner's prediction.

    grid_search.py --nproc-per-node 4 --tensor-model-parallel-size 1,2 --micro-batch-size 1,2 <other flags>
    grid_search.py --nproc-per-node 4 --grid grid.yaml [flags for every trial]
    grid_search.py --plans plans/ plan_a.json [flags for every trial, e.g. --mock-data]
    grid_search.py --from-search --top-k 5 --cluster local --profile prof.json <model flags> --global-batch-size 64
Every flag grid_search.py does not know goes to pretrain_gpt.py (a comma list makes it an axis; see grid.py).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from ..errors import OneLineParser, UsageError, exit_on_usage_error
from .grid import Trial, expand, load_grid_file, load_plans, parse_flag_tokens
from .logparse import parse_log
from .report import plot, table
from .results import FINAL, Results
from .runner import REPO_ROOT, LaunchConfig, Runner


def build_parser() -> OneLineParser:
    p = OneLineParser(prog="grid_search.py", allow_abbrev=False,
                                description="Run configurations for real, resumably; compare with the planner.",
                                epilog="Any other flag is a pretrain_gpt.py flag; a comma list on it is a grid axis.")
    g = p.add_argument_group("what to run")
    g.add_argument("--grid", default=None, help="YAML grid file (sections: grid, flags)")
    g.add_argument("--plans", nargs="+", default=None, help="plan files or folders of them (autoconfig.py search)")
    g.add_argument("--from-search", action="store_true",
                   help="run autoconfig.py search on the model flags and run its --top-k plans")
    g.add_argument("--top-k", type=int, default=5, help="plans taken from the search")
    g.add_argument("--space", action="append", default=[], help="search space restriction (with --from-search)")
    g = p.add_argument_group("how to run")
    g.add_argument("--launcher", choices=["torchrun", "srun"], default="torchrun")
    g.add_argument("--nproc-per-node", type=int, default=None,
                   help="ranks per node (default: a plan's world size; required for a grid)")
    g.add_argument("--nnodes", type=int, default=1, help="nodes per trial (srun)")
    g.add_argument("--python", default=sys.executable, help="interpreter of the trials")
    g.add_argument("--script", default=None,
                   help="training script (default: python -m megatron_bmw.trials.entry, pretrain_gpt.py plus "
                        "per-rank memory lines)")
    g.add_argument("--srun-args", default="", help="extra srun arguments, one string")
    g.add_argument("--trial-iters", type=int, default=10, help="training iterations per trial")
    g.add_argument("--warmup-iters", type=int, default=3, help="first iterations left out of the median")
    g.add_argument("--trial-timeout", type=float, default=600.0, help="seconds before a trial counts as hung")
    g.add_argument("--kill-grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL")
    g.add_argument("--results", default="grid_results.jsonl", help="results JSONL (appended; resumable)")
    g.add_argument("--log-dir", default=None, help="trial logs (default: <results>_logs)")
    g.add_argument("--retry", default="", help="run again trials whose last status is one of these (e.g. hang,crash)")
    g.add_argument("--dry-run", action="store_true", help="list the trials and why some are skipped; run none")
    g.add_argument("--report-only", action="store_true", help="no trials: the report of the results file")
    g = p.add_argument_group("SLURM")
    g.add_argument("--sbatch", default=None, help="write an sbatch script running this sweep with srun, and stop")
    g.add_argument("--sbatch-time", default="04:00:00", help="the allocation's time limit")
    g.add_argument("--sbatch-option", action="append", default=[], help="extra #SBATCH line, e.g. --partition=gpu")
    g = p.add_argument_group("prediction")
    g.add_argument("--predict", action="store_true",
                   help="predict every trial with the planner (plans otherwise show their own prediction)")
    g.add_argument("--cluster", default="local", help="cluster of the prediction (and of --from-search)")
    g.add_argument("--profile", action="append", default=[], help="profile JSON(s) of the prediction")
    g.add_argument("--plot", default=None, help="predicted-vs-measured PNG (default: <results>.png)")
    return p


def _trials(opts, tokens: list[str]) -> list[Trial]:
    axes, fixed = load_grid_file(opts.grid) if opts.grid else ([], {})
    cli_axes, cli_fixed = parse_flag_tokens(tokens)
    axes += cli_axes
    fixed.update(cli_fixed)
    world = opts.nproc_per_node * opts.nnodes if opts.nproc_per_node else None
    plans = None
    if opts.from_search:
        from .plans import search_plans

        if opts.plans:
            raise UsageError("give --plans or --from-search, not both")
        folder = os.path.splitext(opts.results)[0] + "_plans"
        flags = Trial(flags=fixed, world_size=world or 1).argv()
        paths = search_plans(flags, opts.cluster, opts.profile, world, opts.top_k, opts.space, folder)
        print(f"search wrote {len(paths)} plans to {folder}", flush=True)
        plans = load_plans(paths)
    elif opts.plans:
        plans = load_plans(opts.plans)
    if plans is None and world is None:
        raise UsageError("give --nproc-per-node (ranks per trial) for a grid")
    return expand(axes, fixed, world, plans)


def _record(trial: Trial, status: str, **extra) -> dict:
    return {"id": trial.id, "status": status, "argv": trial.argv() if not trial.plan else trial.argv()[2:],
            "world_size": trial.world_size, "plan_path": trial.plan_path, "plan": trial.plan,
            "layout": trial.layout, "label": trial.label(), "time": time.strftime("%Y-%m-%d %H:%M:%S"), **extra}


def classify(outcome, summary, warmup: int, timeout_s: float) -> tuple[str, str | None]:
    """(status, reason) of a finished trial."""
    last = summary.iterations[-1]["iteration"] if summary.iterations else 0
    if outcome.timed_out:
        return "hang", f"still running after {timeout_s:g} s (last iteration logged: {last}); killed"
    if summary.oom:
        return "oom", summary.error or "out of memory"
    if summary.over_capacity:
        return "oom", f"measured peak above the device's capacity on stage(s) {summary.over_capacity}"
    if outcome.exit_code != 0:
        return "crash", summary.error or f"exit code {outcome.exit_code}"
    if not summary.iteration_times(warmup):
        return "crash", "exited 0 without any iteration line"
    return "ok", None


def run_trial(trial: Trial, runner: Runner, opts, results: Results, log_dir: str) -> dict:
    attempt = results.attempts.get(trial.id, 0) + 1
    log_path = os.path.join(log_dir, f"{trial.id}-{attempt}.log")
    results.append(_record(trial, "running", attempt=attempt, log=log_path))
    argv = trial.argv() + ["--train-iters", str(opts.trial_iters), "--log-interval", "1"]
    if "--eval-iters" not in trial.flags:
        argv += ["--eval-iters", "0"]  # no validation or test evaluation inside a timed trial
    outcome = runner.run(argv, log_path)
    with open(log_path, errors="replace") as f:
        summary = parse_log(f.read())
    status, reason = classify(outcome, summary, opts.warmup_iters, opts.trial_timeout)
    median = summary.median_iteration_s(opts.warmup_iters)
    lay = trial.layout
    tokens = lay["global_batch_size"] * lay["seq_length"] / median if median and lay else None
    record = _record(trial, status, reason=reason, attempt=attempt, log=log_path, exit_code=outcome.exit_code,
                     wall_s=round(outcome.wall_s, 3), launcher=runner.cfg.launcher, trial_iters=opts.trial_iters,
                     warmup_iters=opts.warmup_iters, iterations=len(summary.iterations),
                     iteration_times_s=[round(t, 6) for t in summary.iteration_times(0)],
                     median_iteration_s=median if status == "ok" else None,
                     min_iteration_s=min(summary.iteration_times(opts.warmup_iters), default=None),
                     tokens_per_s=tokens if status == "ok" else None,
                     samples_per_s=lay["global_batch_size"] / median if status == "ok" and median else None,
                     peak_memory_bytes=summary.peak_memory_bytes,
                     stage_memory={str(k): v for k, v in sorted(summary.stage_memory.items())},
                     plan_check=summary.plan_check, error=summary.error, log_tail=summary.tail[-8:])
    results.append(record)
    return record


def _saved_predictions(opts) -> str:
    """Where a sweep run with --predict keeps its predictions, for a later --report-only without it."""
    return os.path.splitext(opts.results)[0] + "_predictions.json"


def _predictions(opts, records: list[dict]) -> tuple[dict[str, float], list[str]]:
    from .specs import TrialModel, planned_time

    out, notes = {}, []
    model = TrialModel.from_paths(opts.cluster, opts.profile) if opts.predict else None
    saved = {}
    if model is None and os.path.isfile(_saved_predictions(opts)):
        with open(_saved_predictions(opts)) as f:
            saved = json.load(f)
    for r in records:
        if r.get("status") != "ok":
            continue
        if model is None:
            t = saved.get(r["id"]) or planned_time(r)
            if t:
                out[r["id"]] = t
            continue
        try:
            out[r["id"]] = model.predict(r)["iteration_time_s"]
        except UsageError as exc:
            notes.append(f"no prediction for {r['id']}: {exc}")
    if model is not None and out:
        tmp = _saved_predictions(opts) + ".tmp"
        with open(tmp, "w") as f:
            json.dump(out, f)
        os.replace(tmp, _saved_predictions(opts))
    return out, notes


def _report(opts, results: Results) -> None:
    records = [r for r in results.final_records()]
    if not records:
        print("no finished trials yet")
        return
    predictions, notes = _predictions(opts, records)
    print(table(records, predictions))
    for n in notes:
        print(n)
    if predictions:
        print(plot(records, predictions, opts.plot or os.path.splitext(opts.results)[0] + ".png"))


def _sbatch(opts, argv: list[str], trials: list[Trial]) -> None:
    from .sbatch import sbatch_script, write_sbatch

    drop = {"--sbatch": 1, "--sbatch-time": 1, "--sbatch-option": 1, "--launcher": 1, "--nnodes": 1}
    kept, i = [], 0
    while i < len(argv):
        flag = argv[i].split("=", 1)[0]
        if flag in drop:
            i += 1 + (drop[flag] if "=" not in argv[i] else 0)
            continue
        kept.append(argv[i])
        i += 1
    per_node = opts.nproc_per_node or max((t.world_size for t in trials), default=1)
    text = sbatch_script(opts.sbatch, kept, opts.nnodes, per_node, opts.sbatch_time, opts.results, opts.python,
                         opts.sbatch_option, os.getcwd(), os.path.join(REPO_ROOT, "tools", "grid_search.py"))
    write_sbatch(opts.sbatch, text)
    runnable = sum(1 for t in trials if not t.skip_reason)
    print(f"sbatch script for {runnable} trials written to {opts.sbatch}: submit it with sbatch {opts.sbatch}")


def _check(opts) -> None:
    for name in ("trial_iters", "top_k", "nnodes", "nproc_per_node"):
        if getattr(opts, name) is not None and getattr(opts, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(opts, name)}")
    if not opts.trial_timeout > 0:
        raise UsageError(f"--trial-timeout must be > 0 seconds, got {opts.trial_timeout:g}")
    if not opts.kill_grace >= 0:
        raise UsageError(f"--kill-grace must be >= 0 seconds, got {opts.kill_grace:g}")
    if opts.script is not None and not os.path.isfile(opts.script):
        raise UsageError(f"--script {opts.script}: no such file")
    if opts.plot is not None and os.path.isdir(opts.plot):
        raise UsageError(f"--plot {opts.plot}: is a directory, expected a PNG file name")
    if opts.report_only and not os.path.isfile(opts.results):
        raise UsageError(f"--results {opts.results}: no such file (nothing to report)")
    for flag, path in (("--plot", opts.plot), ("--results", opts.results), ("--log-dir", opts.log_dir)):
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder and not os.path.isdir(folder):  # created, as the other outputs' folders are
            try:
                os.makedirs(folder, exist_ok=True)
            except OSError as exc:
                raise UsageError(f"{flag} {path}: cannot create folder {folder} ({exc.strerror})") from None
    if opts.warmup_iters < 0:
        raise UsageError("--warmup-iters must be >= 0")
    if opts.warmup_iters >= opts.trial_iters:
        raise UsageError(f"--warmup-iters {opts.warmup_iters} leaves no measured iteration of --trial-iters "
                         f"{opts.trial_iters}")
    bad = [s for s in opts.retry.split(",") if s and s not in FINAL]
    if bad:
        raise UsageError(f"--retry: unknown status {bad[0]!r} (statuses: {', '.join(FINAL)})")
    if opts.launcher == "srun" and not opts.sbatch and not opts.dry_run and not opts.report_only \
            and "SLURM_JOB_ID" not in os.environ:
        raise UsageError("--launcher srun runs inside a SLURM allocation (sbatch/salloc); "
                         "use --sbatch FILE to write one for this sweep")


@exit_on_usage_error
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    opts, tokens = build_parser().parse_known_args(argv)
    _check(opts)
    results = Results(opts.results)
    if opts.report_only:
        _report(opts, results)
        return 0
    trials = _trials(opts, tokens)
    if opts.sbatch:
        _sbatch(opts, argv, trials)
        return 0
    retry = tuple(s for s in opts.retry.split(",") if s)
    todo = [t for t in trials if not results.done(t.id, retry)]
    print(f"{len(trials)} trials: {sum(1 for t in trials if t.skip_reason)} infeasible, "
          f"{len(trials) - len(todo)} already in {opts.results}, {len(todo)} to go", flush=True)
    if opts.dry_run:
        for t in trials:
            state = results.latest.get(t.id, {}).get("status", "to run")
            print(f"  {t.id} {t.label():<50} {'infeasible: ' + t.skip_reason if t.skip_reason else state}")
        return 0
    results.lock()
    log_dir = opts.log_dir or os.path.splitext(opts.results)[0] + "_logs"
    try:
        os.makedirs(log_dir, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--log-dir {log_dir}: cannot create it ({exc.strerror})") from None
    cfg = LaunchConfig(opts.launcher, opts.nproc_per_node or 1, opts.nnodes, opts.python, opts.script,
                       opts.trial_timeout, opts.kill_grace, tuple(opts.srun_args.split()))
    runner = Runner(cfg)

    def stop(signum, _frame):  # the sweep is stopped: take the running trial down with it
        runner.stop()
        print(f"sweep stopped by {signal.Signals(signum).name}; finished trials are kept in {opts.results}: run the "
              "same command again to resume", file=sys.stderr, flush=True)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    for n, trial in enumerate(todo, 1):
        head = f"[{n}/{len(todo)}] {trial.id} {trial.label()}"
        if trial.skip_reason:
            results.append(_record(trial, "infeasible", reason=trial.skip_reason))
            print(f"{head}: infeasible: {trial.skip_reason}", flush=True)
            continue
        if trial.world_size != cfg.world_size and trial.plan:
            runner.cfg = LaunchConfig(**{**cfg.__dict__, "nproc_per_node": trial.world_size // cfg.nnodes})
        rec = run_trial(trial, runner, opts, results, log_dir)
        runner.cfg = cfg
        what = (f"{rec['median_iteration_s']:.4f} s/iteration, {rec['tokens_per_s']:.0f} tokens/s"
                if rec["status"] == "ok" else rec["reason"])
        print(f"{head}: {rec['status']}: {what}", flush=True)
    _report(opts, results)
    return 0
