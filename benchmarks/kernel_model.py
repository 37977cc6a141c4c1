"""The planner's kernel model (planner/kernel_time.py, planner/elementwise.py) against the device's own kernels: every
matrix product of a transformer layer at the shapes a search compares (tensor-parallel size, micro-batch size), the
attention core (fused SDPA kernel, or the unfused batched products), the output layer's products, and the main
memory-bound kernels, each timed on the device (median of repeats; on a GPU CUDA events behind a sleep kernel that
keeps the GPU busy while the host dispatches, so a small kernel's time is its own, not the host's) beside the time
the planner gives it on the device type of the cluster file.

    python benchmarks/kernel_model.py [--models bloom,gpt3,1.3b,mcore1.7b,mcore177b] [--device cuda] [--dtype bf16]
                                      [--cluster h100-80g-ib --device-type h100-80g] [--repeats 10] [--json out.json]
    python benchmarks/kernel_model.py --small --device cpu   # tiny shapes: exercises the code, says nothing

Models (per tensor-parallel rank, sequence 2048): `bloom` BLOOM-176B's trial shape (hidden 14336, 64 heads, vocab
250880, unfused attention) at tp 4 and 8, micro-batch 1, 2, 4; `gpt3` GPT-3 175B (hidden 12288, 96 heads, vocab
51200, flash) at tp 4 and 8, micro-batch 1, 2; `1.3b` (hidden 2048, 16 heads, vocab 50304, flash) at tp 1,
micro-batch 1, 2, 4; at sequence 4096 and vocab 131072, Megatron-core's published H100 shapes, `mcore1.7b` (hidden
2048, 16 heads) at tp 1, micro-batch 1, 2, 4 and `mcore177b` (hidden 12288, 96 heads) at tp 8, micro-batch 1, 2
(the kernels are torch's, not Transformer Engine's). The GPU's name picks the device type (H100 and H200: h100-80g, H200 with its 4.8 TB/s; A100:
a100-80g or a100-40g by memory); on the CPU the h100-80g's times are printed beside CPU timings, which only
exercises the code.

Reported per kernel: measured and modelled milliseconds and their ratio; per model and layout: the layer's matrix
work (attention and MLP units, forward and backward) measured and modelled, per sample; per model: Spearman's rank
correlation of the layouts' per-sample layer time, measured against modelled (the order a search needs), and the
rate of the largest GEMM as a share of peak (the device type's `achievable_fraction` is the model's). Nothing is
fitted: the ratios say where the kernel model is wrong on this device.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from dataclasses import dataclass, replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.args import count, names, output_files, parser  # noqa: E402
from benchmarks.common import format_table, torch_device  # noqa: E402
from megatron_bmw.config import ModelConfig  # noqa: E402
from megatron_bmw.device import covered_seconds, sleep_cycles_per_s, timed  # noqa: E402
from megatron_bmw.errors import UsageError, exit_on_usage_error  # noqa: E402
from megatron_bmw.planner.cluster import DeviceType, load_cluster  # noqa: E402
from megatron_bmw.planner.cost_model import CostSettings  # noqa: E402
from megatron_bmw.planner.kernel_time import (FLASH_BACKWARD, KernelDevice, device_kernels,  # noqa: E402
                                              flash_attention_time, gemm_time)
from megatron_bmw.planner.accuracy import spearman  # noqa: E402
from megatron_bmw.units import DTYPE_BYTES  # noqa: E402

# model name -> (hidden, heads, vocab, attention backend, [(tp, micro-batch size), ...])
MODELS = {
    "bloom": (14336, 64, 250880, "unfused", [(tp, b) for tp in (4, 8) for b in (1, 2, 4)]),
    "gpt3": (12288, 96, 51200, "flash", [(tp, b) for tp in (4, 8) for b in (1, 2)]),
    "1.3b": (2048, 16, 50304, "flash", [(1, b) for b in (1, 2, 4)]),
    # Megatron-core's published H100 runs (benchmarks/megatron_core_scaling.py): the 1.7B and the 177B, sequence 4096
    "mcore1.7b": (2048, 16, 131072, "flash", [(1, b) for b in (1, 2, 4)]),
    "mcore177b": (12288, 96, 131072, "flash", [(8, b) for b in (1, 2)]),
}
SEQ = 2048
SEQ_OF = {"mcore1.7b": 4096, "mcore177b": 4096}
SMALL = {"hidden": 256, "heads": 4, "vocab": 1024, "seq": 128}
# GPU name pattern -> (cluster, device type, memory bandwidth override in bytes/s: the datasheet's, where the GPU
# has the listed type's SMs and peak but other memory); an A100 with less than 60 GB is the 40 GB one
GPUS = (("H200", "h100-80g-ib", "h100-80g", 4.8e12), ("H100", "h100-80g-ib", "h100-80g", None),
        ("A100", "a100-80g-ib", "a100-80g", None))
A100_40 = ("a100-40g-ib", "a100-40g")


@dataclass(frozen=True)
class Kernel:
    """One kernel of a layout: what it is, how the planner times it, and how to run it."""

    name: str
    category: str  # forward, input gradient, weight gradient, core forward, core backward, memory-bound
    unit: str  # attention, mlp, head (head kernels are not part of the layer sums)
    modelled_s: float
    run: object  # () -> None on prepared tensors
    flops: float = 0.0  # of a matrix product (the largest one's rate is reported)
    setup: object = None  # () -> None before each timed run, outside the timed span


def device_type_for(name: str, memory_bytes: float, cluster: str | None, device_type: str | None) -> DeviceType:
    """The cluster file's device type for this GPU (or the one named), with a datasheet bandwidth where it differs."""
    override = None
    if cluster is None or device_type is None:
        for pattern, c, d, bandwidth in GPUS:
            if pattern in name:
                if pattern == "A100" and memory_bytes < 60e9:
                    c, d = A100_40
                cluster, device_type, override = cluster or c, device_type or d, bandwidth
                break
        else:
            raise UsageError(f"no device type known for {name!r}: give --cluster and --device-type")
    dev = load_cluster(cluster).device_type(device_type)
    if dev is None:
        raise UsageError(f"--device-type: cluster {cluster} has no device type {device_type!r}")
    return replace(dev, memory_bandwidth=override) if override else dev


