"""The in-process steps of tools/gpu_check.py, one per subcommand, each writing a JSON result:

  env        versions, the GPU, apex / Transformer Engine detection (fused.py), a bf16 matrix-product rate
  optimizer  our Adam choice (training/optimizer._make_adam: apex FusedAdam, torch fused=True, else foreach)
             against torch's foreach AdamW on the same parameters and gradients
  store      BPipe's activation store (pipeline/activation_store.py) with the side-stream copier of
             pipeline/transfers.CudaChannel: evict to pinned host memory and load back on side streams, gradients
             bit for bit, the streams waiting on each other, and pinned host copy rates both ways
  launch     per-unit timings five ways (synchronised, host, event span, behind a sleep kernel) against a stream
             of micro-batches (tools/gpu_check_launch.py)
  grouped_gemm
             an MoE layer's experts through torch._grouped_mm against the loop of GEMMs and fp32, forward and
             backward (tools/gpu_check_moe_cp.py)
  cp_blocks  parallel/cp_blocks.py's fused flash path per block (aligned-causal, unmasked; bf16, fp16; GQA) against
             its math path and float64, a C-rank ring's pairs in one process and context_attention at cp = 1
             (tools/gpu_check_moe_cp.py)
  covered    device.covered_seconds (a sleep kernel ahead of the timed call) on known kernels and on the kernel
             model's 1.3B layer, against plain events (tools/gpu_check_covered.py)
  grad_accum a GPT MLP unit's backward with and without GradSync's fp32 main_grad hooks: the accumulation's cost
             per micro-batch against the planner's count (planner/engine.py accumulation_bytes)
  param_gather
             ZeRO-1 with --overlap-grad-reduce --overlap-param-gather through the Trainer on a one-rank NCCL group
             (the data-parallel group of a one-GPU run is None, which gathers by a copy): losses, grad norms and
             parameters bit for bit against gathering at once; the communicator held back behind a sleeping side
             stream after each step, with the forward pre-hooks' waits (equal) and without them (a control that
             must differ: the check can see a missing wait)

On a machine without CUDA each runs its CPU part (store: the plain copier, no streams; param_gather: a one-rank gloo
group, no held-back communicator) and says what it left out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

GiB = 2**30

# Dense bf16 peak TFLOP/s (no sparsity) by device-name pattern, most specific first.
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0),
                    ("GH200", 989.0), ("A100", 312.0), ("L40S", 362.0), ("A10", 125.0))


def peak_bf16_tflops(name: str) -> float | None:
    for pattern, peak in PEAK_BF16_TFLOPS:
        if pattern in name:
            return peak
    return None


def _probe(module: str) -> str:
    try:
        mod = __import__(module)
    except Exception as exc:  # noqa: BLE001 - any failure means not usable
        return f"no ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    return f"yes ({getattr(mod, '__version__', 'version unknown')})"


def env(small: bool) -> dict:
    from megatron_bmw import fused
    from megatron_bmw.training import optimizer

    cuda = torch.cuda.is_available()
    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda_runtime": torch.version.cuda,
           "cudnn": torch.backends.cudnn.version() if cuda else None, "cuda_available": cuda,
           "apex_import": _probe("apex"), "transformer_engine_import": _probe("transformer_engine"),
           "fused.HAVE_APEX": fused.HAVE_APEX, "fused.HAVE_TE": fused.HAVE_TE,
           "apex_fused_adam": optimizer._ApexFusedAdam is not None,
           "sdpa": fused.flash_attention_available(), "cpu_count": os.cpu_count()}
    if not cuda:
        out["notes"] = "no CUDA: GPU fields left out"
        return out
    props = torch.cuda.get_device_properties(0)
    out.update(gpu=props.name, sm_count=props.multi_processor_count, capability=f"{props.major}.{props.minor}",
               memory_gib=round(props.total_memory / GiB, 2), device_count=torch.cuda.device_count(),
               bf16_supported=torch.cuda.is_bf16_supported(), flash_sdp_enabled=torch.backends.cuda.flash_sdp_enabled(),
               peak_bf16_tflops=peak_bf16_tflops(props.name))
    n = 2048 if small else 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    end.synchronize()
    out["matmul_bf16_tflops"] = round(10 * 2 * n**3 / (start.elapsed_time(end) / 1e3) / 1e12, 1)
    return out


def optimizer_check(small: bool) -> dict:
    from megatron_bmw.config import OptimizerConfig
    from megatron_bmw.training.optimizer import _make_adam

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = OptimizerConfig(lr=1e-3)
    g = torch.Generator().manual_seed(0)
    shapes = [(1024, 1024), (4096,), (1024, 4096)] if not small else [(64, 64), (64,)]
    start = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(3)]

    def run(make):
        params = [torch.nn.Parameter(t.clone().to(device)) for t in start]
        opt = make([{"params": params, "weight_decay": 0.01}])
        for step in grads:
            for p, gr in zip(params, step):
                p.grad = gr.to(device)
            opt.step()
        return [p.detach().float().cpu() for p in params], opt

    made: list = []
    ours, opt = run(lambda groups: made.append(_make_adam(groups, cfg, device)) or made[0][0])
    backend = made[0][1]
    ref, _ = run(lambda groups: torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                                  eps=cfg.adam_eps, foreach=True))
    diff = max(float((a - b).abs().max()) for a, b in zip(ours, ref))
    kind = type(opt).__module__ + "." + type(opt).__name__
    fused = bool(getattr(opt, "defaults", {}).get("fused")) or backend == "apex"
    problems = [f"differs from foreach AdamW by {diff:.3g} after 3 steps"] if diff > 1e-5 else []
    if device.type == "cuda" and not fused:
        problems.append("CUDA without a fused Adam")
    notes = "; ".join(problems) or ("" if device.type == "cuda" else "CPU: foreach AdamW (fused Adam needs CUDA)")
    return {"status": "failed" if problems else "ok", "device": str(device), "backend": backend, "class": kind,
            "fused": fused, "max_abs_diff_vs_foreach": diff, "notes": notes}


# ---- the activation store on CUDA streams ---------------------------------------------------------------------
class _Posted:
    """Stands for the NCCL work of a transfer whose copy was queued on the transfer's own stream."""

    def wait(self) -> None:
        return None


