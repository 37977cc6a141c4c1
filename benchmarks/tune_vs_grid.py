"""`autoconfig.py tune` against an exhaustive measured grid on two ranks: does the loop find (nearly) the fastest
layout, with a fraction of the grid's trial time?

A small GPT (4 layers, hidden 128, 4 heads, sequence 128, vocabulary 1024, global batch 16) on 2 local gloo
ranks, one core each. The grid: every layout of tp2 / pp2 / dp2 x micro-batch size x recomputation x schedule,
ZeRO-1 and slicing that `tools/grid_search.py` can express (24 layouts), each measured in 3 interleaved rounds
(every layout once per round; a layout's time is its median over the rounds). Then `autoconfig.py tune` runs
from nothing (it profiles this machine itself) with its own budget. Its pick and the grid's fastest layouts are
measured again in 3 interleaved confirmation rounds, so the pick is judged against the grid's best on the same
spells of load. Reported: the pick against the best (target within 5%), Spearman(predicted, measured) over the
grid with tune's first profile and with its calibrated one (target >= 0.9), and tune's trial time against the
grid's (target at most a third).

Everything is kept in --out (default: $TMPDIR/megatron_bmw_tune_vs_grid); a second run resumes.

    python benchmarks/tune_vs_grid.py [--out DIR] [--trial-iters 12] [--warmup-iters 4] [--rounds 3] [--json F]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.args import UsageError, count, exit_on_usage_error, output_dirs, output_files, parser  # noqa: E402
from benchmarks.common import format_table, run_command  # noqa: E402

from megatron_bmw.trials.report import error_summary  # noqa: E402
from megatron_bmw.trials.results import load_results  # noqa: E402
from megatron_bmw.trials.specs import TrialModel  # noqa: E402

WORLD = 2
MODEL = ("--num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 --vocab-size 1024 "
         "--global-batch-size 16 --mock-data").split()
SWEEPS = [  # one results file per round; 24 layouts
    "--tensor-model-parallel-size 1,2 --micro-batch-size 1,2,4 --recompute-granularity none,full",
    "--pipeline-model-parallel-size 2 --micro-batch-size 1,4 --pipeline-schedule 1f1b,gpipe "
    "--recompute-granularity none,full",
    "--use-distributed-optimizer --micro-batch-size 1,4",
    "--pipeline-model-parallel-size 2 --microbatch-slicing 1 --micro-batch-size 2,4",
]


def _tool(name: str) -> list[str]:
    return [sys.executable, os.path.join(ROOT, "tools", name)]


def _run(cmd: list[str], what: str) -> str:
    return run_command(cmd, what, ROOT)


def grid_round(out: str, k: int, opts) -> str:
    results = os.path.join(out, f"grid_{k}.jsonl")
    for i, grid in enumerate(SWEEPS, 1):
        _run(_tool("grid_search.py") + ["--nproc-per-node", str(WORLD), *MODEL, *grid.split(), "--trial-iters",
                                        str(opts.trial_iters), "--warmup-iters", str(opts.warmup_iters),
                                        "--results", results, "--log-dir", os.path.join(out, "logs")],
             f"grid round {k}, sweep {i}/{len(SWEEPS)}")
    return results


def grid_medians(files: list[str]) -> dict[str, dict]:
    """Per layout: its record, with the median over the rounds it ran ok in."""
    out: dict[str, dict] = {}
    for path in files:
        for r in load_results(path):
            if r["status"] == "ok":
                entry = out.setdefault(r["id"], {**r, "rounds": []})
                entry["rounds"].append(r["median_iteration_s"])
    for r in out.values():
        r["median_iteration_s"] = statistics.median(r["rounds"])
    return out


def trial_seconds(files: list[str]) -> float:
    return sum(r.get("wall_s") or 0.0 for path in files for r in load_results(path) if r.get("status") != "running")


def confirm(out: str, candidates: dict[str, dict], opts) -> dict[str, list[float]]:
    """Each candidate (name -> record) once per round, interleaved; name -> its round medians."""
    times: dict[str, list[float]] = {}
    for k in range(1, opts.rounds + 1):
        results = os.path.join(out, f"confirm_{k}.jsonl")
        for name, r in candidates.items():
            what = ["--plans", r["plan_path"], "--mock-data"] if r.get("plan_path") else \
                ["--nproc-per-node", str(WORLD), *r["argv"]]
            _run(_tool("grid_search.py") + what + ["--trial-iters", str(opts.trial_iters), "--warmup-iters",
                                                  str(opts.warmup_iters), "--results", results, "--log-dir",
                                                  os.path.join(out, "logs")], f"confirm {k}: {name}")
        latest = {r["id"]: r for r in load_results(results)}
        for name, r in candidates.items():
            got = next((x for x in latest.values() if (x.get("plan_path") == r["plan_path"] if r.get("plan_path")
                                                        else x["id"] == r["id"])), None)
            if got and got["status"] == "ok":
                times.setdefault(name, []).append(got["median_iteration_s"])
    return times


@exit_on_usage_error
def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "megatron_bmw_tune_vs_grid"))
    ap.add_argument("--trial-iters", type=count(1), default=12)
    ap.add_argument("--warmup-iters", type=count(0), default=4)
    ap.add_argument("--rounds", type=count(1), default=3, help="grid and confirmation rounds; tune's --repeats")
    ap.add_argument("--top-k", type=count(1), default=3)
    ap.add_argument("--json", default=None)
    opts = ap.parse_args()
    if opts.warmup_iters >= opts.trial_iters:
        raise UsageError(f"--warmup-iters {opts.warmup_iters} leaves no measured iteration of --trial-iters "
                         f"{opts.trial_iters}")
    output_files(json=opts.json)
    output_dirs(out=opts.out)
    grid_files = [grid_round(opts.out, k, opts) for k in range(1, opts.rounds + 1)]
    grid = grid_medians(grid_files)
    tune_dir = os.path.join(opts.out, "tune")
    _run(_tool("autoconfig.py") + ["tune", "--nproc-per-node", str(WORLD), "--output-dir", tune_dir, *MODEL,
                                   "--trial-iters", str(opts.trial_iters), "--warmup-iters", str(opts.warmup_iters),
                                   "--repeats", str(opts.rounds), "--top-k", str(opts.top_k)], "autoconfig.py tune")
    with open(os.path.join(tune_dir, "plan.json")) as f:
        pick_plan = json.load(f)
    profiles = sorted((p for p in os.listdir(tune_dir) if p.startswith("profile_")),
                      key=lambda p: int(p.split("_")[1].split(".")[0]))
    before = TrialModel.from_paths("local", [os.path.join(tune_dir, profiles[0])])
    after = TrialModel.from_paths("local", [os.path.join(tune_dir, profiles[-1])])
    rows = list(grid.values())
    summaries = {}
    for tag, model in (("before", before), ("after", after)):
        pred = [model.predict(r)["iteration_time_s"] for r in rows]
        summaries[tag] = error_summary(pred, [r["median_iteration_s"] for r in rows])
    ranked = sorted(rows, key=lambda r: r["median_iteration_s"])
    candidates = {"tune's pick": {"id": "pick", "plan_path": os.path.join(tune_dir, "plan.json"), "plan": pick_plan}}
    for i, r in enumerate(ranked[:3], 1):
        candidates[f"grid #{i} {r['label']}"] = r
    confirmed = confirm(opts.out, candidates, opts)
    medians = {k: statistics.median(v) for k, v in confirmed.items() if v}
    best_name = min((k for k in medians if k != "tune's pick"), key=medians.get)
    pick_vs_best = medians["tune's pick"] / medians[best_name] - 1
    tune_s = trial_seconds([os.path.join(tune_dir, "trials.jsonl")])
    grid_s = trial_seconds(grid_files)
    print(format_table(["layout", "grid median s", "confirmed median s"],
                       [[k, f"{grid[c['id']]['median_iteration_s']:.4f}" if c["id"] in grid else "-",
                         f"{medians.get(k, float('nan')):.4f}"] for k, c in candidates.items()]))
    print(format_table(["", "median |error|", "Spearman", "pick vs best"],
                       [[tag, f"{100 * s['median_abs_error']:.1f}%", f"{s['spearman']:.3f}",
                         f"{100 * s['pick_vs_best']:+.1f}%"] for tag, s in summaries.items()]))
    print(f"grid: {len(rows)} layouts x {opts.rounds} rounds, {grid_s:.0f} s of trials; tune: {tune_s:.0f} s of "
          f"trials ({100 * tune_s / grid_s:.0f}% of the grid's)")
    print(f"tune's pick vs the best confirmed grid layout ({best_name}): {100 * pick_vs_best:+.1f}%")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"layouts": len(rows), "summaries": summaries, "pick_vs_best": pick_vs_best,
                       "tune_trial_s": tune_s, "grid_trial_s": grid_s, "confirmed": confirmed}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
