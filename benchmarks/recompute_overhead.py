"""What full recomputation costs the host: a GPT unit's forward and backward, tiny so that the device's work is
nothing and the host's is all, without recomputation, with parallel/recompute.checkpoint (reentrant) and with
torch's non-reentrant checkpoint (what it used before), medians of interleaved rounds.

    python benchmarks/recompute_overhead.py [--hidden 16] [--repeats 300] [--rounds 5]

On a GPU a small model's step is bound by these host costs (the GPU check's `planner` step: full recomputation
cost 2.2x at micro-batch 2 with torch's checkpoint); the planner counts one more forward.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.args import UsageError, count, exit_on_usage_error, parser  # noqa: E402
from benchmarks.common import format_table  # noqa: E402
from megatron_bmw.config import ModelConfig  # noqa: E402
from megatron_bmw.models import gpt  # noqa: E402
from megatron_bmw.models.chunk import build_units  # noqa: E402
from megatron_bmw.parallel import recompute  # noqa: E402
from megatron_bmw.parallel.state import ParallelState  # noqa: E402


def _seconds(unit, batch, shape, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        x = torch.randn(*shape, requires_grad=True)
        t0 = time.perf_counter()
        y = unit(x, batch)
        torch.autograd.backward(y, torch.ones_like(y))
        times.append(time.perf_counter() - t0)
    return statistics.median(times[repeats // 5:])


@exit_on_usage_error
def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--hidden", type=count(1), default=16)
    ap.add_argument("--seq", type=count(1), default=8)
    ap.add_argument("--repeats", type=count(1), default=300)
    ap.add_argument("--rounds", type=count(1), default=5)
    args = ap.parse_args()
    if args.hidden % 2:
        raise UsageError(f"--hidden {args.hidden}: must be even (the unit has 2 attention heads)")
    torch.set_num_threads(1)
    cfg = ModelConfig(num_layers=1, hidden_size=args.hidden, num_attention_heads=2, vocab_size=64,
                      seq_length=args.seq, hidden_dropout=0.1, attention_dropout=0.1)
    units = build_units(cfg, ParallelState.serial(torch.device("cpu")), 1)
    batch = {"tokens": torch.zeros(1, args.seq, dtype=torch.long)}
    shape = (args.seq, 1, args.hidden)
    variants = {"none": (None, recompute.checkpoint), "reentrant": ("full", recompute.checkpoint),
                "torch non-reentrant": ("full", recompute._non_reentrant)}
    rows = []
    for name in ("attn_0", "mlp_0"):
        unit = units[name]
        samples = {v: [] for v in variants}
        for _ in range(args.rounds):
            for v, (mode, fn) in variants.items():
                unit.recompute, gpt.checkpoint = mode, fn
                samples[v].append(_seconds(unit, batch, shape, args.repeats))
        gpt.checkpoint = recompute.checkpoint
        med = {v: statistics.median(s) for v, s in samples.items()}
        rows.append([name, *(med[v] * 1e6 for v in variants), med["reentrant"] / med["none"],
                     med["torch non-reentrant"] / med["none"]])
    print(f"host microseconds per forward + backward (hidden {args.hidden}, seq {args.seq}, dropout on)")
    print(format_table(["unit", *variants, "reentrant/none", "torch/none"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