class PinnedLoopback:
    """BPipe's pair, folded onto one GPU: EVICT copies the gathered buffer into pinned host memory on the send
    stream, LOAD copies it back on the receive stream. The completion objects are transfers.py's own, so their
    stream waits and record_stream calls are the ones a real NCCL pair runs."""

    def __init__(self, device: torch.device) -> None:
        from megatron_bmw.pipeline.transfers import CudaChannel

        self.channel = CudaChannel(SimpleNamespace(device=device))
        self.device = device
        self.host: dict = {}
        self.delay_cycles = 0  # spin the receive stream this long before the copy back (to see compute wait)

    def send(self, key):
        from megatron_bmw.pipeline.transfers import _CudaSend

        def post(buf: torch.Tensor):
            stream = self.channel.send_stream
            stream.wait_stream(torch.cuda.current_stream(self.device))
            host = torch.empty(buf.numel(), dtype=torch.uint8, pin_memory=True)
            with torch.cuda.stream(stream):
                host.copy_(buf, non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
            self.host[key] = (host, done)
            return _CudaSend(_Posted(), buf, stream)
        return post

    def recv(self, key):
        from megatron_bmw.pipeline.transfers import _CudaRecv

        def post(buf: torch.Tensor):
            host, sent = self.host.pop(key)
            stream = self.channel.recv_stream
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                stream.wait_event(sent)
                if self.delay_cycles:
                    torch.cuda._sleep(self.delay_cycles)
                buf.copy_(host, non_blocking=True)
            return _CudaRecv(_Posted(), buf, stream)
        return post


def _copy_rates(device: torch.device, nbytes: int) -> dict:
    """GB/s of pinned host <-> device copies on a side stream, timed with events (best of 6)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device)
    rates = {}
    for name, dst, src in (("device_to_pinned_host_GBps", host, dev), ("pinned_host_to_device_GBps", dev, host)):
        best = float("inf")
        for _ in range(6):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                start.record(stream)
                dst.copy_(src, non_blocking=True)
                end.record(stream)
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        rates[name] = round(nbytes / best / 1e9, 2)
    rates["copy_bytes"] = nbytes
    return rates


def _model(device: torch.device, small: bool):
    from megatron_bmw.config import ModelConfig
    from megatron_bmw.models.chunk import ModelChunk, build_units
    from megatron_bmw.parallel.state import ParallelState

    cfg = ModelConfig(num_layers=2, hidden_size=64 if small else 512, num_attention_heads=4 if small else 8,
                      vocab_size=256 if small else 4096, seq_length=32 if small else 512, hidden_dropout=0.0,
                      attention_dropout=0.0, attention_backend="unfused")
    model = ModelChunk(build_units(cfg, ParallelState.serial(device), 1234))
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, cfg.vocab_size, (4, cfg.seq_length + 1), generator=g)
    batch = {"tokens": tokens[:, :-1].contiguous().to(device), "labels": tokens[:, 1:].contiguous().to(device),
             "loss_mask": torch.ones(4, cfg.seq_length, device=device)}
    return model, batch


class _HostWire:
    """CPU: a completed transfer through a dict."""

    def __init__(self) -> None:
        self.data: dict = {}

    def send(self, key):
        def post(buf):
            self.data[key] = buf.clone()
            return SimpleNamespace(wait=lambda: buf)
        return post

    def recv(self, key):
        def post(buf):
            buf.copy_(self.data.pop(key))
            return SimpleNamespace(wait=lambda: buf)
        return post


def _round(store, wire, model, batch, key, ref, cuda: bool, slow: str, cycles: int) -> dict[str, bool]:
    """Capture, evict, load and backward one key; `slow`: which stream lags behind ("compute": the gather must
    wait for it; "send": the freed activations must wait for the gather)."""
    checks: dict[str, bool] = {}
    device = store.device
    model.zero_grad(set_to_none=True)
    with store.capture(key):
        loss = model(None, batch)
    sizes = [t.untyped_storage().nbytes() for t in store._entries[key].tensors]
    if cuda:
        compute, send_stream = torch.cuda.current_stream(device), wire.channel.send_stream
        torch.cuda.synchronize(device)
        if slow == "compute":  # the compute that produced the activations is still running
            torch.cuda._sleep(cycles)
            produced = torch.cuda.Event(enable_timing=True)
            produced.record(compute)
        else:  # the send stream is busy: the gather's reads come late
            with torch.cuda.stream(send_stream):
                torch.cuda._sleep(cycles)
    store.evict(key, wire.send(key))
    if cuda:
        if slow == "compute":
            gathered = torch.cuda.Event(enable_timing=True)
            gathered.record(send_stream)
            torch.cuda.synchronize(device)  # both events complete, whatever their order
            checks["the gather (send stream) waits for the compute that produced the activations"] = \
                produced.elapsed_time(gathered) >= 0
        else:
            # The freed activations are recorded on the send stream: compute allocations of their sizes must not
            # land on them before the gather has read them (junk there would break the gradients below).
            junk = [torch.full((n,), 255, dtype=torch.uint8, device=device) for n in sizes]
            junk.clear()
    store.settle()
    if cuda:
        torch.cuda.synchronize(device)
        wire.delay_cycles = cycles
    store.load(key, wire.recv(key))
    store.ready(key)
    if cuda:
        checks[f"compute waits for the load's event ({slow} round)"] = not compute.query()
        wire.delay_cycles = 0
    loss.backward()
    store.release(key)
    if cuda:
        torch.cuda.synchronize(device)
    mismatched = [n for n, p in model.named_parameters() if not torch.equal(p.grad, ref[n])]
    checks[f"gradients bit for bit after evict and load ({slow} round)"] = not mismatched
    return checks


def store_check(small: bool) -> dict:
    from megatron_bmw.pipeline.activation_store import ActivationStore

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    model, batch = _model(device, small)
    model(None, batch).backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    wire = PinnedLoopback(device) if cuda else _HostWire()
    store = ActivationStore(device, list(model.parameters()), copier=wire.channel if cuda else None)
    cycles = 5_000_000 if small else 50_000_000  # milliseconds to tens of milliseconds at GPU clocks
    checks: dict[str, bool] = {}
    for i, slow in enumerate(("compute", "send")):
        checks.update(_round(store, wire, model, batch, (i, 0, None), ref, cuda, slow, cycles))
    out = {"device": str(device), "checks": checks, "peak_bytes": store.peak_bytes,
           "live_bytes_after": store.live_bytes}
    if cuda:
        out.update(_copy_rates(device, (16 if small else 256) * 2**20))
    failed = [name for name, ok in checks.items() if not ok]
    if store.live_bytes:
        failed.append(f"the store still counts {store.live_bytes} bytes")
    out["status"] = "failed" if failed else "ok"
    out["notes"] = "failed: " + "; ".join(failed) if failed else \
        ("" if cuda else "CPU: plain copier; streams, events and pinned copies need CUDA")
    return out


# ---- ZeRO-1's overlapped parameter all-gather ------------------------------------------------------------------
ZERO1_ITERS = 3
HOLD_CYCLES = 200_000_000  # the side stream's sleep before each step's gathers: about 0.1 s at GPU clocks


def zero1_flags(small: bool, cuda: bool, overlap: bool) -> list[str]:
    """pretrain_gpt.py's flags of the param_gather runs (unfused attention: SDPA's backward may use atomics)."""
    layers, hidden, heads, seq, vocab = (2, 64, 4, 64, 512) if small else (4, 512, 8, 512, 8192)
    return ["--mock-data", "--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads",
            str(heads), "--seq-length", str(seq), "--max-position-embeddings", str(seq), "--vocab-size", str(vocab),
            "--make-vocab-size-divisible-by", "128", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--attention-backend", "unfused", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--train-iters", str(ZERO1_ITERS), "--lr", "1e-3", "--lr-warmup-iters", "0", "--seed", "1234",
            "--eval-iters", "0", "--eval-interval", "1000000", "--clip-grad", "1.0", "--weight-decay", "0.01",
            "--use-distributed-optimizer", "--overlap-grad-reduce", *(["--bf16"] if cuda else []),
            *(["--overlap-param-gather"] if overlap else [])]


class HeldBack:
    """Before each publish, a collective on the gathers' communicator queued behind a sleeping side stream: the
    gathers land long after the compute stream has moved on, so only the pre-hooks' stream waits keep the next
    forward from reading the previous step's parameters."""

    def __init__(self, gather, group, device: torch.device, cycles: int) -> None:
        import torch.distributed as dist

        self.side = torch.cuda.Stream(device)
        self.works: list = []
        publish = gather.publish

        def held(shard: torch.Tensor) -> None:
            self.side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(self.side):
                torch.cuda._sleep(cycles)
                flag = torch.zeros(1, device=device)
                self.works.append((dist.all_reduce(flag, group=group, async_op=True), flag))
            publish(shard)

        gather.publish = held

    def drain(self) -> None:
        for work, _ in self.works:
            work.wait()
        self.works.clear()


