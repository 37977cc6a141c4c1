"""One-GPU GPT training: our runtime against megatron-core on the same model, batch and recomputation.

    python benchmarks/megatron_core_peer.py [--peers ours,mcore] [--iters 30] [--json F] -- <pretrain_gpt.py flags>
    python benchmarks/megatron_core_peer.py                # a 350M GPT, micro-batch 4, 8 micro-batches

The flags after `--` are pretrain_gpt.py's model and batch flags (--bf16 is added); both sides train on random
tokens from them. Ours runs `python -m megatron_bmw.trials.entry` (pretrain_gpt.py plus its peak-memory line).
The peer is megatron-core when importable (a pip wheel; it is not a dependency): its GPTModel from the local spec
(no Transformer Engine or apex), its core attention replaced by torch SDPA as our `--attention-backend flash`,
bf16 through Float16Module, fp32 gradient buffers through its DistributedDataParallel, Adam through
get_megatron_optimizer, the forward_backward_no_pipelining schedule. Without Transformer Engine or apex neither
side fuses weight-gradient accumulation or layer norms. Prints ms per iteration (median after the warm-up),
TFLOP/s by Megatron's count, MFU against the GPU's dense bf16 peak, the peak allocated memory, and ours/peer.
GPT-2 style models only (LayerNorm, GeLU, learned positions, tied embeddings). Needs CUDA; `--allow-cpu` runs the
same code on the CPU (fp32, for the tests).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.args import count, output_files, parser  # noqa: E402
from megatron_bmw.errors import UsageError, exit_on_usage_error  # noqa: E402

DEFAULT_FLAGS = ["--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "2048",
                 "--max-position-embeddings", "2048", "--vocab-size", "50257", "--micro-batch-size", "4",
                 "--global-batch-size", "32"]
FIXED_FLAGS = ["--mock-data", "--hidden-dropout", "0", "--attention-dropout", "0", "--make-vocab-size-divisible-by",
               "128", "--attention-backend", "flash", "--seed", "1234", "--lr", "1e-4", "--weight-decay", "0.01",
               "--clip-grad", "1.0", "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000000",
               "--log-throughput"]
PEERS = ("ours", "mcore")


def model_config(flags: list[str]):
    """Our ModelConfig and batch sizes for `flags` (as pretrain_gpt.py parses them, world size 1)."""
    from megatron_bmw.arguments import build_parser, configs_from_args, parse_args

    args = parse_args([*flags], build_parser())
    cfgs = configs_from_args(args, 1)
    m = cfgs.model
    if (m.swiglu or m.normalization != "LayerNorm" or m.position_embedding_type != "learned_absolute"
            or m.untie_embeddings_and_output_weights or not m.add_bias_linear
            or (m.num_query_groups or m.num_attention_heads) != m.num_attention_heads or m.model_type != "gpt"):
        raise UsageError("megatron_core_peer.py: GPT-2 style models only (LayerNorm, GeLU, learned positions, tied "
                         "embeddings, biases, no GQA)")
    recompute = args.recompute_granularity or ("selective" if args.recompute_activations else None)
    return m, args.micro_batch_size, args.global_batch_size, recompute


def _median_after(times: list[float], warmup: int) -> float:
    kept = times[warmup:] or times
    return statistics.median(kept)


# ---- ours ---------------------------------------------------------------------------------------------------------
def run_ours(flags: list[str], iters: int, warmup: int, timeout_s: float) -> dict:
    from megatron_bmw.trials.logparse import parse_log

    argv = [sys.executable, "-m", "megatron_bmw.trials.entry", *flags, "--train-iters", str(iters)]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1")
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    out = proc.stdout + proc.stderr
    summary = parse_log(out)
    if proc.returncode != 0 or not summary.iterations:
        raise RuntimeError(f"ours exited {proc.returncode}: {summary.error or out[-2000:]}")
    times = [it["elapsed_ms"] / 1e3 for it in summary.iterations]
    losses = [it["lm_loss"] for it in summary.iterations if "lm_loss" in it]
    count = re.search(r"number of parameters on .*: (\d+)", out)
    return {"seconds": _median_after(times, warmup), "peak_bytes": summary.peak_memory_bytes,
            "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
            "parameters": int(count.group(1)) if count else None}


# ---- megatron-core ------------------------------------------------------------------------------------------------
def _sdpa_attention_class():
    import torch.nn.functional as F
    from megatron.core.transformer.module import MegatronModule

    class SDPAttention(MegatronModule):
        """megatron-core's core-attention interface ([s, b, np, hn] in, [s, b, np*hn] out) on torch SDPA, causal."""

        def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                     softmax_scale=None, cp_comm_type=None, pg_collection=None):
            super().__init__(config=config)
            self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
            self.softmax_scale = softmax_scale

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, np, s, hn]
            ctx = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                                 is_causal=True, scale=self.softmax_scale)
            s, b = query.shape[0], query.shape[1]
            return ctx.permute(2, 0, 1, 3).reshape(s, b, -1)

    return SDPAttention


