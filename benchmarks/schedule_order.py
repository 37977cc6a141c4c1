"""The planner's order of pipeline schedules on the zero-bubble paper's pure-pipeline settings, from the command line.

Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024), time GPT models of 1.5B to 28.3B parameters on A100-80GB
SXM with pipeline parallelism only (tp 1, dp 1, micro-batch 1, sequence 1024) under 1F1B, interleaved 1F1B (one
layer per model chunk) and their zero-bubble schedules. The models and layouts below are the paper's (its Table
3: layers, heads, hidden size, pipeline size, micro-batches); the layer counts are p x k - 2, so that the embedding
and the output layer each take one layer's place: 1F1B's first and last stages hold one layer fewer, and
interleaving's first and last chunks hold the embedding and the output layer alone. Its measured throughputs are
not in this repository (they check the planner, and are held back); this benchmark prints what the planner
predicts for each schedule, so the order can be compared with the paper's.

Every run goes through `autoconfig.py simulate` (`cli.autoconfig.simulate_flags`), on the built-in a100-80g-ib,
with --engine megatron-core by default (the paper's runs are Megatron-LM's schedules and the authors' Megatron-LM
fork; docs/planner.md, "Megatron-LM's pipeline transfers"). Schedules: 1f1b, interleaved, and every zero-bubble
schedule the generator registry has (zb-h1, zb-h2, and the searched zb-1p and zb-2p where present); zbv where the
layers split over 2p chunks.

    python benchmarks/schedule_order.py [--engine megatron_bmw] [--vocab-size 50257] [--model 1.5B] [--json out.json]
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.args import exit_on_usage_error, output_files, parser  # noqa: E402
from megatron_bmw.cli.autoconfig import simulate_flags  # noqa: E402
from megatron_bmw.config.planner import ENGINES  # noqa: E402
from megatron_bmw.errors import UsageError  # noqa: E402
from megatron_bmw.pipeline.generators import SCHEDULES  # noqa: E402

# name: (layers, heads, hidden, pipeline size, nodes of 8 GPUs, micro-batches per iteration)
MODELS = {
    "1.5B": (22, 24, 2304, 8, 1, (24, 32, 64)),
    "6.2B": (30, 32, 4096, 8, 1, (24, 32, 64)),
    "14.6B": (46, 40, 5120, 16, 2, (48, 64, 128)),
    "28.3B": (62, 48, 6144, 32, 4, (96, 128, 256)),
}


def partition(layers: int, stages: int) -> list[int] | None:
    """Units per (virtual) stage, the embedding and the output layer each in one layer's place: (layers + 2) slots
    split as evenly as the stages allow, the larger stages in the middle; None if a stage would get no layer slot."""
    slots = layers + 2
    if slots < stages:
        return None
    base, extra = divmod(slots, stages)
    sizes = [base] * stages
    for k in range(extra):  # the extra slots to the middle stages
        sizes[stages // 2 - extra // 2 + k] += 1
    units = [2 * n for n in sizes]
    units[0] -= 1  # the embedding is one unit in a layer's (two units') place
    units[-1] -= 1  # the output layer likewise
    return units if min(units) >= 1 else None


def v_partition(layers: int, pp: int) -> list[int] | None:
    """ZB-V's units per virtual stage (rank r holds stages r and 2p-1-r): each rank's (layers + 2) / p slots,
    split between its two chunks; None if a chunk would get no slot."""
    base, extra = divmod(layers + 2, pp)
    per_rank = [base + (r < extra) for r in range(pp)]
    if min(per_rank) < 2:
        return None
    slots = [0] * (2 * pp)
    for r, n in enumerate(per_rank):
        slots[r], slots[2 * pp - 1 - r] = (n + 1) // 2, n // 2
    units = [2 * n for n in slots]
    units[0] -= 1
    units[-1] -= 1
    return units


def schedules() -> list[str]:
    return ["1f1b", "interleaved"] + [s for s in SCHEDULES if s.startswith("zb")]


def flags_of(model: str, m: int, schedule: str, engine: str, vocab: int) -> list[str] | None:
    layers, heads, hidden, pp, nodes, _ = MODELS[model]
    v = 1
    if schedule == "interleaved":
        v = (layers + 2) // pp  # one layer per chunk
    elif schedule == "zbv":
        v = 2
    part = v_partition(layers, pp) if schedule == "zbv" else partition(layers, pp * v)
    if part is None:
        return None
    flags = ["--cluster", "a100-80g-ib", "--num-nodes", str(nodes), "--engine", engine, "--num-layers", str(layers),
             "--hidden-size", str(hidden), "--num-attention-heads", str(heads), "--seq-length", "1024",
             "--max-position-embeddings", "1024", "--vocab-size", str(vocab), "--bf16", "--attention-backend", "flash",
             "--micro-batch-size", "1", "--pipeline-model-parallel-size", str(pp), "--global-batch-size", str(m),
             "--pipeline-partition", ",".join(map(str, part))]
    if v > 1 and schedule != "zbv":
        flags += ["--virtual-pipeline-model-parallel-size", str(v)]
    if schedule != "interleaved":
        flags += ["--pipeline-schedule", schedule]
    return flags


def evaluate(models: list[str], engine: str, vocab: int) -> list[dict]:
    rows = []
    for model in models:
        for m in MODELS[model][5]:
            times = {}
            for schedule in schedules():
                flags = flags_of(model, m, schedule, engine, vocab)
                if flags is None:
                    continue
                try:
                    times[schedule] = simulate_flags(flags)[0].simulation.iteration_time
                except UsageError as exc:
                    times[schedule] = None
                    print(f"{model} m={m} {schedule}: {exc}", file=sys.stderr)
            ran = {k: t for k, t in times.items() if t is not None}
            rows.append({"model": model, "microbatches": m, "seconds": times,
                         "order": sorted(ran, key=ran.get),
                         "gain_over_1f1b": {k: times["1f1b"] / t - 1 for k, t in ran.items()} if "1f1b" in ran else {}})
    return rows


@exit_on_usage_error
def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--engine", choices=ENGINES, default="megatron-core")
    ap.add_argument("--vocab-size", type=int, default=50257, help="the paper does not give it; GPT-2's by default")
    ap.add_argument("--model", action="append", choices=tuple(MODELS), default=None, help="only this model")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    output_files(json=args.json)
    rows = evaluate(args.model or list(MODELS), args.engine, args.vocab_size)
    names = schedules()
    print(f"{'model':>6} {'m':>4} | " + " ".join(f"{n:>11}" for n in names) + " | predicted order (fastest first)")
    for r in rows:
        cells = " ".join(f"{'-':>11}" if r['seconds'].get(n) is None else f"{r['seconds'][n] * 1e3:9.1f}ms"
                         for n in names)
        print(f"{r['model']:>6} {r['microbatches']:>4} | {cells} | {' > '.join(r['order'])}")
    print("gain over 1F1B (1F1B time / schedule time - 1), median over the settings:")
    for n in names:
        gains = sorted(r["gain_over_1f1b"][n] for r in rows if n in r["gain_over_1f1b"])
        if gains:
            print(f"  {n:>11}: {gains[len(gains) // 2]:+.1%} (from {gains[0]:+.1%} to {gains[-1]:+.1%})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"engine": args.engine, "vocab_size": args.vocab_size, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