def _zero1_run(flags: list[str], group, bucket: int, hold: int = 0, hooks: bool = True) -> dict:
    from dataclasses import replace

    from megatron_bmw.arguments import run_config_from_argv
    from megatron_bmw.parallel.state import ParallelState
    from megatron_bmw.training.loop import Trainer

    run = run_config_from_argv(flags, 1).run
    run = replace(run, optimizer=replace(run.optimizer, param_bucket_size=bucket))
    state = ParallelState.build(run.parallel, num_units=run.model.num_units)
    state.dp_group = group  # a one-rank group: the gathers and the gradient reduction run their collectives
    trainer = Trainer(run, state)
    trainer.load()
    gather = trainer.optimizer._gather
    held = HeldBack(gather, group, state.device, hold) if hold else None
    if not hooks:
        gather.remove_hooks()
    out: dict = {"losses": [], "grad_norms": [], "pending": [], "buckets": len(gather.layout.buckets)}
    for _ in range(ZERO1_ITERS):
        it = trainer.train_step()
        out["losses"].append(it.loss)
        out["grad_norms"].append(it.step.grad_norm)
        out["pending"].append(gather.pending)
    trainer.finish()  # completes the last gathers (finish_param_sync)
    if held is not None:
        held.drain()
    out["params"] = [p.detach().float().cpu().clone() for _, p in trainer.named_params]
    state.destroy()
    return out