def run_mcore(flags: list[str], iters: int, warmup: int, allow_cpu: bool) -> dict:
    """megatron-core's training step on `flags`' model in this process (world size 1)."""
    import datetime
    from functools import partial

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_bmw.device import free_port

    m, mbs, gbs, recompute = model_config(flags)
    cuda = torch.cuda.is_available()
    if not cuda and not allow_cpu:
        raise UsageError("megatron_core_peer.py: megatron-core's side needs CUDA (--allow-cpu for the tests)")
    bf16 = True  # as on the GPU (its optimizer paths are the ones the comparison is about)
    if not cuda:  # megatron-core's gradient buffers ask for torch.cuda.current_device(): the CPU stands in (tests)
        torch.cuda.current_device = lambda: "cpu"
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1, timeout=datetime.timedelta(minutes=5))
    parallel_state.initialize_model_parallel(1, 1)
    if cuda:
        torch.cuda.set_device(0)
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)
    dtype = torch.bfloat16 if bf16 else torch.float32
    recompute_kw = {}
    if recompute == "selective":
        recompute_kw = {"recompute_granularity": "selective"}
    elif recompute == "full":
        recompute_kw = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    config = TransformerConfig(
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
        ffn_hidden_size=m.ffn_hidden_size, hidden_dropout=0.0, attention_dropout=0.0, layernorm_epsilon=1e-5,
        init_method_std=m.init_method_std, normalization="LayerNorm", add_bias_linear=True, gated_linear_unit=False,
        activation_func=F.gelu, bias_activation_fusion=True, bias_dropout_fusion=True, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        bf16=bf16, params_dtype=dtype, pipeline_dtype=dtype, use_cpu_initialization=not cuda, **recompute_kw)
    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = _sdpa_attention_class()
    model = GPTModel(config, spec, vocab_size=m.vocab_size, max_sequence_length=m.seq_length,
                     share_embeddings_and_output_weights=True, position_embedding_type="learned_absolute")
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    model.to(device)
    if bf16:
        model = Float16Module(config, model)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                                        use_distributed_optimizer=False), model)
    opt_config = OptimizerConfig(optimizer="adam", lr=1e-4, weight_decay=0.01, bf16=bf16, params_dtype=dtype,
                                 clip_grad=1.0)
    optimizer = get_megatron_optimizer(opt_config, [ddp]) if cuda else None  # its optimizers are CUDA-only
    params = sum(p.numel() for p in ddp.parameters())
    generator = torch.Generator(device=device).manual_seed(1234)
    positions = torch.arange(m.seq_length, device=device).unsqueeze(0).expand(mbs, -1)

    def batches():
        while True:
            tokens = torch.randint(0, m.vocab_size, (mbs, m.seq_length + 1), device=device, generator=generator)
            yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def loss_func(output):
        loss = output.float().mean()
        return loss, {"lm loss": loss.detach().clone()}  # its schedule divides `loss` in place

    def forward_step(data_iterator, model):
        tokens, labels = next(data_iterator)
        return model(tokens, positions, None, labels=labels), partial(loss_func)

    config.finalize_model_grads_func = finalize_model_grads  # as Megatron-LM's training loop sets it
    forward_backward = get_forward_backward_func()
    data = batches()
    times, losses = [], []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for _ in range(iters):
        t0 = time.perf_counter()
        ddp.zero_grad_buffer()
        if optimizer is not None:
            optimizer.zero_grad()
        if cuda:
            reduced = forward_backward(forward_step_func=forward_step, data_iterator=data, model=[ddp],
                                       num_microbatches=gbs // mbs, seq_length=m.seq_length, micro_batch_size=mbs,
                                       forward_only=False)
        else:  # its schedules are CUDA-only too: the same forward step, backward by hand
            reduced = []
            for _ in range(gbs // mbs):
                output, loss_fn = forward_step(data, ddp)
                loss, logged = loss_fn(output)
                (loss / (gbs // mbs)).backward()
                reduced.append(logged)
        if optimizer is not None:
            optimizer.step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(sum(r["lm loss"] for r in reduced) / len(reduced)))
    peak = torch.cuda.max_memory_allocated() if cuda else None
    dist.destroy_process_group()
    import megatron.core

    return {"seconds": _median_after(times, warmup), "peak_bytes": peak, "first_loss": losses[0],
            "last_loss": losses[-1], "parameters": params, "version": getattr(megatron.core, "__version__", "?")}


def run_mcore_child(flags: list[str], iters: int, warmup: int, allow_cpu: bool, timeout_s: float) -> dict:
    """run_mcore in a child process (its own CUDA context and allocator; a crash stays there)."""
    argv = [sys.executable, os.path.abspath(__file__), "--mcore-worker", "--iters", str(iters), "--warmup",
            str(warmup), *(["--allow-cpu"] if allow_cpu else []), "--", *flags]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1")
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    marker = "MCORE_RESULT "
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(marker)), None)
    if proc.returncode != 0 or line is None:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
        raise RuntimeError(f"megatron-core exited {proc.returncode}: " + " / ".join(tail))
    return json.loads(line[len(marker):])


