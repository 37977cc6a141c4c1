"""The planner against Megatron-LM's published GPT runs (Narayanan et al., SC21, Table 1: 1.7B to 1T parameters on
32 to 3072 A100-80GB; sequence 2048, vocabulary 51,200, micro-batch 1, full activation recomputation, 1F1B).

For every row: the published layout simulated on the a100-80g-ib cluster (DGX A100 nodes, one 200 Gb/s HDR
port per GPU) and its predicted TFLOP/s per GPU in Megatron's own accounting (96 B s l h^2 (1 + s/6h +
V/16lh) FLOPs per iteration, recomputation included) beside the published one; then the search on the same
GPUs and global batch (in the space the engine runs: SearchSpace.for_engine), its plan's predicted time against
the published layout's. Analytic unit times (no
A100 here to profile): the GEMMs and attention by shape (planner/kernel_time.py) plus the bytes of the elementwise
kernels at memory bandwidth (planner/elementwise.py).

With --zero-bubble, per row the search runs twice on the same GPUs and batch, without zero-bubble schedules in its
space (1F1B, interleaved) and with ZB-H1 added, and reports whether it is chosen, what it gains, and the memory it
costs: the chosen plan's worst stage against the same plan run with 1F1B. --dropout sets both dropouts (SC21's
runs use 0.1; zero-bubble with recomputation needs 0).

    python benchmarks/megatron_sc21.py [--rows 1.7,145.6] [--json out.json] [--zero-bubble [--dropout 0]]
                                       [--engine megatron_bmw]

The rows are modelled as they ran (Megatron-LM of 2021): unfused attention (baddbmm, the fused scale-mask-softmax
kernel, dropout over the scores; flash attention came later) and, for time, Megatron's data-parallel reduction
of these --fp16 runs (`--engine megatron-core`, the default: 16-bit gradients all-reduced, no distributed
optimizer then). `--engine megatron_bmw` times our runtime's fp32 all-reduce instead; the search plans for the
engine given.

Memory: every published layout ran, so each must be predicted to fit. The table's "fits" and the search use the
derived CUDA allowance (planner/cuda_allowance.py) and our runtime's model states; --memory prints each row's
margin (free share of the fullest stage's 80 GB) under the flat allowance it replaced (1.5 GiB + 10%), under
the derived one, and under the derived one with the model states of the engine that ran them (Megatron-LM,
--fp16 without --accumulate-allreduce-grads-in-fp32: 16-bit gradients and their fp32 copy, 20 bytes per
parameter before sharding).

    python benchmarks/megatron_sc21.py [--rows 1.7,145.6] [--memory] [--json out.json]
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import replace

try:
    import megatron_bmw  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks.args, behind megatron_bmw

from benchmarks.args import UsageError, exit_on_usage_error, names, output_files, parser  # noqa: E402
from megatron_bmw.config import ModelConfig, PipelineConfig
from megatron_bmw.planner.cluster import load_cluster
from megatron_bmw.planner.cost_model import CostSettings
from megatron_bmw.planner.cuda_allowance import DerivedAllowance
from megatron_bmw.planner.engine import EngineConfig
from megatron_bmw.planner.evaluate import estimate_memory, simulate_run, stage_capacity
from megatron_bmw.planner.memory_model import MemorySettings
from megatron_bmw.planner.search import SearchSettings, padded_model, search
from megatron_bmw.planner.space import SearchSpace
from megatron_bmw.planner.spec import RunSpec
from megatron_bmw.units import recompute_from_flags

SEQ, VOCAB = 2048, 51200
# billions of parameters, heads, hidden, layers, tp, pp, GPUs, global batch, published TFLOP/s per GPU
TABLE = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
FLAT = MemorySettings(device="cuda", workspace_bytes=1.5 * 2**30, fragmentation=0.10)
MEMORY = MemorySettings(device="cuda", derived=DerivedAllowance((load_cluster("a100-80g-ib").groups[0].device,)))
MEGATRON = MemorySettings(device="cuda", engine=EngineConfig("megatron-core"), derived=MEMORY.derived)


def margin(spec: RunSpec, cluster, settings: MemorySettings) -> float:
    """Free share of the fullest stage's device (negative: predicted not to fit)."""
    return min(1 - m.peak_bytes / stage_capacity(spec, cluster, s)
               for s, m in enumerate(estimate_memory(spec, settings=settings)))


