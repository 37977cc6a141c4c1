"""The planner against Megatron-core's published weak scaling on H100: GPTs of 1.7B to 462B parameters on 48 to
6144 H100 GPUs, data-parallel size 48 throughout, all of Megatron-core's overlaps on.

Source: NVIDIA/Megatron-LM, README.md section "Performance Benchmarking" and its table images/model_table.png
(commit f2e5db402c, 2024-07-15): per row the heads, hidden size, layers, tp, pp, dp, GPUs, global batch and the
per-GPU teraFLOP/s (with the MFU it makes of the H100's 989 bf16 TFLOP/s, so bf16). The README gives vocabulary
131,072, sequence 4096, and --overlap-grad-reduce, --overlap-param-gather (so the distributed optimizer) and
--tp-comm-overlap (so sequence parallelism at tp > 1). Measured seconds per iteration are the table's FLOPs
(Megatron-LM's num_floating_point_operations of that commit: 72 B s L h^2 (1 + s/6h + V/12Lh) for this GPT)
over its teraFLOP/s x GPUs.

The same README strong-scales the table's 177B GPT (GPT-3 with the larger vocabulary) at global batch 1152 from
96 to 4608 H100s and states the MFU of the ends in its text: "a reduction in MFU from 47% to 42%"
(images/strong_scaling.png plots the points between, which are not read off here). The layout is not stated; the
177B row's tp 8 x pp 6 gives both GPU counts (dp 2 and 96), so it is taken. The MFU is rounded to a per cent
(+-1.1% in time). At 96 GPUs each replica runs 576 micro-batches, so the pipeline bubble and the data-parallel
reduction hardly count: that row checks the layer time itself.

Not published, so stated here: the micro-batch size, interleaving and recomputation. Two predictions per row:
  - as stated: micro-batch 1, 1F1B, no recomputation (the least the table implies);
  - tuned: the planner's own choice of micro-batch, schedule (1F1B or interleaved) and recomputation on the
    published tp, pp and dp, in the space Megatron-core runs (SearchSpace.for_engine), as a tuned run would.
Both model Megatron-core (--engine megatron-core: fp32 gradient buffers reduce-scattered, as Megatron does for
bf16; gradient accumulation fused into the weight-gradient GEMM; flash attention; the tp collectives beside their
GEMMs) on the h100-80g-ib cluster (DGX H100: NVLink 4, a 400 Gb/s NIC per GPU). Analytic unit times (no H100
here to profile). Nothing here is fitted to the table.

    python benchmarks/megatron_core_scaling.py [--rows 1.7B,177B,177B@96] [--no-tuned] [--json out.json]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

try:
    import megatron_bmw  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks.args, behind megatron_bmw

from benchmarks.args import exit_on_usage_error, names, output_files, parser  # noqa: E402
from megatron_bmw.config import ModelConfig, PipelineConfig
from megatron_bmw.planner.cluster import load_cluster
from megatron_bmw.planner.cost_model import CostSettings
from megatron_bmw.planner.cuda_allowance import DerivedAllowance
from megatron_bmw.planner.engine import EngineConfig
from megatron_bmw.planner.evaluate import simulate_run, stage_capacity
from megatron_bmw.planner.memory_model import MemorySettings
from megatron_bmw.planner.search import SearchSettings, padded_model, search
from megatron_bmw.planner.space import SearchSpace
from megatron_bmw.planner.spec import RunSpec

SEQ, VOCAB, CLUSTER, PEAK = 4096, 131072, "h100-80g-ib", 989e12
# model, heads, hidden, layers, tp, pp, dp, GPUs, global batch, published teraFLOP/s per GPU
TABLE = [
    ("1.7B", 16, 2048, 24, 1, 1, 48, 48, 192, 408.8),
    ("7.1B", 32, 4096, 30, 2, 1, 48, 96, 192, 465.9),
    ("16B", 48, 6144, 32, 4, 1, 48, 192, 192, 489.1),
    ("32B", 56, 7168, 48, 8, 1, 48, 384, 192, 459.6),
    ("70B", 64, 8192, 84, 8, 2, 48, 768, 384, 419.7),
    ("119B", 80, 10240, 92, 8, 4, 48, 1536, 768, 420.5),
    ("177B", 96, 12288, 96, 8, 6, 48, 2304, 1152, 432.8),
    ("314B", 128, 16384, 96, 8, 8, 48, 3072, 1536, 474.4),
    ("462B", 144, 18432, 112, 8, 16, 48, 6144, 3072, 459.9),
]
# strong scaling of the 177B row: GPUs, data-parallel size, the MFU stated in the README's text
STRONG = [(96, 2, 47), (4608, 96, 42)]
MEMORY = MemorySettings(device="cuda", engine=EngineConfig("megatron-core"),
                        derived=DerivedAllowance((load_cluster(CLUSTER).groups[0].device,)))


def strong_rows() -> list[tuple]:
    """The strong-scaling ends as rows of TABLE's shape (teraFLOP/s from the stated MFU)."""
    base = next(r for r in TABLE if r[0] == "177B")
    return [(f"177B@{gpus}", *base[1:6], dp, gpus, base[8], mfu / 100 * PEAK / 1e12) for gpus, dp, mfu in STRONG]


def megatron_flops(batch: int, layers: int, hidden: int) -> float:
    """FLOPs per iteration as Megatron-LM counted them (no recomputation counted)."""
    return 72 * batch * SEQ * layers * hidden**2 * (1 + SEQ / (6 * hidden) + VOCAB / (12 * layers * hidden))