def mcore_available() -> str | None:
    """None when megatron-core imports, else why not (one line)."""
    try:
        import megatron.core  # noqa: F401
        from megatron.core.models.gpt import GPTModel  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any failure means the peer cannot run
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


# ---- the comparison -----------------------------------------------------------------------------------------------
def peak_tflops() -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    from tools.gpu_check_steps import peak_bf16_tflops

    return peak_bf16_tflops(torch.cuda.get_device_name(0))


def compare(flags: list[str], peers: list[str], iters: int, warmup: int, allow_cpu: bool,
            timeout_s: float = 300.0) -> dict:
    """Each peer's row (or its error), and ours/mcore ratios when both ran."""
    from megatron_bmw.training.logging import gpt_train_flops

    import torch

    m, mbs, gbs, recompute = model_config(flags)
    flops = gpt_train_flops(m, gbs)
    peak = peak_tflops()
    rows: dict[str, dict] = {}
    for peer in peers:
        try:
            if peer == "ours":
                row = run_ours(flags, iters, warmup, timeout_s)
            else:
                why = mcore_available()
                if why:
                    rows[peer] = {"error": f"megatron-core not importable ({why})"}
                    continue
                row = run_mcore_child(flags, iters, warmup, allow_cpu, timeout_s)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            rows[peer] = {"error": str(exc)[:1500]}
            continue
        row["tflops"] = flops / row["seconds"] / 1e12
        if peak:
            row["mfu_pct"] = 100 * row["tflops"] / peak
        rows[peer] = row
    result = {"model": {"layers": m.num_layers, "hidden": m.hidden_size, "heads": m.num_attention_heads,
                        "seq": m.seq_length, "vocab": m.vocab_size, "mbs": mbs, "gbs": gbs,
                        "recompute": recompute or "none"},
              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
              "peak_bf16_tflops": peak, "rows": rows}
    ours, peer = rows.get("ours", {}), rows.get("mcore", {})
    if "seconds" in ours and "seconds" in peer:
        result["ours_over_mcore_time"] = ours["seconds"] / peer["seconds"]
        if ours.get("peak_bytes") and peer.get("peak_bytes"):
            result["ours_over_mcore_memory"] = ours["peak_bytes"] / peer["peak_bytes"]
    return result