def _same(a: dict, b: dict) -> tuple[bool, float]:
    """(losses, grad norms and parameters bit for bit; the largest parameter difference)."""
    diff = max(float((x - y).abs().max()) for x, y in zip(a["params"], b["params"]))
    same = a["losses"] == b["losses"] and a["grad_norms"] == b["grad_norms"] and \
        all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
    return same, diff


def param_gather_check(small: bool) -> dict:
    import torch.distributed as dist

    from megatron_bmw.parallel.state import init_distributed

    cuda = torch.cuda.is_available()
    if cuda:  # both runs use the same kernels; deterministic ones leave only the gathers' ordering to compare
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    init_distributed("nccl" if cuda else "gloo")
    group = dist.new_group([0])
    hidden = 64 if small else 512
    bucket = 4 * hidden * hidden  # elements: the model falls into several buckets
    runs = {"at_once": _zero1_run(zero1_flags(small, cuda, False), group, bucket),
            "at_once_again": _zero1_run(zero1_flags(small, cuda, False), group, bucket),
            "overlap": _zero1_run(zero1_flags(small, cuda, True), group, bucket)}
    if cuda:
        runs["overlap_held"] = _zero1_run(zero1_flags(small, cuda, True), group, bucket, hold=HOLD_CYCLES)
        runs["control_no_waits"] = _zero1_run(zero1_flags(small, cuda, True), group, bucket, hold=HOLD_CYCLES,
                                              hooks=False)
    ref = runs["at_once"]
    checks = {f"ZeRO-1 in several buckets ({ref['buckets']})": ref["buckets"] > 2,
              "gathering at once leaves nothing pending": not any(ref["pending"]),
              "the overlapped gathers are left pending after every step (for the pre-hooks)":
                  all(runs["overlap"]["pending"])}
    diffs = {}
    for name in ("at_once_again", "overlap", "overlap_held"):
        if name in runs:
            same, diffs[name] = _same(ref, runs[name])
            checks[f"{name}: losses, grad norms and parameters bit for bit with gathering at once"] = same
    if cuda:
        control = runs["control_no_waits"]
        checks["control: without the pre-hooks' waits the held-back gathers land late and the losses differ"] = \
            control["losses"] != ref["losses"]
    dist.destroy_process_group(group)
    dist.destroy_process_group()
    failed = [name for name, ok in checks.items() if not ok]
    notes = "failed: " + "; ".join(failed) if failed else ""
    if cuda and failed and not checks[next(k for k in checks if k.startswith("at_once_again"))]:
        notes += " (the same run twice differs: the device is not deterministic here, the comparison says nothing)"
    elif cuda and failed == [k for k in checks if k.startswith("control")]:
        notes += (" (a missing wait went unseen: the held-back gathers did not land late, so the equal runs prove"
                  " little)")
    if not cuda:
        notes = notes or "CPU: a one-rank gloo group (its gathers run on gloo's threads); no streams to hold back"
    return {"status": "failed" if failed else "ok", "device": "cuda" if cuda else "cpu",
            "backend": "nccl" if cuda else "gloo", "checks": checks,
            "max_param_diff": diffs, "buckets": ref["buckets"],
            "losses": {k: v["losses"] for k, v in runs.items()}, "notes": notes}


