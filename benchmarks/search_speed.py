"""How long `autoconfig.py search` takes, against the issue's targets (CPU seconds of this process, one core).

    AMP's GPT-2 case: 24 layers, hidden 1024, 16 T4 (aws-g4dn.12xlarge x 4), global batch 32     target 5 s
    GPT-3 175B: 96 layers, hidden 12288, 1024 A100-80GB (128 DGX nodes), global batch 1536      target 60 s
    BERT-large size: 24 layers, hidden 1024, sequence 512, 8 A100-80GB, global batch 256        target 3 s
    Llama-7B size: 32 layers, hidden 4096, FFN 11008, sequence 2048, 8 A100-80GB, batch 64      target 3 s
    Layer scaling: GPT-3's layer shape with 12, 24, 48, 96 layers, 64 A100-80GB (8 nodes), batch 128:
    the "linear" column is CPU s per layer over the 12-layer case's; 96 layers' target is 8 x 12 layers'

Analytic unit times, the default space and settings (as `autoconfig.py search` runs them). AMP's own search
took about 540 s on the GPT-2 case. Each case runs `--repeats` times; the median CPU time (time.process_time, so
other load on the machine does not count) is reported, with the layouts solved, pruned by their bound and
infeasible (they add up to the layouts; option combinations are counted apart, as candidates) and "same": whether
every repeat gave the same plans and counts.

    python benchmarks/search_speed.py [--repeats 3] [--cases gpt2,bert,llama,gpt3,l12,l24,l48,l96]
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

from benchmarks.args import count, exit_on_usage_error, names, output_files, parser  # noqa: E402
from megatron_bmw.config import ModelConfig
from megatron_bmw.planner.cluster import load_cluster
from megatron_bmw.planner_args import CUDA_FRAGMENTATION, CUDA_WORKSPACE_GB
from megatron_bmw.planner.memory_model import MemorySettings
from megatron_bmw.planner.search import SearchSettings, search
from megatron_bmw.planner.space import SearchSpace
from megatron_bmw.planner.cost_model import CostSettings

CASES = {
    "gpt2": (dict(num_layers=24, hidden_size=1024, num_attention_heads=16, seq_length=1024, params_dtype="fp16"),
             52256, "aws-g4dn.12xlarge", 4, 32, 5.0),
    "bert": (dict(num_layers=24, hidden_size=1024, num_attention_heads=16, seq_length=512, params_dtype="fp16"),
             30522, "a100-80g-ib", 1, 256, 3.0),
    "llama": (dict(num_layers=32, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=11008, seq_length=2048,
                   params_dtype="bf16"), 32000, "a100-80g-ib", 1, 64, 3.0),
    "gpt3": (dict(num_layers=96, hidden_size=12288, num_attention_heads=96, seq_length=2048, params_dtype="bf16"),
             51200, "a100-80g-ib", 128, 1536, 60.0),
}
_GPT3_LAYER = dict(hidden_size=12288, num_attention_heads=96, seq_length=2048, params_dtype="bf16")
for _layers in (12, 24, 48, 96):  # targets: 96 layers within 8 x the 12-layer case (set when that case ran)
    CASES[f"l{_layers}"] = (dict(num_layers=_layers, **_GPT3_LAYER), 51200, "a100-80g-ib", 8, 128, None)


@exit_on_usage_error
def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--repeats", type=count(1), default=3)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--dump", help="write every case's ranked plans, counts and CPU times to this JSON file "
                                   "(to compare two versions' plans)")
    args = ap.parse_args()
    cases = names("--cases", args.cases, CASES)
    output_files(dump=args.dump)
    memory = MemorySettings(device="cuda", workspace_bytes=CUDA_WORKSPACE_GB * 2**30, fragmentation=CUDA_FRAGMENTATION)
    print(f"{'case':<6} {'GPUs':>5} {'CPU s':>7} {'target':>6} {'met':>4} {'layouts':>7} {'solved':>6} "
          f"{'pruned':>6} {'infeas':>6} {'unsolved':>8} {'cands':>6} {'sims':>5} {'same':>4} {'linear':>6}  best plan")
    per_layer = {}  # CPU s per layer of the layer-scaling cases
    dump = {}
    for name in cases:
        shape, vocab, cluster_name, nodes, batch, target = CASES[name]
        model = ModelConfig(vocab_size=vocab, **shape)
        cluster = load_cluster(cluster_name, num_nodes=nodes)
        times, outcomes = [], []
        for _ in range(args.repeats):
            started = time.process_time()
            result = search(model, vocab, 128, batch, cluster, None, SearchSpace(), CostSettings(), memory,
                            SearchSettings())
            times.append(time.process_time() - started)
            outcomes.append(([(r.spec, r.time) for r in result.ranked],
                             {k: v for k, v in result.stats.items() if not k.endswith("_s")}))
        median = statistics.median(times)
        st, best = result.stats, result.best.spec
        unsolved = st["layouts"] - st["solved"] - st["pruned"] - st["infeasible"]
        same = all(o == outcomes[0] for o in outcomes)
        plan = (f"tp {best.tp} pp {best.pp} dp {best.dp} mbs {best.pipeline.micro_batch_size} "
                f"{best.pipeline.schedule}{'' if best.pipeline.virtual_stages == 1 else ' v' + str(best.pipeline.virtual_stages)} "
                f"{result.best.time:.3f} s")
        linear = "-"
        if name.startswith("l") and name[1:].isdigit():
            per_layer[model.num_layers] = median / model.num_layers
            if 12 in per_layer:
                linear = f"{per_layer[model.num_layers] / per_layer[12]:.2f}"
                if model.num_layers > 12:  # 96 layers: 8 x the 12-layer case, fewer in proportion
                    target = 8 * 12 * per_layer[12] * model.num_layers / 96
        met = "-" if target is None else "yes" if median <= target and unsolved == 0 else "NO"
        shown = "-" if target is None else f"{target:.0f}"
        dump[name] = {"cpu_s": times, "stats": outcomes[0][1],
                      "ranked": [(repr(spec), t) for spec, t in outcomes[0][0]]}
        print(f"{name:<6} {cluster.num_gpus:>5} {median:7.2f} {shown:>6} {met:>4} "
              f"{st['layouts']:>7} {st['solved']:>6} {st['pruned']:>6} {st['infeasible']:>6} {unsolved:>8} "
              f"{st['candidates']:>6} {st['simulated']:>5} {'yes' if same else 'NO':>4} {linear:>6}  {plan}")
    if args.dump:
        with open(args.dump, "w") as f:
            json.dump(dump, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