def format_result(result: dict) -> str:
    from benchmarks.common import format_table

    def cell(row: dict, key: str, scale: float = 1.0):
        return row[key] * scale if row.get(key) is not None else "-"

    rows = []
    for name, row in result["rows"].items():
        if "error" in row:
            rows.append([name, "failed", "-", "-", "-", "-", row["error"][:120]])
            continue
        rows.append([name, cell(row, "seconds", 1e3), cell(row, "tflops"), cell(row, "mfu_pct"),
                     cell(row, "peak_bytes", 2**-30), f"{row['first_loss']:.3f} -> {row['last_loss']:.3f}", ""])
    m = result["model"]
    head = (f"GPT {m['layers']} layers, hidden {m['hidden']}, {m['heads']} heads, seq {m['seq']}, vocab {m['vocab']}, "
            f"micro-batch {m['mbs']}, global batch {m['gbs']}, recompute {m['recompute']} on {result['device']}")
    lines = [head, format_table(["peer", "ms/iter", "TFLOP/s", "MFU %", "peak GiB", "loss", "note"], rows)]
    for key in ("ours_over_mcore_time", "ours_over_mcore_memory"):
        if key in result:
            lines.append(f"{key}: {result[key]:.3f}")
    return "\n".join(lines)


@exit_on_usage_error
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    flags = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    ap = parser(__doc__, prog="megatron_core_peer.py",
                epilog="-- <pretrain_gpt.py flags>: after `--`, the model and batch flags both sides train with "
                       "(default: a 350M GPT, micro-batch 4, 8 micro-batches)")
    ap.add_argument("--peers", default="ours,mcore", help="comma-separated subset of ours,mcore")
    ap.add_argument("--iters", type=count(1), default=30)
    ap.add_argument("--warmup", type=count(0), default=5, help="iterations left out of the median")
    ap.add_argument("--timeout-s", type=float, default=300.0, help="each peer's time limit")
    ap.add_argument("--json", default=None, help="also write the result here")
    ap.add_argument("--allow-cpu", action="store_true", help="run on the CPU in fp32 (tests)")
    ap.add_argument("--mcore-worker", action="store_true", help=argparse.SUPPRESS)
    ap.usage = ap.format_usage().removeprefix("usage: ").rstrip() + " [-- <pretrain_gpt.py flags>]"
    args = ap.parse_args(own)
    peers = args.peers.split(",")
    if any(p not in PEERS for p in peers):
        raise UsageError(f"--peers {args.peers!r}: choose from {','.join(PEERS)}")
    if not args.timeout_s > 0:
        raise UsageError(f"--timeout-s {args.timeout_s}: must be > 0")
    output_files(json=args.json)
    flags = [*FIXED_FLAGS, *(flags or DEFAULT_FLAGS)]
    import torch

    if torch.cuda.is_available():
        flags.append("--bf16")
    elif not args.allow_cpu:
        raise UsageError("megatron_core_peer.py needs a CUDA GPU (--allow-cpu runs it on the CPU for the tests)")
    model_config(flags)  # bad flags fail here, in one line
    if args.mcore_worker:
        print("MCORE_RESULT " + json.dumps(run_mcore(flags, args.iters, args.warmup, args.allow_cpu)), flush=True)
        return 0
    result = compare(flags, peers, args.iters, args.warmup, args.allow_cpu, args.timeout_s)
    print(format_result(result), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if all("error" not in r for r in result["rows"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