def megatron_flops(batch: int, layers: int, hidden: int) -> float:
    """FLOPs per iteration as Megatron counts them (with full recomputation)."""
    return 96 * batch * SEQ * layers * hidden**2 * (1 + SEQ / (6 * hidden) + VOCAB / (16 * layers * hidden))


def published_spec(model: ModelConfig, tp: int, pp: int, gpus: int, batch: int) -> RunSpec:
    dp = gpus // (tp * pp)
    # layers split evenly; the embedding and the head join the ends
    base, extra = divmod(model.num_layers, pp)
    parts = [2 * (base + (1 if k >= pp - extra else 0)) for k in range(pp)]
    parts[0] += 1
    parts[-1] += 1
    ranks, start = [], 0
    for size in parts:
        ranks.append(list(range(start, start + size)))
        start += size
    recompute = recompute_from_flags("full", "uniform", None, model.num_layers, ranks)
    pipe = PipelineConfig(micro_batch_size=1, num_microbatches=batch // dp, partition=tuple(parts), recompute=recompute)
    return RunSpec.of(padded_model(model, VOCAB, 128, tp), tp, pp, dp, pipe, sequence_parallel=False,
                   overlap_grad_reduce=dp > 1)


@exit_on_usage_error
def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--rows", default=None, help="billions of parameters of the rows to run, e.g. 1.7,145.6")
    ap.add_argument("--memory", action="store_true", help="only the memory margins of the published layouts")
    ap.add_argument("--json", default=None)
    ap.add_argument("--zero-bubble", action="store_true",
                    help="search with and without ZB-H1 in the space and compare (instead of the published rows)")
    ap.add_argument("--dropout", type=float, default=None, help="--zero-bubble's hidden and attention dropout "
                                                                 "(default 0.1)")
    ap.add_argument("--engine", choices=("megatron_bmw", "megatron-core"), default=None,
                    help="whose gradient reduction the time model assumes: Megatron's, as the published runs ran "
                         "it (--fp16: 16-bit gradients all-reduced; the default), or ours (fp32 all-reduce)")
    args = ap.parse_args()
    if args.zero_bubble and args.memory:
        raise UsageError("--zero-bubble, --memory: give one (each replaces the published rows' table)")
    if args.dropout is not None and not args.zero_bubble:
        raise UsageError("--dropout: only with --zero-bubble (the published rows run with 0.1)")
    if args.engine is not None and (args.zero_bubble or args.memory):
        raise UsageError(f"--engine: only for the published rows' table, not "
                         f"{'--zero-bubble' if args.zero_bubble else '--memory'}")
    dropout = 0.1 if args.dropout is None else args.dropout
    args.engine = args.engine or "megatron-core"
    if not 0 <= dropout < 1:
        raise UsageError(f"--dropout {args.dropout}: must be in [0, 1)")
    output_files(json=args.json)
    rows = TABLE
    if args.rows is not None:
        chosen = names("--rows", args.rows, [str(r[0]) for r in TABLE])
        rows = [r for r in TABLE if str(r[0]) in chosen]
    if args.zero_bubble:
        return zero_bubble_rows(rows, dropout, args.json)
    if args.memory:
        return memory_table(rows, args.json)
    costs = CostSettings(engine=EngineConfig(args.engine))
    out = []
    print(f"{'params':>7} {'GPUs':>5} {'tp':>2} {'pp':>3} {'batch':>5} | {'published':>9} {'predicted':>9} {'error':>6} "
          f"{'fits':>4} | {'search':>8} {'vs pub.':>7} {'layout (tp pp dp mbs schedule rc)':<36} {'s':>5}")
    for billions, heads, hidden, layers, tp, pp, gpus, batch, published in rows:
        model = ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, vocab_size=VOCAB,
                            seq_length=SEQ, params_dtype="fp16", hidden_dropout=0.1, attention_dropout=0.1,
                            attention_backend="unfused")
        cluster = load_cluster("a100-80g-ib", num_nodes=gpus // 8)
        spec = published_spec(model, tp, pp, gpus, batch)
        ev = simulate_run(spec, cluster, None, costs, MEMORY, memory_over_time=False)
        t_pub = ev.simulation.iteration_time
        fits = all(m.peak_bytes <= stage_capacity(spec, cluster, s) for s, m in enumerate(ev.memory))
        tflops = megatron_flops(batch, layers, hidden) / t_pub / gpus / 1e12
        started = time.time()
        result = search(model, VOCAB, 128, batch, cluster, None, SearchSpace().for_engine(args.engine), costs, MEMORY,
                        SearchSettings(top_k=1))
        elapsed = time.time() - started
        best = result.best
        row = {"billions": billions, "gpus": gpus, "published_tflops": published, "predicted_tflops": tflops,
               "published_layout_fits": fits, "published_layout_s": t_pub, "search_s": elapsed}
        if best is not None:
            s = best.spec
            rc = sum(1 for x in s.pipeline.recompute or () if x)
            layout = (f"{s.tp} {s.pp} {s.dp} {s.pipeline.micro_batch_size} {s.pipeline.schedule}"
                      f"{'' if s.pipeline.virtual_stages == 1 else ' v' + str(s.pipeline.virtual_stages)} {rc}")
            row.update(search_time_s=best.time, layout=layout)
            found = f"{best.time:8.2f} {100 * (best.time / t_pub - 1):+6.1f}% {layout:<36}"
        else:
            found = f"{'none':>8} {'':>7} {'':<36}"
        out.append(row)
        print(f"{billions:7.1f} {gpus:>5} {tp:>2} {pp:>3} {batch:>5} | {published:9.0f} {tflops:9.1f} "
              f"{100 * (tflops / published - 1):+5.1f}% {'yes' if fits else 'NO':>4} | {found} {elapsed:5.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def _layout(spec: RunSpec) -> str:
    rc = sum(1 for x in spec.pipeline.recompute or () if x)
    v = spec.pipeline.virtual_stages
    return f"{spec.tp} {spec.pp} {spec.dp} {spec.pipeline.micro_batch_size} {spec.pipeline.schedule}" \
        f"{'' if v == 1 else ' v' + str(v)} {rc}"


def zero_bubble_rows(rows, dropout: float, json_path: str | None) -> int:
    """The search with and without ZB-H1 in its space, row by row, and what zero-bubble costs in memory."""
    costs = CostSettings()
    without = SearchSpace(schedule=("1f1b", "interleaved"))
    with_zb = SearchSpace(schedule=("1f1b", "interleaved", "zb-h1"))
    out = []
    print(f"{'params':>7} {'GPUs':>5} | {'without s':>9} {'layout (tp pp dp mbs schedule rc)':<34} | {'with s':>8} "
          f"{'gain':>6} {'layout':<30} | {'peak GB':>7} {'1F1B GB':>7} {'+GB':>5} | {'search s':>8}")
    for billions, heads, hidden, layers, tp, pp, gpus, batch, published in rows:
        model = ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, vocab_size=VOCAB,
                            seq_length=SEQ, params_dtype="fp16", hidden_dropout=dropout, attention_dropout=dropout)
        cluster = load_cluster("a100-80g-ib", num_nodes=gpus // 8)
        started = time.time()
        base = search(model, VOCAB, 128, batch, cluster, None, without, costs, MEMORY, SearchSettings(top_k=1)).best
        got = search(model, VOCAB, 128, batch, cluster, None, with_zb, costs, MEMORY, SearchSettings(top_k=1)).best
        elapsed = time.time() - started
        row = {"billions": billions, "gpus": gpus, "dropout": dropout, "search_s": elapsed,
               "without_s": base.time if base else None, "without_layout": _layout(base.spec) if base else None,
               "with_s": got.time if got else None, "with_layout": _layout(got.spec) if got else None}
        chosen = got is not None and got.spec.pipeline.schedule == "zb-h1"
        peak = same_1f1b = None
        if got is not None:
            peak = max(m.peak_bytes for m in got.evaluation.memory)
        if chosen:  # the same plan with 1F1B: what zero-bubble's held-for-W micro-batches cost
            spec = replace(got.spec, pipeline=replace(got.spec.pipeline, schedule="1f1b"))
            same_1f1b = max(m.peak_bytes for m in simulate_run(spec, cluster, None, costs, MEMORY,
                                                              memory_over_time=False).memory)
        gain = (1 - got.time / base.time) if chosen and base is not None else 0.0
        row.update(zero_bubble_chosen=chosen, gain=gain, peak_bytes=peak, same_plan_1f1b_peak_bytes=same_1f1b)
        out.append(row)
        gb = 2 ** 30
        print(f"{billions:7.1f} {gpus:>5} | {row['without_s'] or float('nan'):9.3f} {row['without_layout'] or 'none':<34} | "
              f"{row['with_s'] or float('nan'):8.3f} {100 * gain:5.1f}% {row['with_layout'] or 'none':<30} | "
              f"{(peak or 0) / gb:7.1f} {(same_1f1b or 0) / gb if chosen else float('nan'):7.1f} "
              f"{((peak - same_1f1b) / gb) if chosen else float('nan'):5.1f} | {elapsed:8.1f}")
    picked = [r for r in out if r["zero_bubble_chosen"]]
    gains = [r["gain"] for r in picked]
    extra = [(r["peak_bytes"] - r["same_plan_1f1b_peak_bytes"]) / 2**30 for r in picked]
    print(f"zero-bubble chosen in {len(picked)} of {len(out)} rows"
          + (f"; gain mean {100 * sum(gains) / len(gains):.1f}%, max {100 * max(gains):.1f}%; memory over the same "
             f"plan with 1F1B mean {sum(extra) / len(extra):+.1f} GB, max {max(extra):+.1f} GB" if picked else ""))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def memory_table(rows, json_path: str | None) -> int:
    out = []
    print(f"{'params':>7} {'tp':>2} {'pp':>3} {'dp':>3} | margin: {'flat':>6} {'derived':>7} {'Megatron-LM states':>18}")
    for billions, heads, hidden, layers, tp, pp, gpus, batch, _ in rows:
        model = ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, vocab_size=VOCAB,
                            seq_length=SEQ, params_dtype="fp16", hidden_dropout=0.1, attention_dropout=0.1,
                            attention_backend="unfused")
        cluster = load_cluster("a100-80g-ib", num_nodes=gpus // 8)
        spec = published_spec(model, tp, pp, gpus, batch)
        got = {name: margin(spec, cluster, settings) for name, settings in
               (("flat", FLAT), ("derived", MEMORY), ("megatron", MEGATRON))}
        out.append({"billions": billions, **{f"margin_{k}": v for k, v in got.items()}})
        print(f"{billions:7.1f} {tp:>2} {pp:>3} {spec.dp:>3} |         {100 * got['flat']:5.1f}% "
              f"{100 * got['derived']:6.1f}% {100 * got['megatron']:17.1f}%")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if all(min(r["margin_derived"], r["margin_megatron"]) >= 0 for r in out) else 1


if __name__ == "__main__":
    sys.exit(main())
