"""The planner's pick for a small mixture of experts against a hand grid of expert layouts, measured on 4 gloo ranks.

A small MoE GPT (4 layers, hidden 128, 4 heads, sequence 256, vocabulary 1024, 8 experts of FFN 512, top-2,
global batch 8). `autoconfig.py profile` measures this machine (tp 1, 2, 4; its MoE unit at ep 1), `autoconfig.py
search` on that profile plans it once per dispatcher (the dispatcher is a model flag, not a search dimension: the
planner's pick is the faster predicted of the two plans). A hand grid of tp x pp x ep layouts with either
dispatcher (micro-batch size 2, SP under tp, etp 1: the experts keep their biases) and both plans run with `pretrain_gpt.py` (via
`tools/grid_search.py`), every configuration once per round, in interleaved rounds (the machine is shared; the
order turns each round): per configuration the median over rounds of each run's median iteration time after
warm-up. Reported: predicted (the same profile, `autoconfig.py simulate`'s model) against measured per
configuration, the median |error|, Spearman(predicted, measured) over the grid, and the pick's measured time
against the grid's best.

    python benchmarks/moe_planner_vs_grid.py [--out DIR] [--rounds 3] [--trial-iters 8] [--warmup-iters 3]
        [--json out.json]

Everything is kept in --out (default: $TMPDIR/megatron_bmw_moe_planner_vs_grid): a second run reuses the profile
and the plans and resumes the rounds.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.args import UsageError, count, exit_on_usage_error, output_dirs, output_files, parser  # noqa: E402
from benchmarks.common import format_table, median, run_command  # noqa: E402
from benchmarks.stats import spearman  # noqa: E402

WORLD = 4
MODEL = ("--num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 256 --max-position-embeddings 256 "
         "--vocab-size 1024 --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 512 --global-batch-size 8 "
         "--mock-data").split()
DISPATCHERS = ("alltoall", "allgather")
MBS = 2
# (tp, pp, ep, dispatcher): each ep dividing the stage's tp x dp ranks and the 8 experts
GRID = [(1, 1, 1, "alltoall"), (1, 1, 2, "alltoall"), (1, 1, 4, "alltoall"), (2, 1, 2, "alltoall"),
        (2, 1, 4, "alltoall"), (4, 1, 4, "alltoall"), (1, 2, 2, "alltoall"), (1, 4, 1, "alltoall"),
        (1, 1, 2, "allgather"), (1, 1, 4, "allgather"), (2, 1, 2, "allgather"), (4, 1, 4, "allgather"),
        (1, 2, 2, "allgather")]


def _tool(name: str) -> list[str]:
    return [sys.executable, os.path.join(ROOT, "tools", name)]


def _run(cmd: list[str], what: str) -> str:
    return run_command(cmd, what, ROOT)


def grid_flags(tp: int, pp: int, ep: int, dispatcher: str) -> list[str]:
    flags = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
             "--expert-model-parallel-size", str(ep), "--expert-tensor-parallel-size", "1",
             "--micro-batch-size", str(MBS), "--moe-token-dispatcher-type", dispatcher]
    return flags + (["--sequence-parallel"] if tp > 1 else [])


def grid_label(tp: int, pp: int, ep: int, dispatcher: str) -> str:
    return f"tp{tp} pp{pp} dp{WORLD // (tp * pp)} ep{ep} mbs{MBS} {dispatcher}" + (" sp" if tp > 1 else "")


def profile(out: str) -> str:
    """This machine's profile (kept in `out`), each entry its fastest sample (the least disturbed by other jobs)."""
    path = os.path.join(out, "profile.json")
    if not os.path.exists(path):
        _run(_tool("autoconfig.py") + ["profile", "--output", path, *MODEL, "--profile-micro-batch-sizes", "1,2,4",
                                       "--profile-tp", "1,2,4", "--profile-rounds", "2", "--profile-statistic", "min"],
             "autoconfig.py profile")
    return path