def _gemm(m: int, n: int, k: int, dtype, device, batch: int = 0):
    """A product [m, k] x [k, n] (batched over `batch` when > 0) and its operands."""
    shape_a, shape_b = ((batch, m, k), (batch, k, n)) if batch else ((m, k), (k, n))
    a = torch.randn(shape_a, dtype=dtype, device=device)
    b = torch.randn(shape_b, dtype=dtype, device=device)
    out = torch.empty((batch, m, n) if batch else (m, n), dtype=dtype, device=device)
    fn = torch.bmm if batch else torch.mm
    return lambda: fn(a, b, out=out)


def linear_kernels(unit: str, name: str, m: int, n: int, k: int, e: int, kd: KernelDevice, dtype, device) -> list:
    """A linear layer y[m, n] = x[m, k] W^T as kernel_time._linear times it: forward, input gradient [m, k]
    contracting n, weight gradient [k, n] contracting m."""
    flops = 2.0 * m * n * k
    return [Kernel(f"{name} fwd", "forward", unit, gemm_time(m, n, k, e, kd), _gemm(m, n, k, dtype, device), flops),
            Kernel(f"{name} dgrad", "input gradient", unit, gemm_time(m, k, n, e, kd), _gemm(m, k, n, dtype, device),
                   flops),
            Kernel(f"{name} wgrad", "weight gradient", unit, gemm_time(k, n, m, e, kd), _gemm(k, n, m, dtype, device),
                   flops)]


def _flash(b: int, heads: int, s: int, d: int, dtype, device):
    """(forward, backward, the backward's setup: its forward, outside the timed span) of the fused causal kernel."""
    q, k, v = (torch.randn(b, heads, s, d, dtype=dtype, device=device, requires_grad=True) for _ in range(3))
    grad = torch.randn(b, heads, s, d, dtype=dtype, device=device)
    state: dict = {}

    def forward():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def setup():
        q.grad = k.grad = v.grad = None
        state["out"] = F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return forward, lambda: state["out"].backward(grad), setup


