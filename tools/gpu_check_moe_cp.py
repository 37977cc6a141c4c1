"""gpu_check's in-process MoE and context-parallel parts (tools/gpu_check_steps.py `grouped_gemm`, `cp_blocks`):
CUDA paths that no GPU had run, each against the path the CPU tests check and a float64 (or fp32) reference.

  grouped_gemm  an MoE layer's experts (models/moe_experts.Experts: fc1, SwiGLU, fc2 over stacked weights) on rows
                sorted by expert with uneven counts and one expert given none: whether torch._grouped_mm runs here
                for the dtype (moe_experts' probe), and its forward and backward against the loop of GEMMs the
                fallback runs and an fp32 loop: max error over the largest value, and the time of each.
  cp_blocks     parallel/cp_blocks.py's fused path (on CUDA aten::_scaled_dot_product_flash_attention and its
                backward given the final output and log-sum-exp; on the CPU the _for_cpu kernels) for one
                aligned-causal and one unmasked block, bf16 and fp16, grouped-query heads, against the tiled math
                path (cp_blocks.USE_FUSED = False) and float64; then every pair of a C-rank ring in one process
                (context_parallel._LocalAttention over C tiles in chunk order: the ring's and the a2a's pairs and
                merges, without the transfers), and context_attention at cp = 1, forward and backward, against
                float64 and torch's SDPA: max errors and times.

Two cp ranks cannot share one GPU under NCCL (one rank per device), so the ring's transfers are not exercised here.
"""

from __future__ import annotations

import math
import statistics
from contextlib import contextmanager

import torch

from megatron_bmw.device import timed


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _median_s(fn, device: torch.device, warmup: int = 2, repeats: int = 5) -> float:
    times = [timed(fn, device)[0] for _ in range(warmup + repeats)][warmup:]
    return statistics.median(times)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| over max |ref| (in float64)."""
    ref = ref.double()
    return float((got.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


# ---- the experts' grouped GEMM ------------------------------------------------------------------------------------

@contextmanager
def _grouped_forced(device: torch.device, dtype: torch.dtype, ok: bool):
    """moe_experts' probe result for (device, dtype) set to `ok` (False: the loop of GEMMs) while inside."""
    from megatron_bmw.models import moe_experts

    key = (device.type, dtype)
    saved = moe_experts._GROUPED_OK.get(key)
    moe_experts._GROUPED_OK[key] = ok
    try:
        yield
    finally:
        if saved is None:
            moe_experts._GROUPED_OK.pop(key, None)
        else:
            moe_experts._GROUPED_OK[key] = saved


def _experts(small: bool, device: torch.device):
    from megatron_bmw.config import ModelConfig
    from megatron_bmw.config.moe import MoEConfig
    from megatron_bmw.models.chunk import build_units
    from megatron_bmw.parallel.state import ParallelState

    h, experts = (64, 4) if small else (1024, 8)
    cfg = ModelConfig(num_layers=1, hidden_size=h, num_attention_heads=4 if small else 16, vocab_size=256,
                      seq_length=32, swiglu=True, ffn_hidden_size=128 if small else 2816, add_bias_linear=False,
                      params_dtype="bf16",
                      moe=MoEConfig(num_experts=experts, router_topk=2))
    return cfg, build_units(cfg, ParallelState.serial(device), 1234)["mlp_0"].experts


def _counts(rows: int, experts: int, g: torch.Generator) -> torch.Tensor:
    """Uneven rows per expert summing to `rows`, expert 1 given none."""
    weights = torch.rand(experts, generator=g) + 0.2
    weights[1] = 0.0
    counts = (weights / weights.sum() * rows).floor().long()
    counts[0] += rows - int(counts.sum())
    return counts