def plans(out: str, prof: str) -> dict[str, dict]:
    """dispatcher -> {path, predicted_s, label} of the search's best plan for the model with that dispatcher."""
    got = {}
    for disp in DISPATCHERS:
        path = os.path.join(out, f"plan_{disp}.json")
        if not os.path.exists(path):
            _run(_tool("autoconfig.py") + ["search", "--cluster", "local", "--profile", prof, "--world-size",
                                           str(WORLD), *MODEL, "--moe-token-dispatcher-type", disp, "--output", path,
                                           "--no-progress"], f"search ({disp})")
        with open(path) as f:
            plan = json.load(f)
        par, pipe = plan["parallel"], plan["pipeline"]
        tp, pp = par["tensor_model_parallel_size"], par["pipeline_model_parallel_size"]
        label = (f"tp{tp} pp{pp} dp{WORLD // (tp * pp * (par.get('context_parallel_size') or 1))} "
                 f"ep{par.get('expert_model_parallel_size', 1)} mbs{pipe['micro_batch_size']} {disp}"
                 + (" sp" if par.get("sequence_parallel") else "")
                 + (f" {pipe['schedule']}" if pp > 1 else "")
                 + (" zero1" if (plan.get("training") or {}).get("distributed_optimizer") else ""))
        got[disp] = {"path": path, "predicted_s": plan["prediction"]["iteration_time_s"], "label": label}
    return got


def _records(path: str, c: dict) -> list[dict]:
    """The configuration's records in a results file: a grid trial's by its flags, a plan's by its digest."""
    from megatron_bmw.trials.grid import plan_digest
    from megatron_bmw.trials.results import load_results

    if not os.path.exists(path):
        return []
    if c.get("plan"):
        if "digest" not in c:
            with open(c["plan"]) as f:
                c["digest"] = plan_digest(json.load(f))
        return [r for r in load_results(path) if r.get("plan") and plan_digest(r["plan"]) == c["digest"]]
    return [r for r in load_results(path) if not r.get("plan") and r.get("argv") == MODEL + c["flags"]]


def measure(out: str, configs: list[dict], opts) -> None:
    """Every configuration once per round, the order turned each round (a resumed run skips what a round holds)."""
    for k in range(opts.rounds):
        results = os.path.join(out, f"round{k}.jsonl")
        shift = (k * 5) % len(configs)
        for c in configs[shift:] + configs[:shift]:
            if any(r["status"] in ("ok", "failed", "infeasible") for r in _records(results, c)):
                continue
            what = ["--plans", c["plan"], "--mock-data"] if c.get("plan") else \
                ["--nproc-per-node", str(WORLD), *MODEL, *c["flags"]]
            _run(_tool("grid_search.py") + what + ["--trial-iters", str(opts.trial_iters), "--warmup-iters",
                                                  str(opts.warmup_iters), "--trial-timeout", "600", "--results",
                                                  results, "--log-dir", os.path.join(out, "logs")],
                 f"round {k + 1}/{opts.rounds}: {c['label']}")


def _collect(out: str, configs: list[dict], rounds: int) -> None:
    """Each configuration's ok runs over the rounds' files."""
    for c in configs:
        c["times"] = [r["median_iteration_s"] for k in range(rounds)
                      for r in _records(os.path.join(out, f"round{k}.jsonl"), c) if r["status"] == "ok"]
        c["measured_s"] = median(c["times"]) if c["times"] else None


