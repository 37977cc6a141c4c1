"""The kernel fusions that stand in for Transformer Engine's (issue #52) on a Llama-style GPT: fused SwiGLU and
rope (--no-bias-swiglu-fusion / --no-rope-fusion turn them off) and the fused cross entropy
(--cross-entropy-loss-fusion), each against the unfused path in the same run: ms per forward and backward (medians
of interleaved rounds), the activation bytes autograd keeps (saved-tensor hooks), the memory model's count of the
same, and the largest gradient difference from the unfused model.

    python benchmarks/fusions.py [--hidden 512] [--layers 4] [--seq 512] [--mbs 2] [--vocab 32000] [--rounds 5]
                                 [--device cuda --dtype bf16]

On the CPU the fused ops run eagerly (their saving is memory: each keeps only its input); on CUDA their pointwise
bodies are compiled by inductor (fused.cuda_compiled), which is where their speed shows. The GPU check's `fusions`
step measures whole training runs (docs/gpu.md).
"""

from __future__ import annotations

import os
import statistics
import sys
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.args import count, parser  # noqa: E402
from benchmarks.common import format_table, torch_device  # noqa: E402
from megatron_bmw.config import ModelConfig  # noqa: E402
from megatron_bmw.device import timed  # noqa: E402
from megatron_bmw.errors import UsageError, exit_on_usage_error  # noqa: E402
from megatron_bmw.models.chunk import ModelChunk, build_units  # noqa: E402
from megatron_bmw.parallel.state import ParallelState  # noqa: E402
from megatron_bmw.planner.unit_activations import unit_activation_bytes  # noqa: E402
from megatron_bmw.training.saved_bytes import measure_saved  # noqa: E402
from megatron_bmw.units import unit_kind_of, unit_names  # noqa: E402

OFF = dict(bias_swiglu_fusion=False, apply_rope_fusion=False, cross_entropy_loss_fusion=False)
VARIANTS = [("unfused", OFF), ("swiglu+rope", dict(OFF, bias_swiglu_fusion=True, apply_rope_fusion=True)),
            ("all (+cross entropy)", dict(bias_swiglu_fusion=True, apply_rope_fusion=True,
                                          cross_entropy_loss_fusion=True))]


def _model_config(args) -> ModelConfig:
    heads = max(2, args.hidden // 64)
    if args.hidden % heads or heads % 2:
        raise UsageError(f"--hidden {args.hidden}: needs an even number of 64-wide heads")
    return ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=heads,
                       num_query_groups=heads // 2, vocab_size=args.vocab, seq_length=args.seq, hidden_dropout=0.0,
                       attention_dropout=0.0, position_embedding_type="rope", swiglu=True, normalization="RMSNorm",
                       add_bias_linear=False, untie_embeddings_and_output_weights=True, params_dtype=args.dtype)


def _modelled_bytes(cfg: ModelConfig, mbs: int, device: str) -> int:
    return sum(unit_activation_bytes(unit_kind_of(cfg, name), cfg, mbs, device=device)
               for name in unit_names(cfg.num_layers))


@exit_on_usage_error
def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    for name, default in (("hidden", 512), ("layers", 4), ("seq", 512), ("mbs", 2), ("vocab", 32000), ("rounds", 5)):
        ap.add_argument(f"--{name}", type=count(1), default=default)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="fp32")
    args = ap.parse_args(argv)
    device = torch_device(args.device)
    base = _model_config(args)
    state = ParallelState.serial(device)
    tokens = torch.randint(0, args.vocab, (args.mbs, args.seq + 1), generator=torch.Generator().manual_seed(0))
    batch = {"tokens": tokens[:, :-1].to(device), "labels": tokens[:, 1:].to(device),
             "loss_mask": torch.ones(args.mbs, args.seq, device=device)}
    runs = {}
    for name, flags in VARIANTS:
        cfg = replace(base, **flags)
        torch.manual_seed(0)
        model = ModelChunk(build_units(cfg, state, 1))
        saved, loss = measure_saved(lambda m=model: m(None, batch), exclude=list(model.parameters()))
        loss.backward()
        grads = [p.grad.float().clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        runs[name] = {"cfg": cfg, "model": model, "saved": saved.total, "grads": grads, "times": []}
    for _ in range(args.rounds + 1):  # interleaved; the first round warms up
        for run in runs.values():
            run["times"].append(timed(lambda m=run["model"]: m(None, batch).backward(), device)[0])
    base_run = runs[VARIANTS[0][0]]
    rows = []
    for name, run in runs.items():
        ms = statistics.median(run["times"][1:]) * 1e3
        diff = max((a - b).abs().max().item() for a, b in zip(run["grads"], base_run["grads"]))
        rows.append([name, ms, statistics.median(base_run["times"][1:]) * 1e3 / ms, run["saved"] / 2**20,
                     _modelled_bytes(run["cfg"], args.mbs, device.type) / 2**20, f"{diff:.2g}"])
    print(f"Llama-style GPT: {args.layers} layers, hidden {args.hidden}, seq {args.seq}, mbs {args.mbs}, vocabulary "
          f"{args.vocab}, {args.dtype} on {device}")
    print(format_table(["variant", "ms fwd+bwd", "speed-up", "saved MiB", "modelled MiB", "max grad diff"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