def _run_experts(experts, rows: torch.Tensor, counts: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    """[output, d rows, d fc1.weight, d fc2.weight] of one forward and backward."""
    x = rows.detach().requires_grad_(True)
    for p in experts.parameters():
        p.grad = None
    y = experts(x, counts.to(rows.device))
    y.backward(grad)
    return [y.detach(), x.grad, experts.fc1.weight.grad, experts.fc2.weight.grad]


def grouped_gemm_check(small: bool) -> dict:
    from megatron_bmw.models.moe_experts import _grouped_available

    device = _device()
    cfg, experts = _experts(small, device)
    dtype = cfg.torch_dtype
    n_exp = cfg.moe.num_experts
    n_rows = 64 if small else 8192  # tokens x top-k
    g = torch.Generator().manual_seed(5)
    counts = _counts(n_rows, n_exp, g)
    rows = torch.randn(n_rows, cfg.hidden_size, generator=g).to(device=device, dtype=dtype)
    grad = torch.randn(n_rows, cfg.hidden_size, generator=g).to(device=device, dtype=dtype)
    available = _grouped_available(device, dtype)
    names = ("output", "d_rows", "d_fc1_weight", "d_fc2_weight")
    with _grouped_forced(device, dtype, False):
        loop = _run_experts(experts, rows, counts, grad)
        loop_s = _median_s(lambda: _run_experts(experts, rows, counts, grad), device)
    experts.float()  # the fp32 reference: the same weights, rows and gradient upcast, the loop of GEMMs
    with _grouped_forced(device, torch.float32, False):
        ref = _run_experts(experts, rows.float(), counts, grad.float())
    experts.to(dtype)
    out = {"status": "ok", "device": device.type, "dtype": "bf16", "experts": n_exp, "rows": n_rows,
           "hidden": cfg.hidden_size, "expert_ffn": cfg.moe_ffn_hidden_size, "counts": counts.tolist(),
           "grouped_mm_available": available, "loop_fwd_bwd_ms": round(loop_s * 1e3, 3),
           "loop_vs_fp32": {k: float(f"{rel_err(a, b):.3g}") for k, a, b in zip(names, loop, ref)}}
    problems = [f"loop {k} off the fp32 loop by {v}" for k, v in out["loop_vs_fp32"].items() if not v < 2e-2]
    if available:
        with _grouped_forced(device, dtype, True):
            try:
                grouped = _run_experts(experts, rows, counts, grad)
                grouped_s = _median_s(lambda: _run_experts(experts, rows, counts, grad), device)
            except RuntimeError as exc:  # the probe's tiny sizes ran, these did not
                out.update(status="failed", grouped_error=str(exc).splitlines()[0][:300])
                out["notes"] = f"failed: torch._grouped_mm passed the probe and raised {out['grouped_error']}"
                return out
        out["grouped_fwd_bwd_ms"] = round(grouped_s * 1e3, 3)
        out["loop_over_grouped_time"] = round(loop_s / grouped_s, 2)
        out["grouped_vs_loop"] = {k: float(f"{rel_err(a, b):.3g}") for k, a, b in zip(names, grouped, loop)}
        out["grouped_vs_fp32"] = {k: float(f"{rel_err(a, b):.3g}") for k, a, b in zip(names, grouped, ref)}
        problems += [f"grouped {k} off the loop by {v}" for k, v in out["grouped_vs_loop"].items() if not v < 2e-2]
        problems += [f"grouped {k} off the fp32 loop by {v}" for k, v in out["grouped_vs_fp32"].items()
                     if not v < 2e-2]
    if problems:
        out["status"] = "failed"
    notes = ["torch._grouped_mm " + ("runs" if available else "does NOT run (the loop of GEMMs runs)") +
             f" here for {device.type} bf16 (moe_experts' probe)"]
    out["notes"] = "; ".join(["failed: " + "; ".join(problems)] * bool(problems) + notes)
    return out


# ---- context parallelism's blocks -------------------------------------------------------------------------------

@contextmanager
def _fused(on: bool):
    from megatron_bmw.parallel import cp_blocks

    saved = cp_blocks.USE_FUSED
    cp_blocks.USE_FUSED = on
    try:
        yield
    finally:
        cp_blocks.USE_FUSED = saved


def _qkv(b: int, n: int, g: int, s: int, d: int, dtype, device, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(b, heads, s, d, generator=gen).to(device=device, dtype=dtype)
                   for heads in (n, g, g, n))
    return q, k, v, do


def _block(q, k, v, do, causal: bool, time_it: bool = True) -> tuple[list[torch.Tensor], float, float]:
    """cp_blocks on one block (the whole attention: its output and log-sum-exp are the final ones), by whichever
    path cp_blocks.USE_FUSED picks: [out, lse, dq, dk, dv] and (forward, backward) seconds (once, untimed, without
    `time_it`)."""
    from megatron_bmw.parallel import cp_blocks

    wide = cp_blocks.wide_dtype(q.dtype)
    scale = 1.0 / math.sqrt(q.size(-1))
    out = torch.empty(q.shape, dtype=wide, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=wide, device=q.device)

    def forward():
        cp_blocks.block_forward(q, k, v, causal, scale, out, lse, first=True)

    fwd_s = _median_s(forward, q.device) if time_it else forward()
    final = out.to(q.dtype)
    grads = [torch.zeros(t.shape, dtype=wide, device=q.device) for t in (q, k, v)]

    def backward():
        for t in grads:
            t.zero_()
        cp_blocks.block_backward(do, q, k, v, final, lse, causal, scale, *grads)

    bwd_s = _median_s(backward, q.device) if time_it else backward()
    return [out, lse, *grads], fwd_s, bwd_s


BLOCK_NAMES = ("out", "lse", "dq", "dk", "dv")
# max error over the largest value of a fused or math result against float64 (bf16 keeps 8 bits, fp16 11)
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 1e-4}