def _median_seconds(fn, device: torch.device, warmup: int = 3, repeats: int = 7) -> float:
    from megatron_bmw.device import timed

    times = [timed(fn, device)[0] for _ in range(warmup + repeats)][warmup:]
    return sorted(times)[len(times) // 2]


def grad_accum_check(small: bool) -> dict:
    """A GPT MLP unit's backward without GradSync (autograd writes .grad), with its hooks adding each weight gradient
    into fp32 main_grad (--no-gradient-accumulation-fusion) and fused (the weight-gradient GEMM adds into main_grad,
    parallel/wgrad_accum.py): the unfused difference is what a micro-batch spends accumulating, against the
    planner's count (EngineConfig.accumulation_bytes per parameter) at this device's measured rate of the same add;
    the fused one is what fusion leaves of it."""
    from megatron_bmw.config import ModelConfig
    from megatron_bmw.models.chunk import build_units
    from megatron_bmw.parallel import wgrad_accum
    from megatron_bmw.parallel.grad_sync import GradSync
    from megatron_bmw.parallel.state import ParallelState
    from megatron_bmw.planner.engine import EngineConfig

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = "bf16" if cuda else "fp32"
    cfg = ModelConfig(num_layers=1, hidden_size=64 if small else 2048, num_attention_heads=4 if small else 16,
                      vocab_size=256, seq_length=32 if small else 2048, hidden_dropout=0.0, attention_dropout=0.0,
                      params_dtype=dtype)
    mlp = build_units(cfg, ParallelState.serial(device), 1234)["mlp_0"]
    params = list(mlp.parameters())
    x = torch.randn(cfg.seq_length, 2, cfg.hidden_size, dtype=cfg.torch_dtype, device=device, requires_grad=True)

    def backward():
        y = mlp(x, None)
        torch.autograd.backward(y, torch.ones_like(y))
        x.grad = None
        for p in params:
            p.grad = None

    plain = _median_seconds(backward, device)
    timed = {}
    for fusion in (False, True):
        sync = GradSync(params, ParallelState.serial(device), fusion=fusion)
        timed[fusion] = _median_seconds(backward, device)
        sync.remove_hooks()
    n = sum(p.numel() for p in params)
    grad, main = torch.ones(n, dtype=cfg.torch_dtype, device=device), torch.zeros(n, dtype=torch.float32, device=device)
    per_byte = _median_seconds(lambda: main.add_(grad), device) / (n * (grad.element_size() + 8))
    predicted = n * EngineConfig(gradient_accumulation_fusion=False).accumulation_bytes(dtype) * per_byte
    measured = timed[False] - plain
    return {"status": "ok", "device": device.type, "dtype": dtype, "parameters": n,
            "backward_ms": round(plain * 1e3, 3), "with_hooks_ms": round(timed[False] * 1e3, 3),
            "fused_ms": round(timed[True] * 1e3, 3), "accumulation_ms": round(measured * 1e3, 3),
            "fused_accumulation_ms": round((timed[True] - plain) * 1e3, 3),
            "fused_kernel": wgrad_accum.kernel(cfg.torch_dtype, device), "predicted_ms": round(predicted * 1e3, 3),
            "measured_over_predicted": round(measured / predicted, 2) if predicted > 0 else None,
            "add_GBps": round(1e-9 / per_byte, 1),
            "notes": "unfused: what a micro-batch spends on fp32 gradient accumulation; fused: what the weight-gradient "
                     "GEMM's own accumulation leaves of it (the planner counts none); the CPU's figure is noisy" +
                     ("" if cuda else " (CPU run)")}


def launch_check(small: bool) -> dict:
    from tools.gpu_check_launch import launch_check as check

    return check(small)


def grouped_gemm_check(small: bool) -> dict:
    from tools.gpu_check_moe_cp import grouped_gemm_check as check

    return check(small)


def cp_blocks_check(small: bool) -> dict:
    from tools.gpu_check_moe_cp import cp_blocks_check as check

    return check(small)


def covered_check(small: bool) -> dict:
    from tools.gpu_check_covered import covered_check as check

    return check(small)


STEPS = {"env": env, "optimizer": optimizer_check, "store": store_check, "param_gather": param_gather_check,
         "grad_accum": grad_accum_check, "launch": launch_check, "grouped_gemm": grouped_gemm_check,
         "cp_blocks": cp_blocks_check, "covered": covered_check}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("step", choices=sorted(STEPS))
    p.add_argument("--json", required=True, help="write the result here")
    p.add_argument("--small", action="store_true", help="tiny sizes (the dry run)")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    out = STEPS[args.step](args.small)
    out["seconds"] = round(time.perf_counter() - t0, 2)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1, default=str)
    print(json.dumps(out, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
