"""The planner against BigScience's BLOOM-176B trials: 92 timed runs (and 6 out-of-memory ones) of 176-206B GPTs on
48 nodes of 8 A100-80GB, where the micro-batch size, the number of attention heads and the layout (tp, pp, dp) vary,
and two runs of 6 and 10 of its layers on one node (tp 8, no pipeline, no network: the tensor-parallel layer alone).

Source: bigscience-workshop/bigscience, train/tr11-176B-ml/chronicles-prequel.md (commit ddfe9cc, 2022-03-02;
unchanged since), the tables of sections "48 node contenders" to "Rebalancing layers" (20-28 Feb 2022). Every row
is a published table row (seconds per iteration, the 2nd iteration of one run); `line` in the data is its line
in that file. Data: benchmarks/data/bloom_trials.json (the rows, the setup, the sources).

The runs: Megatron-DeepSpeed (DeepSpeed's pipeline engine, 1F1B), ZeRO-1, full activation checkpointing, sequence
2048, vocabulary 250,880, unfused attention (baddbmm and a fused softmax kernel; no flash attention then), tied
embeddings, gradients reduced after the pipeline. The cluster is the built-in a100-80g-ib's A100-80GB and NVLink
with the inter-node link replaced by BigScience's own all-reduce measurement on that machine (5.06 GB/s bus
bandwidth, 4 Omni-Path links per node of 8 GPUs), since Jean Zay's network is not DGX-style: it is what each
ring gets, whatever its GPUs per node (the data's nics_note says why it is not a node's total shared by its rings).

The trials ran with CUDA_LAUNCH_BLOCKING=1 (Jean Zay hung on 40+ nodes without it; the data's setup cites where):
every kernel launch waits for its kernel, so a unit's host time adds to its device time (--launch blocking, the
default: the operators our runtime's units dispatch, models/op_count.py, x the host time per operator measured
for our runtime on an H100's host, CostSettings.host_op_s; --launch async: the host ahead of the GPU, as before).

Every row runs through `autoconfig.py simulate`'s own code (`cli.autoconfig.simulate_flags`, flags in `row_flags`):
nothing here is a setting the command line does not offer.

A group is one day's comparison of one model (same hidden size and depth): the author's own search (one group varies
only the global batch: it checks the pipeline bubble and is left out of the summary's searches). Reported per
row: measured and predicted seconds per iteration and the error; per group: Spearman's rank correlation of
predicted and measured seconds per sample (the global batch varies in two groups) and the pick-vs-best: how much
slower, measured, the row predicted fastest ran than the fastest measured row (rows that ran only). Memory: the
planner's peak against the published use and the OOM rows. Nothing here is fitted to the measured times.

--engine (planner/engine.py) says whose gradients and model states are modelled: `deepspeed` (the default, the
engine that ran: fp16 rows with fp16 gradients accumulated by autograd and reduce-scattered under ZeRO-1, bf16 rows
with BF16_Optimizer's fp32 accumulator all-reduced; whole-layer checkpoints; pipeline transfers that hold the
compute, as its synchronous broadcasts do, each tp rank sending its 1/tp part and the receiver all-gathering over
tp) or `megatron_bmw` (our runtime: fp32 main gradients all-reduced, a
checkpoint per sub-layer unit, transfers beside the compute). The summary ends with the median signed error per
tensor-parallel size.

    python benchmarks/bloom_trials.py [--group "02-25 h14336 L72"] [--engine megatron_bmw] [--flat-allowance]
                                      [--launch async] [--json out.json]
"""

from __future__ import annotations

import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.args import exit_on_usage_error, output_files, parser  # noqa: E402
from megatron_bmw.cli.autoconfig import simulate_flags, spec_flags  # noqa: E402
from megatron_bmw.errors import UsageError  # noqa: E402
from megatron_bmw.planner.accuracy import error_summary  # noqa: E402
from megatron_bmw.planner.evaluate import stage_capacity  # noqa: E402
from megatron_bmw.planner.spec import RunSpec  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "bloom_trials.json")
# the CUDA context the author measured on that cluster's A100s with its 2022 stack (CUDA 11.3, kernels loaded
# eagerly): "40GB A100 takes 1573MiB for cuda kernels" (chronicles-prequel.md line 144), where the device type's
# 0.5 GiB is a lazily loading stack's (--cuda-context-gb); --flat-allowance: the 1.5 GiB + 10% it replaced
JEAN_ZAY_CONTEXT_BYTES = 1573 * 2**20
ROW_KEYS = ("group", "line", "hidden", "layers", "heads", "tp", "pp", "dp", "mbs", "gbs", "nodes", "partition_method",
            "dtype", "measured_s", "oom")