def block_cases(small: bool, device: torch.device) -> tuple[dict, list[str]]:
    from megatron_bmw.parallel import cp_blocks

    b, n, g, s, d = (1, 4, 2, 64, 16) if small else (1, 16, 4, 2048, 128)
    results, problems = {}, []
    for dtype in (torch.bfloat16, torch.float16):
        q, k, v, do = _qkv(b, n, g, s, d, dtype, device, seed=7)
        for causal in (True, False):
            name = f"{str(dtype).split('.')[-1]}_{'causal' if causal else 'unmasked'}"
            with _fused(False):
                math_, m_fwd, m_bwd = _block(q, k, v, do, causal)
            ref, _, _ = _block(*(t.double() for t in (q, k, v, do)), causal, time_it=False)
            row = {"math_fwd_ms": round(m_fwd * 1e3, 3), "math_bwd_ms": round(m_bwd * 1e3, 3)}
            got_by = {"math": math_}
            with _fused(True):
                row["fused_kernel"] = kind = cp_blocks.fused_kind(q)
                try:
                    got_by["fused"], f_fwd, f_bwd = _block(q, k, v, do, causal)
                    row.update(fused_fwd_ms=round(f_fwd * 1e3, 3), fused_bwd_ms=round(f_bwd * 1e3, 3))
                except RuntimeError as exc:  # the kernel refused these inputs: recorded, the other cases still run
                    row["fused_error"] = str(exc).splitlines()[0][:300]
                    problems.append(f"{name}: the fused path raised {row['fused_error']}")
            for label, got in got_by.items():
                for key, a, r in zip(BLOCK_NAMES, got, ref):
                    err = rel_err(a, r)
                    row[f"{label}_{key}_err"] = float(f"{err:.3g}")
                    if not err < TOLERANCE[dtype]:
                        problems.append(f"{name} {label} {key} off float64 by {err:.3g}")
            if kind is None:
                problems.append(f"{name}: no fused kernel took {dtype} on {device.type} (cp_blocks.fused_kind)")
            results[name] = row
    return {"shape": {"b": b, "n": n, "g": g, "s": s, "d": d}, "cases": results}, problems


def _reference(q, k, v, positions) -> torch.Tensor:
    """float64 causal attention by global position: q [b, n, S, d], k, v [b, g, S, d]."""
    per = q.size(1) // k.size(1)
    kk, vv = (t.double().repeat_interleave(per, dim=1) for t in (k, v))
    scores = torch.matmul(q.double(), kk.transpose(-1, -2)) / math.sqrt(q.size(-1))
    mask = positions.unsqueeze(0) <= positions.unsqueeze(1)  # [query, key]: the key's position not after the query's
    return torch.matmul(scores.masked_fill(~mask, float("-inf")).softmax(-1), vv)