def memory_kernels(s: int, b: int, h: int, heads: int, d: int, f: int, unfused: bool, e: int, rate: float,
                   dtype, device) -> list:
    """LayerNorm, GeLU, the attention context's copy from [b, heads, s, d] to [s, b, heads x d] and the unfused
    softmax over the scores [b x heads, s, s], each at the bytes elementwise.py counts for it (read once, written
    once) over the memory bandwidth's achievable share; `heads` per tensor-parallel rank."""
    tokens = s * b
    x = torch.randn(tokens, h, dtype=dtype, device=device)
    w, bias = torch.ones(h, dtype=dtype, device=device), torch.zeros(h, dtype=dtype, device=device)
    y = torch.randn(tokens, f, dtype=dtype, device=device)
    context = torch.randn(b, heads, s, d, dtype=dtype, device=device)
    out = [Kernel("LayerNorm fwd", "memory-bound", "attention", 2 * tokens * h * e / rate,
                  lambda: F.layer_norm(x, (h,), w, bias)),
           Kernel("GeLU fwd", "memory-bound", "mlp", 2 * tokens * f * e / rate, lambda: F.gelu(y, approximate="tanh")),
           Kernel("context copy", "memory-bound", "attention", 2 * tokens * heads * d * e / rate,
                  lambda: context.permute(2, 0, 1, 3).contiguous())]
    if unfused:
        p = torch.randn(b * heads, s, s, dtype=dtype, device=device)
        out.append(Kernel("softmax fwd", "memory-bound", "attention", 2 * b * heads * s * s * e / rate,
                          lambda: torch.softmax(p, dim=-1)))
    return out