@exit_on_usage_error
def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "megatron_bmw_moe_planner_vs_grid"))
    ap.add_argument("--rounds", type=count(1), default=3)
    ap.add_argument("--trial-iters", type=count(1), default=8)
    ap.add_argument("--warmup-iters", type=count(0), default=3)
    ap.add_argument("--predict-only", action="store_true", help="profile, plan and predict the grid; run nothing")
    ap.add_argument("--json", default=None)
    opts = ap.parse_args()
    if opts.warmup_iters >= opts.trial_iters:
        raise UsageError(f"--warmup-iters {opts.warmup_iters} leaves no measured iteration of --trial-iters "
                         f"{opts.trial_iters}")
    if opts.json and opts.predict_only:
        raise UsageError("--json: holds measured times, which --predict-only does not take")
    output_files(json=opts.json)
    output_dirs(out=opts.out)
    t0 = time.time()
    print(f"MoE planner vs grid on {WORLD} gloo ranks; working in {opts.out}", flush=True)
    prof = profile(opts.out)
    picked = plans(opts.out, prof)
    from megatron_bmw.trials.specs import TrialModel

    model = TrialModel.from_paths("local", [prof])
    configs = [{"label": grid_label(*g), "flags": grid_flags(*g), "grid": True} for g in GRID]
    for c in configs:
        c["predicted_s"] = model.predict({"id": c["label"], "world_size": WORLD,
                                          "argv": MODEL + c["flags"]})["iteration_time_s"]
    for disp, p in picked.items():
        configs.append({"label": p["label"], "plan": p["path"], "predicted_s": p["predicted_s"], "grid": False,
                        "search": disp})
    pick = min((c for c in configs if not c["grid"]), key=lambda c: c["predicted_s"])
    if not opts.predict_only:
        measure(opts.out, configs, opts)
        _collect(opts.out, configs, opts.rounds)
    grid = [c for c in configs if c["grid"]]
    rows = []
    for c in sorted(configs, key=lambda c: (c.get("measured_s") or float("inf"), c["predicted_s"])):
        tag = "" if c["grid"] else (f"search ({c['search']})" + (", the pick" if c is pick else ""))
        meas = c.get("measured_s")
        rows.append([c["label"], tag or "grid", f"{c['predicted_s']:.4f}", "-" if meas is None else f"{meas:.4f}",
                     "-" if meas is None else f"{100 * (c['predicted_s'] / meas - 1):+.0f}%",
                     " ".join(f"{t:.3f}" for t in c.get("times", []))])
    print(f"\nMoE GPT ({' '.join(MODEL)}) on {WORLD} gloo ranks: predicted (local profile) and measured seconds per "
          "iteration")
    print(format_table(["configuration", "from", "predicted s", "measured s", "error", "rounds (s)"], rows))
    ranked = sorted(grid, key=lambda c: c["predicted_s"])
    print("predicted order of the grid: " + ", ".join(c["label"] for c in ranked[:5]) + ", ...")
    summary = {}
    measured = [c for c in grid if c.get("measured_s")]
    if len(measured) >= 2:
        best = min(measured, key=lambda c: c["measured_s"])
        errors = sorted(abs(c["predicted_s"] / c["measured_s"] - 1) for c in measured)
        rho = spearman([c["predicted_s"] for c in measured], [c["measured_s"] for c in measured])
        summary = {"spearman": rho, "median_abs_error": errors[len(errors) // 2], "grid_best": best["label"],
                   "grid_best_s": best["measured_s"]}
        print(f"grid: {len(measured)} configurations measured; Spearman(predicted, measured) {rho:.3f}; median "
              f"|error| {100 * summary['median_abs_error']:.0f}%; fastest measured: {best['label']} "
              f"({best['measured_s']:.4f} s)")
        predicted_best = min(measured, key=lambda c: c["predicted_s"])
        print(f"the grid's predicted fastest ({predicted_best['label']}) ran "
              f"{100 * (predicted_best['measured_s'] / best['measured_s'] - 1):+.1f}% against the grid's best")
        if pick.get("measured_s"):
            summary["pick"], summary["pick_vs_grid_best"] = pick["label"], pick["measured_s"] / best["measured_s"]
            print(f"the planner's pick ({pick['label']}, predicted {pick['predicted_s']:.4f} s) ran "
                  f"{pick['measured_s']:.4f} s: {summary['pick_vs_grid_best']:.3f} x the grid's best")
        # other jobs only ever slow a run down: each configuration's fastest round is its least disturbed one
        fastest = {id(c): min(c["times"]) for c in measured}
        best_fast = min(fastest.values())
        summary["spearman_fastest_round"] = spearman([c["predicted_s"] for c in measured],
                                                     [fastest[id(c)] for c in measured])
        spread = sorted((max(c["times"]) - min(c["times"])) / c["measured_s"] for c in measured)
        summary["round_spread_median"] = spread[len(spread) // 2]
        line = (f"by each configuration's fastest round: Spearman {summary['spearman_fastest_round']:.3f}, grid's "
                f"best {best_fast:.4f} s")
        if pick.get("times"):
            summary["pick_vs_grid_best_fastest_round"] = min(pick["times"]) / best_fast
            line += f", the pick {min(pick['times']):.4f} s ({summary['pick_vs_grid_best_fastest_round']:.3f} x)"
        print(line)
        print(f"noise: (max - min) / median over the rounds, median over the grid {100 * spread[len(spread) // 2]:.0f}%"
              f", largest {100 * spread[-1]:.0f}%")
    print(f"total {time.time() - t0:.0f} s")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"configurations": configs, "summary": summary}, f, indent=1, default=str)


if __name__ == "__main__":
    sys.exit(main())