def _attend(fn, q, k, v, do, time_it: bool = True) -> tuple[list[torch.Tensor], float | None]:
    """[out, dq, dk, dv] of fn(q, k, v) with upstream `do`, and the seconds of forward and backward (None without
    `time_it`)."""
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]

    def step():
        for t in leaves:
            t.grad = None
        out = fn(*leaves)
        out.backward(do)
        return out

    seconds = _median_s(step, q.device) if time_it else None
    out = step()
    return [out.detach(), *(t.grad for t in leaves)], seconds


def ring_cases(small: bool, device: torch.device) -> tuple[dict, list[str]]:
    """Every pair of a C-rank ring in one process, and context_attention at cp = 1, in bf16 and fp16."""
    import torch.nn.functional as F

    from megatron_bmw.parallel.context_parallel import _LocalAttention, chunk_positions, context_attention

    b, n, g, s, d, c = (1, 4, 2, 64, 16, 2) if small else (1, 16, 4, 4096, 128, 4)
    scale = 1.0 / math.sqrt(d)
    results, problems = {}, []
    for dtype in (torch.bfloat16, torch.float16):
        q, k, v, do = _qkv(b, n, g, s, d, dtype, device, seed=11)
        kind = str(dtype).split(".")[-1]
        # rows in chunk order: cp rank 0's rows, then rank 1's, ...: their global positions
        ring_pos = torch.cat([chunk_positions(s, c, r) for r in range(c)]).to(device)
        plain_pos = torch.arange(s, device=device)
        sdpa = (lambda q_, k_, v_: F.scaled_dot_product_attention(q_, k_, v_, is_causal=True, scale=scale,
                                                                   enable_gqa=True))
        cases = {f"ring{c}_pairs": (lambda q_, k_, v_: _LocalAttention.apply(q_, k_, v_, c, scale), ring_pos),
                 "cp1_context_attention": (lambda q_, k_, v_: context_attention(q_, k_, v_, plain_pos, None, (0,),
                                                                                scale), plain_pos),
                 "sdpa": (sdpa, plain_pos)}
        refs: dict[str, list[torch.Tensor]] = {}
        for name, (fn, pos) in cases.items():
            try:
                got, seconds = _attend(fn, q, k, v, do)
            except RuntimeError as exc:  # recorded; the other cases still run
                results[f"{kind}_{name}"] = {"error": str(exc).splitlines()[0][:300]}
                problems.append(f"{kind} {name} raised {results[f'{kind}_{name}']['error']}")
                continue
            order = "ring" if pos is ring_pos else "plain"
            if order not in refs:
                refs[order], _ = _attend(lambda q_, k_, v_: _reference(q_, k_, v_, pos),
                                         *(t.double() for t in (q, k, v, do)), time_it=False)
            row = {"fwd_bwd_ms": round(seconds * 1e3, 3)}
            for key, a, r in zip(("out", "dq", "dk", "dv"), got, refs[order]):
                err = rel_err(a, r)
                row[f"{key}_err"] = float(f"{err:.3g}")
                if name != "sdpa" and not err < TOLERANCE[dtype]:
                    problems.append(f"{kind} {name} {key} off float64 by {err:.3g}")
            results[f"{kind}_{name}"] = row
    return {"shape": {"b": b, "n": n, "g": g, "s": s, "d": d, "cp": c}, "cases": results}, problems


def cp_blocks_check(small: bool) -> dict:
    device = _device()
    blocks, problems = block_cases(small, device)
    ring, ring_problems = ring_cases(small, device)
    problems += ring_problems
    notes = ["two cp ranks cannot share one GPU under NCCL: the ring's transfers are not run; its pairs and merges "
             "are (every pair of a C-rank ring in one process)"]
    if problems:
        notes.insert(0, "failed: " + "; ".join(problems))
    return {"status": "failed" if problems else "ok", "device": device.type, "blocks": blocks, "ring": ring,
            "notes": "; ".join(notes)}