def load_data(path: str = DATA) -> dict:
    """The published rows and setup; every row checked for what the benchmark needs."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise UsageError(f"{path}: cannot read the BLOOM trials ({exc})") from None
    for i, row in enumerate(data.get("rows", [])):
        missing = [k for k in ROW_KEYS if k not in row]
        if missing:
            raise UsageError(f"{path}: row {i} lacks {', '.join(missing)}")
        if row["tp"] * row["pp"] * row["dp"] != 8 * row["nodes"]:
            raise UsageError(f"{path}: row {i} (line {row['line']}): tp x pp x dp is not 8 x nodes")
        if row["gbs"] % (row["dp"] * row["mbs"]):
            raise UsageError(f"{path}: row {i} (line {row['line']}): global batch not a multiple of dp x mbs")
        if (row["measured_s"] is None) != row["oom"]:
            raise UsageError(f"{path}: row {i} (line {row['line']}): a time exactly when it did not run out of memory")
    if not data.get("rows"):
        raise UsageError(f"{path}: no rows")
    return data


def stage_layers(method: str, layers: int, pp: int) -> list[int]:
    """Transformer layers per pipeline stage under DeepSpeed's partition method, as the trials ran it.
    type:transformer: ceil(layers / pp) per stage, the last stage the rest (78 over 12 ran as 11 x 7 + 1, section
    Re-do). type:transformer|embedding: the two embedding ends count as layers, (layers + 2) / pp per stage."""
    if method == "type:transformer":
        per = -(-layers // pp)
        out = [min(per, layers - per * k) for k in range(pp)]
    elif method == "type:transformer|embedding":
        if (layers + 2) % pp or pp < 2:
            raise UsageError(f"{layers} layers + 2 embedding ends do not split over {pp} stages")
        per = (layers + 2) // pp
        out = [per - 1] + [per] * (pp - 2) + [per - 1]
    else:
        raise UsageError(f"unknown partition method {method!r}")
    if min(out) < 1 or sum(out) != layers:
        raise UsageError(f"{method}: {layers} layers do not split over {pp} stages")
    return out


def row_flags(row: dict, setup: dict, engine: str = "deepspeed", launch: str = "blocking",
              flat_allowance: bool = False) -> list[str]:
    """The `autoconfig.py simulate` flags of one row: the model, layout and recomputation the trial ran, on the
    built-in a100-80g-ib with the measured bus bandwidth across nodes (--inter-node-bus-bandwidth), the CUDA
    context measured on that cluster (--cuda-context-gb), and CUDA_LAUNCH_BLOCKING=1 (--cuda-launch-blocking)."""
    link = setup["inter_node"]
    units = [2 * n for n in stage_layers(row["partition_method"], row["layers"], row["pp"])]
    units[0] += 1  # the embedding
    units[-1] += 1  # the final norm and the tied output layer
    flags = ["--cluster", setup["base_cluster"], "--num-nodes", str(row["nodes"]),
             "--inter-node-bus-bandwidth", str(link["bandwidth_GBps"]), "--memory-device", "cuda",
             "--engine", engine, "--num-layers", str(row["layers"]), "--hidden-size", str(row["hidden"]),
             "--num-attention-heads", str(row["heads"]), "--vocab-size", str(setup["vocab_size"]),
             "--seq-length", str(setup["seq_length"]), "--max-position-embeddings", str(setup["seq_length"]),
             "--attention-backend", "unfused", "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
             f"--{row['dtype']}", "--tensor-model-parallel-size", str(row["tp"]),
             "--pipeline-model-parallel-size", str(row["pp"]), "--micro-batch-size", str(row["mbs"]),
             "--global-batch-size", str(row["gbs"]), "--pipeline-partition", ",".join(map(str, units)),
             "--recompute-granularity", "full", "--recompute-method", "uniform", "--use-distributed-optimizer"]
    flags += ["--memory-workspace-gb", "1.5", "--memory-fragmentation", "0.1"] if flat_allowance else \
        ["--cuda-context-gb", str(JEAN_ZAY_CONTEXT_BYTES / 2**30)]
    return flags + (["--cuda-launch-blocking"] if launch == "blocking" else [])


def run_spec(row: dict, setup: dict) -> RunSpec:
    """The RunSpec the command line makes of a row."""
    return spec_flags(row_flags(row, setup))


FACTORS = {"micro-batch size": ("mbs",), "attention heads": ("heads",), "layout (tp, pp, dp)": ("tp", "pp", "dp")}


def differing_factor(a: dict, b: dict) -> str | None:
    """The one factor two rows of a group differ in (same global batch), else None."""
    if a["group"] != b["group"] or a["gbs"] != b["gbs"]:
        return None
    differ = [name for name, keys in FACTORS.items() if any(a[k] != b[k] for k in keys)]
    return differ[0] if len(differ) == 1 else None


def evaluate(data: dict, groups: list[str] | None = None, flat_allowance: bool = False,
             engine: str = "deepspeed", launch: str = "blocking") -> dict:
    setup = data["setup"]
    known = list(dict.fromkeys(r["group"] for r in data["rows"]))
    unknown = [g for g in groups or () if g not in known]
    if unknown:
        raise UsageError(f"--group {unknown[0]!r}: no such group (one of {', '.join(map(repr, known))})")
    rows = [dict(r) for r in data["rows"] if groups is None or r["group"] in groups]
    for row in rows:
        ev, cluster, _ = simulate_flags(row_flags(row, setup, engine, launch, flat_allowance))
        spec = ev.spec
        row["predicted_s"] = ev.simulation.iteration_time
        row["predicted_peak_gb"] = max(m.peak_bytes for m in ev.memory) / 1e9
        row["predicted_fits"] = all(m.peak_bytes <= stage_capacity(spec, cluster, s) for s, m in enumerate(ev.memory))
        if row["measured_s"] is not None:
            row["error"] = row["predicted_s"] / row["measured_s"] - 1
    summaries = {}
    for name in dict.fromkeys(r["group"] for r in rows):
        ran = [r for r in rows if r["group"] == name and r["measured_s"] is not None]
        s = error_summary([r["predicted_s"] / r["gbs"] for r in ran], [r["measured_s"] / r["gbs"] for r in ran])
        # a search varies the micro-batch size, the heads or the layout (not only the global batch)
        s["search"] = len(ran) >= 3 and any(len({tuple(r[k] for k in keys) for r in ran}) > 1
                                             for keys in FACTORS.values())
        if ran:
            s["pick_line"] = ran[s["pick_index"]]["line"]
            s["best_line"] = min(ran, key=lambda r: r["measured_s"] / r["gbs"])["line"]
        summaries[name] = s
    ran = [r for r in rows if r["measured_s"] is not None]
    pairs = {factor: [0, 0] for factor in FACTORS}  # [ordered as measured, pairs]
    for i, a in enumerate(ran):
        for b in ran[i + 1:]:
            factor = differing_factor(a, b)
            if factor is not None and a["measured_s"] != b["measured_s"]:
                pairs[factor][1] += 1
                pairs[factor][0] += (a["predicted_s"] < b["predicted_s"]) == (a["measured_s"] < b["measured_s"])
    searches = [s for s in summaries.values() if s["search"]]
    return {"rows": rows, "groups": summaries, "pairs": pairs,
            "median_abs_error": statistics.median(abs(r["error"]) for r in ran),
            "median_spearman": statistics.median(s["spearman"] for s in searches) if searches else float("nan"),
            "median_pick_vs_best": statistics.median(s["pick_vs_best"] for s in searches) if searches else float("nan"),
            "oom_caught": sum(1 for r in rows if r["oom"] and not r["predicted_fits"]),
            "oom_total": sum(1 for r in rows if r["oom"]),
            "false_oom": sum(1 for r in ran if not r["predicted_fits"]),
            "median_error_by_tp": {tp: statistics.median(r["error"] for r in ran if r["tp"] == tp)
                                   for tp in sorted({r["tp"] for r in ran})},
            "one_node": [(r["line"], r["error"], r["tp"], r["mbs"]) for r in ran if r["nodes"] == 1],
            "median_published_over_predicted_memory": statistics.median(
                r["published_mem_gb"] / r["predicted_peak_gb"] for r in ran if r.get("published_mem_gb"))}


@exit_on_usage_error
def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--data", default=DATA)
    ap.add_argument("--group", action="append", default=None, help="only this group (repeatable)")
    ap.add_argument("--flat-allowance", action="store_true", help="1.5 GiB + 10%% instead of the derived allowance")
    ap.add_argument("--engine", choices=("deepspeed", "megatron_bmw"), default="deepspeed",
                    help="whose gradient handling and model states: DeepSpeed's, which ran the trials (default), "
                         "or our runtime's")
    ap.add_argument("--launch", choices=("blocking", "async"), default="blocking",
                    help="kernel launches: blocking (CUDA_LAUNCH_BLOCKING=1, as the trials ran: each unit's host "
                         "time adds to its device time; the default) or async (the host ahead of the GPU)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    output_files(json=args.json)
    result = evaluate(load_data(args.data), args.group, args.flat_allowance, args.engine, args.launch)
    head = (f"{'line':>4} {'tp':>2} {'pp':>2} {'dp':>2} {'mbs':>3} {'heads':>5} {'hd':>3} {'gbs':>4} | {'measured':>8} "
            f"{'predicted':>9} {'error':>6} | {'mem pub.':>8} {'pred.':>5} {'fits':>4}")
    for name, s in result["groups"].items():
        print(f"\n{name}")
        print(head)
        for r in (r for r in result["rows"] if r["group"] == name):
            measured = "OOM" if r["oom"] else f"{r['measured_s']:8.2f}"
            err = f"{100 * r['error']:+5.1f}%" if "error" in r else ""
            mem = "OOM" if r["oom"] else ("" if r.get("published_mem_gb") is None else f"{r['published_mem_gb']:.0f}")
            marks = ("*" if r["line"] == s.get("pick_line") else "") + ("=" if r["line"] == s.get("best_line") else "")
            print(f"{r['line']:>4} {r['tp']:>2} {r['pp']:>2} {r['dp']:>2} {r['mbs']:>3} {r['heads']:>5} "
                  f"{r['hidden'] // r['heads']:>3} {r['gbs']:>4} | {measured:>8} {r['predicted_s']:9.2f} {err:>6} | "
                  f"{mem:>8} {r['predicted_peak_gb']:5.0f} {'yes' if r['predicted_fits'] else 'NO':>4} {marks}")
        if s["n"] >= 2:
            print(f"  rows that ran {s['n']}: median |error| {100 * s['median_abs_error']:.1f}%, Spearman (s/sample) "
                  f"{s['spearman']:+.2f}, predicted fastest (*) ran {100 * s['pick_vs_best']:.1f}% slower than the "
                  f"best (=)")
    searches = sum(1 for s in result["groups"].values() if s["search"])
    print(f"\nall {sum(1 for r in result['rows'] if not r['oom'])} rows that ran: median |error| "
          f"{100 * result['median_abs_error']:.1f}%; over the {searches} searches (groups of >= 3 rows that vary "
          f"more than the batch): median Spearman {result['median_spearman']:+.2f}, median pick-vs-best "
          f"{100 * result['median_pick_vs_best']:.1f}%; OOM rows predicted not to fit: {result['oom_caught']}/"
          f"{result['oom_total']}; rows that ran predicted not to fit: {result['false_oom']}")
    pairs = "; ".join(f"{factor} {right}/{n}" for factor, (right, n) in result["pairs"].items())
    print(f"pairs of rows of one group that differ in one factor only, ordered by the prediction as measured: {pairs}")
    by_tp = ", ".join(f"tp {tp} {100 * e:+.1f}%" for tp, e in result["median_error_by_tp"].items())
    print(f"median signed error by tensor-parallel size: {by_tp}")
    if result["one_node"]:
        one = ", ".join(f"line {line} (tp {tp}, micro-batch {mbs}) {100 * e:+.1f}%" for line, e, tp, mbs in
                        result["one_node"])
        print(f"on one node (no pipeline, no network; the tensor-parallel layer alone): {one}")
    print(f"memory: median published (nvidia-smi) over predicted peak "
          f"{result['median_published_over_predicted_memory']:.3f} over the rows that give it")
    print("hd: head dimension; mem pub.: GB the author saw on the first node (nvidia-smi), pred.: the planner's peak "
          f"(GB, engine {args.engine})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
