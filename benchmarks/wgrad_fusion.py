"""Gradient-accumulation fusion (parallel/wgrad_accum.py) against the unfused path: a GPT's forward and backward over
micro-batches with GradSync accumulating into fp32 main_grad, fused (Megatron's default) and with
--no-gradient-accumulation-fusion, medians of interleaved rounds; the gradients of both are compared too.

    python benchmarks/wgrad_fusion.py [--hidden 512] [--layers 4] [--seq 256] [--mbs 2] [--micro 4] [--rounds 5]
                                      [--device cuda --dtype bf16]

Unfused, each linear weight's gradient is written in the parameter's dtype and added into main_grad by a hook
(read e, read and write 4 bytes per parameter per micro-batch); fused, the weight-gradient GEMM adds into
main_grad itself. The planner counts e + 8 bytes per parameter and micro-batch without fusion and none with it.
"""

from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.args import count, parser  # noqa: E402
from benchmarks.common import format_table, torch_device  # noqa: E402
from megatron_bmw.config import ModelConfig  # noqa: E402
from megatron_bmw.device import timed  # noqa: E402
from megatron_bmw.errors import UsageError, exit_on_usage_error  # noqa: E402
from megatron_bmw.models.chunk import ModelChunk, build_units  # noqa: E402
from megatron_bmw.parallel import wgrad_accum  # noqa: E402
from megatron_bmw.parallel.grad_sync import GradSync  # noqa: E402
from megatron_bmw.parallel.state import ParallelState  # noqa: E402



def _step_seconds(model, sync: GradSync, batches: list, device: torch.device) -> float:
    sync.zero()
    return timed(lambda: [(model(None, b) / len(batches)).backward() for b in batches], device)[0]


@exit_on_usage_error
def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--hidden", type=count(1), default=512)
    ap.add_argument("--layers", type=count(1), default=4)
    ap.add_argument("--seq", type=count(1), default=256)
    ap.add_argument("--mbs", type=count(1), default=2)
    ap.add_argument("--micro", type=count(1), default=4, help="micro-batches per step")
    ap.add_argument("--rounds", type=count(1), default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="fp32")
    args = ap.parse_args(argv)
    device = torch_device(args.device)
    if device.type == "cpu" and args.dtype != "fp32":
        raise UsageError("--dtype: 16-bit runs need --device cuda (the CPU path is fp32)")
    heads = max(1, args.hidden // 64)
    if args.hidden % heads:
        raise UsageError(f"--hidden {args.hidden}: not divisible by its {heads} attention heads (one per 64)")
    cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=heads,
                      vocab_size=1024, seq_length=args.seq, hidden_dropout=0.0, attention_dropout=0.0,
                      params_dtype=args.dtype)
    state = ParallelState.serial(device)
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(args.micro):
        tokens = torch.randint(0, cfg.vocab_size, (args.mbs, args.seq + 1), generator=g)
        batches.append({"tokens": tokens[:, :-1].to(device), "labels": tokens[:, 1:].to(device),
                        "loss_mask": torch.ones(args.mbs, args.seq, device=device)})
    runs = {}
    for fused in (True, False):
        model = ModelChunk(build_units(cfg, state, 1))
        runs[fused] = (model, GradSync(list(model.parameters()), state, fusion=fused), [])
    for _ in range(args.rounds + 1):  # the first round warms up
        for fused, (model, sync, times) in runs.items():
            times.append(_step_seconds(model, sync, batches, device))
    med = {fused: statistics.median(times[1:]) for fused, (_, _, times) in runs.items()}
    diff = max((a.main_grad - b.main_grad).abs().max().item() for a, b in
               zip(runs[True][0].parameters(), runs[False][0].parameters()))
    params = sum(p.numel() for p in runs[True][0].parameters())
    kernel = wgrad_accum.kernel(next(runs[True][0].parameters()).dtype, device)
    print(f"{args.layers} layers, hidden {args.hidden}, seq {args.seq}, mbs {args.mbs}, {args.micro} micro-batches, "
          f"{params / 1e6:.1f}M parameters, {args.dtype} on {device}; fused kernel: {kernel}")
    print(format_table(["path", "ms per step", "ratio to unfused"],
                       [["fused", med[True] * 1e3, med[True] / med[False]],
                        ["unfused", med[False] * 1e3, 1.0]]))
    print(f"max |main_grad fused - unfused|: {diff:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