def layout_kernels(model: ModelConfig, tp: int, b: int, kd: KernelDevice, rate: float, dtype, device) -> list:
    """The kernels of one layer (and the output layer) on one tensor-parallel rank, as kernel_time._unit_parts
    sums them."""
    s, h, e = model.seq_length, model.hidden_size, model.dtype_bytes
    tokens, heads, d = s * b, model.num_attention_heads // tp, model.head_dim
    out = linear_kernels("attention", "QKV", tokens, model.qkv_rows // tp, h, e, kd, dtype, device)
    if model.flash_attention:
        f = flash_attention_time(b * heads, s, d, e, kd)
        fwd, bwd, setup = _flash(b, heads, s, d, dtype, device)
        out += [Kernel("flash fwd", "core forward", "attention", f, fwd),
                Kernel("flash bwd", "core backward", "attention", FLASH_BACKWARD * f, bwd, setup=setup)]
    else:  # scores [s, s] contracting d, context [s, d] contracting s; backward: dV, dQ, dK like PV, dP like QK^T
        batch = b * heads
        qk, pv = gemm_time(s, s, d, e, kd, batch), gemm_time(s, d, s, e, kd, batch)
        scores, context = _gemm(s, s, d, dtype, device, batch), _gemm(s, d, s, dtype, device, batch)
        flops = 2.0 * batch * s * s * d
        out += [Kernel("scores QK^T", "core forward", "attention", qk, scores, flops),
                Kernel("context PV", "core forward", "attention", pv, context, flops),
                Kernel("core bwd dV, dQ, dK", "core backward", "attention", 3 * pv,
                       lambda: [context() for _ in range(3)], 3 * flops),
                Kernel("core bwd dP", "core backward", "attention", qk, scores, flops)]
    out += linear_kernels("attention", "proj", tokens, h, h // tp, e, kd, dtype, device)
    out += linear_kernels("mlp", "fc1", tokens, model.fc1_rows // tp, h, e, kd, dtype, device)
    out += linear_kernels("mlp", "fc2", tokens, h, model.ffn_hidden_size // tp, e, kd, dtype, device)
    out += linear_kernels("head", "logits", tokens, model.vocab_size // tp, h, e, kd, dtype, device)
    return out + memory_kernels(s, b, h, heads, d, model.ffn_hidden_size // tp, not model.flash_attention, e, rate,
                                dtype, device)


def time_kernel(kernel: Kernel, device: torch.device, repeats: int, cycles_per_s: float | None = None) -> float:
    """Median seconds of `repeats` runs after two warm-up runs (CUDA events on a GPU, behind a sleep kernel where
    `cycles_per_s` gives its clock: the kernels' own time, not the host's dispatch between them)."""
    samples = []
    for i in range(repeats + 2):
        if kernel.setup is not None:
            kernel.setup()
        if device.type == "cuda" and cycles_per_s:
            seconds = covered_seconds(kernel.run, cycles_per_s)[0]
        elif device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            kernel.run()
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            seconds = timed(kernel.run, device)[0]
        if i >= 2:
            samples.append(seconds)
    return statistics.median(samples)


def model_config(name: str, small: bool, dtype: str) -> tuple[ModelConfig, list[tuple[int, int]]]:
    hidden, heads, vocab, backend, layouts = MODELS[name]
    seq = SEQ_OF.get(name, SEQ)
    if small:
        hidden, heads, vocab, seq = SMALL["hidden"], SMALL["heads"], SMALL["vocab"], SMALL["seq"]
        layouts = [(1, 1), (1, 2), (2, 1)]
    cfg = ModelConfig(num_layers=1, hidden_size=hidden, num_attention_heads=heads, vocab_size=vocab,
                      seq_length=seq, params_dtype=dtype, attention_backend=backend)
    return cfg, layouts


def run(models: list[str], device: torch.device, dtype: str, dev: DeviceType, repeats: int, small: bool) -> dict:
    settings = CostSettings()
    kd = device_kernels(dev, dtype, settings.fraction(dev))
    if kd is None or dev.memory_bandwidth is None:
        raise UsageError(f"device type {dev.name} gives no SM count or memory bandwidth: no kernel model to check")
    rate = dev.memory_bandwidth * settings.bandwidth_fraction
    rows, layouts = [], []
    cycles = sleep_cycles_per_s() if device.type == "cuda" else None
    for name in models:
        cfg, configs = model_config(name, small, dtype)
        for tp, b in configs:
            kernels = layout_kernels(cfg, tp, b, kd, rate, cfg.torch_dtype, device)
            mine = [{"model": name, "tp": tp, "mbs": b, "kernel": k.name, "category": k.category, "unit": k.unit,
                     "measured_ms": 1e3 * time_kernel(k, device, repeats, cycles), "modelled_ms": 1e3 * k.modelled_s,
                     "flops": k.flops} for k in kernels]
            rows += mine
            layer = [r for r in mine if r["unit"] in ("attention", "mlp") and r["category"] != "memory-bound"]
            layouts.append({"model": name, "tp": tp, "mbs": b,
                            "measured_ms_per_sample": sum(r["measured_ms"] for r in layer) / b,
                            "modelled_ms_per_sample": sum(r["modelled_ms"] for r in layer) / b})
            del kernels
            if device.type == "cuda":
                torch.cuda.empty_cache()
    for r in rows:
        r["ratio"] = r["measured_ms"] / r["modelled_ms"] if r["modelled_ms"] > 0 else float("nan")
    return summarize(rows, layouts, kd)


def summarize(rows: list[dict], layouts: list[dict], kd: KernelDevice) -> dict:
    by_category = {}
    for cat in dict.fromkeys(r["category"] for r in rows):
        by_category[cat] = statistics.median(r["ratio"] for r in rows if r["category"] == cat)
    per_model = {}
    for name in dict.fromkeys(lay["model"] for lay in layouts):
        mine = [lay for lay in layouts if lay["model"] == name]
        per_model[name] = {"spearman": spearman([lay["modelled_ms_per_sample"] for lay in mine],
                                                [lay["measured_ms_per_sample"] for lay in mine]) if len(mine) > 2
                           else float("nan")}
    for name, m in per_model.items():  # per micro-batch size: per-sample layer time at the largest tp over the smallest
        for b in sorted({lay["mbs"] for lay in layouts if lay["model"] == name}):
            at = {lay["tp"]: lay for lay in layouts if lay["model"] == name and lay["mbs"] == b}
            if len(at) > 1:
                lo, hi = at[min(at)], at[max(at)]
                m.setdefault("tp_scaling", []).append({
                    "mbs": b, "tp": [lo["tp"], hi["tp"]],
                    "measured": hi["measured_ms_per_sample"] / lo["measured_ms_per_sample"],
                    "modelled": hi["modelled_ms_per_sample"] / lo["modelled_ms_per_sample"]})
    biggest = max((r for r in rows if r["category"] == "forward"), key=lambda r: r["flops"])
    flops = biggest["flops"]
    return {"rows": rows, "layouts": layouts, "median_ratio_by_category": by_category, "models": per_model,
            "largest_gemm": {"kernel": f"{biggest['model']} tp {biggest['tp']} mbs {biggest['mbs']} "
                                       f"{biggest['kernel']}",
                             "fraction_of_peak": flops / (biggest["measured_ms"] / 1e3) / kd.peak_flops,
                             "modelled_fraction_of_peak": flops / (biggest["modelled_ms"] / 1e3) / kd.peak_flops}}


def main_table(result: dict) -> str:
    lines = []
    for lay in result["layouts"]:
        mine = [r for r in result["rows"] if (r["model"], r["tp"], r["mbs"]) == (lay["model"], lay["tp"], lay["mbs"])]
        lines.append(f"\n{lay['model']} tp {lay['tp']} micro-batch {lay['mbs']}")
        lines.append(format_table(["kernel", "measured ms", "modelled ms", "measured/modelled"],
                                  [[r["kernel"], f"{r['measured_ms']:.3f}", f"{r['modelled_ms']:.3f}",
                                    f"{r['ratio']:.2f}"] for r in mine]))
        lines.append(f"layer (attention + MLP, forward and backward) per sample: measured "
                     f"{lay['measured_ms_per_sample']:.2f} ms, modelled {lay['modelled_ms_per_sample']:.2f} ms "
                     f"({lay['measured_ms_per_sample'] / lay['modelled_ms_per_sample']:.2f})")
    cats = ", ".join(f"{c} {v:.2f}" for c, v in result["median_ratio_by_category"].items())
    lines.append(f"\nmedian measured/modelled by kind: {cats}")
    for name, m in result["models"].items():
        lines.append(f"{name}: Spearman of the layouts' per-sample layer time, measured vs modelled "
                     f"{m['spearman']:+.2f}")
        for t in m.get("tp_scaling", []):
            lo, hi = t["tp"]
            lines.append(f"  micro-batch {t['mbs']}: per-sample layer time at tp {hi} over tp {lo}: measured "
                         f"{t['measured']:.3f}, modelled {t['modelled']:.3f} (ideal {lo / hi:.3f})")
    g = result["largest_gemm"]
    lines.append(f"largest GEMM ({g['kernel']}): {100 * g['fraction_of_peak']:.0f}% of peak measured, "
                 f"{100 * g['modelled_fraction_of_peak']:.0f}% modelled")
    return "\n".join(lines)


@exit_on_usage_error
def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--models", default="bloom,gpt3,1.3b,mcore1.7b,mcore177b", help="comma list of " + ", ".join(MODELS))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=tuple(DTYPE_BYTES), default=None, help="bf16 on a GPU, fp32 on the CPU")
    ap.add_argument("--cluster", default=None)
    ap.add_argument("--device-type", default=None)
    ap.add_argument("--repeats", type=count(1), default=10)
    ap.add_argument("--small", action="store_true", help="tiny shapes (a dry run)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    models = names("--models", args.models, MODELS)
    output_files(json=args.json)
    device = torch_device(args.device)
    dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        dev = device_type_for(props.name, props.total_memory, args.cluster, args.device_type)
    else:
        dev = device_type_for("H100", 80e9, args.cluster, args.device_type)
    result = run(models, device, dtype, dev, args.repeats, args.small)
    result.update(device=str(torch.cuda.get_device_name(device)) if device.type == "cuda" else "cpu",
                  device_type=dev.name, dtype=dtype)
    print(main_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