def measured_seconds(row: tuple) -> float:
    _, _, hidden, layers, _, _, _, gpus, batch, tflops = row
    return megatron_flops(batch, layers, hidden) / (tflops * 1e12 * gpus)


def model_of(row: tuple) -> ModelConfig:
    _, heads, hidden, layers = row[:4]
    return ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, vocab_size=VOCAB,
                       seq_length=SEQ, max_position_embeddings=SEQ, params_dtype="bf16", attention_backend="flash")


def stated_spec(row: tuple) -> RunSpec:
    """The published layout with what the table implies and no more: micro-batch 1, 1F1B, no recomputation."""
    _, _, _, _, tp, pp, dp, _, batch, _ = row
    return RunSpec.of(padded_model(model_of(row), VOCAB, 128, tp), tp, pp, dp,
                   PipelineConfig(micro_batch_size=1, num_microbatches=batch // dp), sequence_parallel=tp > 1,
                   distributed_optimizer=True, overlap_grad_reduce=dp > 1, overlap_param_gather=dp > 1)


def costs_of(tp: int) -> CostSettings:
    return CostSettings(engine=EngineConfig("megatron-core", tp_comm_overlap=tp > 1))


def run_row(row: tuple, tuned: bool) -> dict:
    name, _, _, _, tp, pp, dp, gpus, batch, tflops = row
    cluster = load_cluster(CLUSTER, num_nodes=gpus // 8)
    spec = stated_spec(row)
    ev = simulate_run(spec, cluster, None, costs_of(tp), MEMORY, memory_over_time=False)
    out = {"model": name, "tp": tp, "pp": pp, "dp": dp, "gpus": gpus, "global_batch": batch,
           "published_tflops": tflops, "measured_s": measured_seconds(row),
           "stated_s": ev.simulation.iteration_time,
           "stated_fits": all(m.peak_bytes <= stage_capacity(spec, cluster, s) for s, m in enumerate(ev.memory))}
    if tuned:
        space = SearchSpace(tp=(tp,), pp=(pp,), dp=(dp,)).for_engine("megatron-core")
        started = time.process_time()
        best = search(model_of(row), VOCAB, 128, batch, cluster, None, space, costs_of(tp), MEMORY,
                      SearchSettings(top_k=1)).best
        out["search_cpu_s"] = time.process_time() - started
        if best is not None:
            s = best.spec
            v = s.pipeline.virtual_stages
            out["tuned_s"] = best.time
            out["tuned_plan"] = (f"mbs {s.pipeline.micro_batch_size} {s.pipeline.schedule}"
                                 f"{'' if v == 1 else ' v' + str(v)} rc {sum(1 for x in s.pipeline.recompute or () if x)}")
    return out


def error(pred: float | None, measured: float) -> float | None:
    return None if pred is None else pred / measured - 1


def run_block(title: str, rows: list[tuple], tuned: bool) -> list[dict]:
    """Run and print `rows` under `title`, with the median errors of the stated and the tuned plans."""
    print(f"{title}\n{'model':>9} {'tp':>2} {'pp':>2} {'dp':>2} {'GPUs':>4} {'batch':>5} | {'measured':>8} | "
          f"{'stated':>7} {'error':>6} {'fits':>4} | {'tuned':>7} {'error':>6} {'plan':<24} {'cpu s':>5}")
    results = []
    for row in rows:
        r = run_row(row, tuned)
        results.append(r)
        e1, e2 = error(r["stated_s"], r["measured_s"]), error(r.get("tuned_s"), r["measured_s"])
        picked = (f"{r['tuned_s']:7.3f} {100 * e2:+5.1f}% {r['tuned_plan']:<24} {r['search_cpu_s']:5.1f}"
                  if e2 is not None else f"{'-':>7} {'':>6} {'none fits' if tuned else '(no search)':<24}")
        print(f"{r['model']:>9} {r['tp']:>2} {r['pp']:>2} {r['dp']:>2} {r['gpus']:>4} {r['global_batch']:>5} | "
              f"{r['measured_s']:8.3f} | {r['stated_s']:7.3f} {100 * e1:+5.1f}% {'yes' if r['stated_fits'] else 'NO':>4}"
              f" | {picked}", flush=True)
    for key, label in (("stated_s", "as stated (mbs 1, 1F1B, no recomputation)"), ("tuned_s", "tuned")):
        errs = [error(r[key], r["measured_s"]) for r in results if r.get(key) is not None]
        if errs:
            print(f"{label}: median |error| {100 * statistics.median(abs(e) for e in errs):.1f}%, median signed "
                  f"{100 * statistics.median(errs):+.1f}% over {len(errs)} rows")
    print()
    return results


@exit_on_usage_error
def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--rows", default=None, help="the models to run, e.g. 1.7B,177B (default: all)")
    ap.add_argument("--no-tuned", action="store_true", help="only the stated plans (no search)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    every = TABLE + strong_rows()
    rows = every
    if args.rows is not None:
        chosen = names("--rows", args.rows, [r[0] for r in every])
        rows = [r for r in every if r[0] in chosen]
    output_files(json=args.json)
    results = []
    for title, block in (("weak scaling (the README's table)", [r for r in rows if r in TABLE]),
                         ("strong scaling of 177B at batch 1152 (the README's text)", [r for r in rows if r not in TABLE])):
        if block:
            results += run_block(title, block, not args.no_tuned)
    print("measured: the table's FLOPs over its teraFLOP/s x GPUs (s per iteration); error: predicted / measured - 1")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
