"""The GPU check (issue #27): run the CUDA paths of every feature on one GPU and write a report.

    python tools/gpu_check.py OUTDIR            # on a GPU machine (scripts/gpu_check.sh wraps this)
    python tools/gpu_check.py OUTDIR --dry-run  # the same steps in tiny sizes on the CPU

Each step runs our real entry points (pretrain_gpt.py, tools/autoconfig.py) or tools/gpu_check_steps.py in a
child process with a time limit; a step that fails or runs out of time is recorded and the next one runs. After
every step OUTDIR/report.md (a table: step, status, key numbers, seconds), OUTDIR/report.json and
OUTDIR/logs.tar.gz (every command's output, the plans and the profile) are rewritten, so a run cut short still
leaves a report. Steps that need CUDA are reported as "skipped: no CUDA" without one.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_bmw.errors import OneLineParser, UsageError, exit_on_usage_error  # noqa: E402
from megatron_bmw.trials.logparse import parse_log  # noqa: E402
from megatron_bmw.paths import check_output_dir  # noqa: E402


class StepFailed(Exception):
    """A step's check did not hold (one line)."""


class StepTimeout(Exception):
    pass


# ---- sizes ------------------------------------------------------------------------------------------------------
MODEL_FLAGS = ["--make-vocab-size-divisible-by", "128", "--hidden-dropout", "0", "--attention-dropout", "0"]
COMMON = ["--mock-data", *MODEL_FLAGS, "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000000",
          "--log-throughput", "--seed", "1234", "--weight-decay", "0.01", "--clip-grad", "1.0"]
LR = ["--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2"]
LLAMA = ["--position-embedding-type", "rope", "--swiglu", "--normalization", "RMSNorm", "--group-query-attention",
         "--num-query-groups", "2", "--disable-bias-linear", "--untie-embeddings-and-output-weights"]
# a Llama-3.2-1B-like GPT (1.2B: 16 layers, GQA 32/8, SwiGLU 8192, 128k vocabulary, tied embeddings)
LLAMA_1B = ["--position-embedding-type", "rope", "--rotary-base", "500000", "--swiglu", "--normalization", "RMSNorm",
            "--group-query-attention", "--num-query-groups", "8", "--disable-bias-linear", "--ffn-hidden-size", "8192"]
MOE_AUX = ["--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3"]  # both auxiliary losses on the log line


def _moe(experts: int, topk: int, ffn: int) -> list[str]:
    """A Mixtral-like MoE (Llama-style layers, every MLP a mixture of experts) with both auxiliary losses."""
    return [*LLAMA, "--num-experts", str(experts), "--moe-router-topk", str(topk), "--moe-ffn-hidden-size", str(ffn),
            *MOE_AUX]


def _gpt(layers: int, hidden: int, heads: int, seq: int, vocab: int) -> list[str]:
    return ["--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
            "--seq-length", str(seq), "--max-position-embeddings", str(seq), "--vocab-size", str(vocab)]


@dataclass(frozen=True)
class Sizes:
    small: list[str]  # the feature runs' model
    small_batch: list[str]
    iters: int
    big: list[tuple[str, list[str], list[str]]]  # (name, model, batch) tried in order until one runs
    big_iters: int
    profiled: list[str]  # the planner check's model
    profile_mbs: str
    planned: list[tuple[int, str]]  # (micro-batch size, recomputation) runs against the planner
    planned_gbs: int
    planned_iters: int
    host_bound: tuple[list[str], int, int] | None  # a second planner case: (model, global batch, iterations)
    steps_flag: list[str]  # tools/gpu_check_steps.py sizes
    peer_iters: int  # iterations of each side of the megatron-core comparison
    moe: tuple[list[str], list[str], int]  # the moe step's GPT: (model, batch, iterations) per dispatcher
    archs: list[tuple]  # planner_archs' cases: (label, model, profile micro-batch sizes or None, planned, gbs, iters)
    fusions: list[tuple[str, list[str], list[str]]]  # the fusions step's models: (label, model, batch)
    fusion_iters: int


def _batch(mbs: int, gbs: int) -> list[str]:
    return ["--micro-batch-size", str(mbs), "--global-batch-size", str(gbs)]


GPU = Sizes(small=_gpt(4, 512, 8, 1024, 8192), small_batch=_batch(4, 16), iters=30,
            big=[("GPT 1.3B", _gpt(24, 2048, 16, 2048, 50257), _batch(2, 16)),
                 ("GPT 350M", _gpt(24, 1024, 16, 2048, 50257), _batch(4, 32))],
            # the planner check's model is the 1.3B, bound by the device as a GPU's training runs are; an 8-layer
            # GPT of hidden 1024 is bound by the host (README, "What has run on a GPU": the launch step diagnoses it)
            big_iters=40, profiled=_gpt(24, 2048, 16, 2048, 50257), profile_mbs="1,2,4",
            planned=[(1, "none"), (2, "none"), (4, "none"), (2, "full")], planned_gbs=8, planned_iters=12,
            host_bound=(_gpt(8, 1024, 16, 1024, 50257), 16, 20),
            steps_flag=[], peer_iters=30,
            moe=([*_gpt(4, 1024, 16, 2048, 32768), *_moe(8, 2, 2816)], _batch(2, 8), 20),
            # a Llama-style 0.7B (profiled) and a Mixtral-like 1.3B (8 experts, top-2; analytic: a profile has no MoE
            # unit timings, docs/gpu.md), both bound by the device
            archs=[("llama-", [*_gpt(12, 2048, 16, 2048, 32000), *LLAMA, "--ffn-hidden-size", "5632"], "1,2",
                    [(1, "none"), (2, "full")], 8, 10),
                   ("moe-", [*_gpt(8, 2048, 16, 2048, 32000), *_moe(8, 2, 2816)], None, [(1, "none"), (2, "none")],
                    8, 10)],
            fusions=[("gpt", _gpt(24, 2048, 16, 2048, 50257), _batch(2, 16)),
                     ("llama", [*_gpt(16, 2048, 32, 2048, 128256), *LLAMA_1B], _batch(2, 16))], fusion_iters=12)
DRY = Sizes(small=_gpt(2, 64, 4, 64, 512), small_batch=_batch(2, 4), iters=8,
            big=[("GPT tiny", _gpt(2, 64, 4, 64, 512), _batch(2, 4))], big_iters=6, profiled=_gpt(2, 64, 4, 64, 512),
            profile_mbs="1,2", planned=[(1, "none"), (2, "full")], planned_gbs=4, planned_iters=4, host_bound=None,
            steps_flag=["--small"], peer_iters=4,
            moe=([*_gpt(2, 64, 4, 64, 512), *_moe(4, 2, 128)], _batch(2, 4), 8),
            # one configuration each (the GPU runs two): the same code, half the processes
            archs=[("llama-", [*_gpt(2, 64, 4, 64, 512), *LLAMA, "--ffn-hidden-size", "128"], "1,2",
                    [(2, "full")], 4, 4),
                   ("moe-", [*_gpt(2, 64, 4, 64, 512), *_moe(4, 2, 128)], None, [(1, "none")], 4, 4)],
            fusions=[("gpt", _gpt(2, 64, 4, 64, 512), _batch(2, 4)),
                     ("llama", [*_gpt(2, 64, 8, 64, 512), *LLAMA_1B[:-1], "128"], _batch(2, 4))], fusion_iters=5)
PLAN_CLUSTER, PLAN_DEVICE = "h100-80g-ib", "h100-80g"  # what the planning steps plan for (one GPU of it)
FP16_ITERS = 40  # from Megatron's initial loss scale 2^32 the first ~17 iterations overflow and are skipped


# ---- running commands -------------------------------------------------------------------------------------------
@dataclass
class Context:
    out_dir: str
    work: str
    python: str
    sizes: Sizes
    cuda: bool
    dry_run: bool
    deadline: float  # monotonic time the whole check must end by
    step_deadline: float = 0.0
    log_path: str = ""
    inject: str | None = None  # "fail" or "hang" for the running step (tests)
    env: dict = field(default_factory=dict)  # the env step's result (the big run's MFU needs the peak)
    big: tuple | None = None  # (name, model flags, batch flags) of the big step's model that ran

    def command(self, argv: list[str], what: str = "") -> str:
        """Run `argv` in the repository root within the step's time; return its output; StepFailed on a
        non-zero exit (the log's last error line), StepTimeout when the time runs out."""
        if self.inject == "fail":
            argv = [self.python, "-c", "import sys; sys.exit('error: injected failure')"]
        elif self.inject == "hang":
            argv = [self.python, "-c", "import time; time.sleep(3600)"]
        limit = min(self.deadline, self.step_deadline) - time.monotonic()
        if limit < 2:
            raise StepTimeout("no time left")
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   PYTHONUNBUFFERED="1")
        with open(self.log_path, "a") as log:
            log.write(f"$ {shlex.join(argv)}\n")
        t0 = time.monotonic()
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the command's own process group (torch may spawn workers)
            out, _ = proc.communicate()
            self._log(out, f"[killed after {time.monotonic() - t0:.0f} s]")
            raise StepTimeout(f"{what or 'command'} ran out of time after {time.monotonic() - t0:.0f} s") from None
        self._log(out, f"[exit {proc.returncode} after {time.monotonic() - t0:.1f} s]")
        if proc.returncode != 0:
            summary = parse_log(out)
            why = summary.error or next((ln for ln in reversed(out.splitlines()) if ln.strip()), "no output")
            raise StepFailed(f"{what or 'command'} exited {proc.returncode}: {why.strip()[:300]}")
        return out

    def _log(self, out: str, tail: str) -> None:
        with open(self.log_path, "a") as log:
            log.write(out + ("" if out.endswith("\n") else "\n") + tail + "\n\n")

    def pretrain(self, flags: list[str], what: str) -> dict:
        """pretrain_gpt.py with `flags`; its parsed log (iterations, plan check)."""
        out = self.command([self.python, os.path.join(ROOT, "pretrain_gpt.py"), *flags], what)
        summary = parse_log(out)
        if not summary.iterations:
            raise StepFailed(f"{what}: no iteration line in its log")
        return {"iterations": summary.iterations, "plan_check": summary.plan_check, "log": out}

    def autoconfig(self, args: list[str], what: str) -> str:
        return self.command([self.python, os.path.join(ROOT, "tools", "autoconfig.py"), *args], what)

    def steps_script(self, step: str) -> dict:
        path = os.path.join(self.work, f"{step}.json")
        self.command([self.python, os.path.join(ROOT, "tools", "gpu_check_steps.py"), step, "--json", path,
                      *self.sizes.steps_flag], f"gpu_check_steps.py {step}")
        with open(path) as f:
            return json.load(f)


# ---- checks on logs ---------------------------------------------------------------------------------------------
def _losses(iterations: list[dict]) -> list[float]:
    return [it["lm_loss"] for it in iterations if "lm_loss" in it]


def _check_learning(iterations: list[dict], what: str, min_steps: int = 3) -> dict:
    losses = _losses(iterations)
    if len(losses) < min_steps:
        raise StepFailed(f"{what}: only {len(losses)} iterations with a loss (want {min_steps})")
    if not all(math.isfinite(x) for x in losses):
        raise StepFailed(f"{what}: a loss is not finite: {losses}")
    last = statistics.mean(losses[-3:])
    if not last < losses[0]:
        raise StepFailed(f"{what}: the loss did not fall ({losses[0]:.4f} first, {last:.4f} mean of the last 3)")
    return {"first_loss": round(losses[0], 4), "last_loss": round(last, 4)}


def _timing(iterations: list[dict], warmup: int = 3) -> dict:
    timed = [it for it in iterations if it["iteration"] > warmup] or iterations
    ms = statistics.median(it["elapsed_ms"] for it in timed)
    out = {"ms_per_iter": round(ms, 1)}
    tflops = [it["throughput_per_gpu_tflop_s_gpu"] for it in timed if "throughput_per_gpu_tflop_s_gpu" in it]
    if tflops:
        out["tflops"] = round(statistics.median(tflops), 1)
    return out


# the fusions step's variants per model: the first is the baseline the others are compared with
FUSIONS_OFF = ["--no-bias-swiglu-fusion", "--no-rope-fusion"]
FUSION_VARIANTS = {
    "gpt": [("flash", ["--attention-backend", "flash"]), ("cudnn", ["--attention-backend", "fused"]),
            ("ce_fusion", ["--attention-backend", "flash", "--cross-entropy-loss-fusion"])],
    "llama": [("unfused", ["--attention-backend", "flash", *FUSIONS_OFF]), ("fused_ops", ["--attention-backend", "flash"]),
              ("all", ["--attention-backend", "fused", "--cross-entropy-loss-fusion"])],
}


# ---- the steps ----------------------------------------------------------------------------------------------------
def step_env(ctx: Context) -> dict:
    env = ctx.steps_script("env")
    ctx.env = env
    keys = ("gpu", "sm_count", "memory_gib", "torch", "cuda_runtime", "matmul_bf16_tflops", "peak_bf16_tflops",
            "fused.HAVE_APEX", "fused.HAVE_TE", "apex_fused_adam")
    return {"numbers": {k: env[k] for k in keys if k in env}, "details": env, "notes": env.get("notes", "")}


def _feature_run(ctx: Context, extra: list[str], what: str, iters: int | None = None) -> dict:
    s = ctx.sizes
    run = ctx.pretrain([*COMMON, *LR, *s.small, *s.small_batch, "--train-iters", str(iters or s.iters), *extra], what)
    return run["iterations"]


def step_bf16(ctx: Context) -> dict:
    its = _feature_run(ctx, ["--bf16", "--attention-backend", "flash"], "bf16 run")
    return {"numbers": {**_check_learning(its, "bf16"), **_timing(its)}}


def step_fp16(ctx: Context) -> dict:
    its = _feature_run(ctx, ["--fp16", "--attention-backend", "flash"], "fp16 run", FP16_ITERS)
    skipped = sum(1 for it in its if "lm_loss" not in it)
    scales = [it["loss_scale"] for it in its if "loss_scale" in it]
    numbers = {"skipped_iters": skipped, "first_scale": scales[0] if scales else None,
               "last_scale": scales[-1] if scales else None}
    if not skipped or not scales or not scales[-1] < scales[0]:
        raise StepFailed(f"fp16: dynamic loss scaling did not act (skipped {skipped}, scales {scales[:1]} -> "
                         f"{scales[-1:]}) from the initial scale 2^32")
    return {"numbers": {**numbers, **_check_learning(its, "fp16")}}


def step_attention(ctx: Context) -> dict:
    losses = {}
    for backend in ("flash", "unfused"):
        its = _feature_run(ctx, ["--bf16", "--attention-backend", backend, "--lr-warmup-iters", "0"],
                           f"bf16 {backend} attention run", 1)
        losses[backend] = _losses(its)[0]
    rel = abs(losses["flash"] - losses["unfused"]) / abs(losses["unfused"])
    numbers = {"loss_flash": round(losses["flash"], 5), "loss_unfused": round(losses["unfused"], 5),
               "rel_diff": float(f"{rel:.2g}")}
    if not rel <= 1e-2:
        raise StepFailed(f"flash (SDPA) and unfused attention differ by {rel:.2%} on one batch (bf16 allows 1%)")
    return {"numbers": numbers}


def step_llama(ctx: Context) -> dict:
    its = _feature_run(ctx, ["--bf16", "--attention-backend", "flash", *LLAMA], "Llama-style bf16 run")
    return {"numbers": {**_check_learning(its, "Llama-style"), **_timing(its)}}


MOE_DISPATCHERS = ("allgather", "alltoall")


def _moe_run(ctx: Context, dispatcher: str) -> tuple[dict, list]:
    """The moe step's GPT with `dispatcher`, planned (analytic) and run with --plan: its numbers and iterations."""
    model, batch, iters = ctx.sizes.moe
    model = [*model, "--moe-token-dispatcher-type", dispatcher]
    plan = os.path.join(ctx.work, f"plan_moe_{dispatcher}.json")
    _plan(ctx, model, batch, ["mbs=" + batch[1], "recompute=none"], plan, None, f"search for the MoE GPT ({dispatcher})")
    run = ctx.pretrain([*COMMON, *LR, *model, *batch, "--bf16", "--attention-backend", "flash", "--plan", plan,
                        "--train-iters", str(iters)], f"MoE GPT run ({dispatcher})")
    its = run["iterations"]
    aux = [it for it in its if "lm_loss" in it]
    missing = [k for k in ("load_balancing_loss", "z_loss") if not all(k in it for it in aux)]
    if missing:
        raise StepFailed(f"MoE ({dispatcher}): {', '.join(missing)} missing from the log's iteration lines")
    if not all(math.isfinite(it[k]) for it in aux for k in ("load_balancing_loss", "z_loss")):
        raise StepFailed(f"MoE ({dispatcher}): an auxiliary loss is not finite")
    numbers = {**_check_learning(its, f"MoE ({dispatcher})"), **_timing(its),
               "load_balancing_loss": round(aux[-1]["load_balancing_loss"], 4), "z_loss": round(aux[-1]["z_loss"], 4)}
    p = _plan_numbers(run)
    numbers.update({k: p[k] for k in ("time_pred_s", "time_meas_s", "time_err_pct", "mem_pred_gib", "mem_meas_gib",
                                      "mem_err_pct")})
    return numbers, its


def step_moe(ctx: Context) -> dict:
    """MoE on one GPU (ep 1): the experts' grouped GEMM (tools/gpu_check_moe_cp.py) and the MoE GPT trained with each
    dispatcher, planned analytically and run with --plan: losses, auxiliary losses, predicted against measured."""
    numbers, failures = {}, []
    try:
        gemm = ctx.steps_script("grouped_gemm")
    except StepFailed as exc:  # the training runs still run
        gemm = {"status": "failed", "notes": str(exc)}
    if "grouped_mm_available" in gemm:
        numbers.update(grouped_mm=gemm["grouped_mm_available"], loop_fwd_bwd_ms=gemm["loop_fwd_bwd_ms"])
        numbers.update({k: gemm[k] for k in ("grouped_fwd_bwd_ms", "loop_over_grouped_time") if k in gemm})
        if "grouped_vs_loop" in gemm:
            numbers["grouped_vs_loop_max_err"] = max(gemm["grouped_vs_loop"].values())
        numbers["vs_fp32_max_err"] = max(gemm.get("grouped_vs_fp32", gemm["loop_vs_fp32"]).values())
    runs, first = {}, {}
    for dispatcher in MOE_DISPATCHERS:
        try:
            got, its = _moe_run(ctx, dispatcher)
        except StepFailed as exc:  # the other dispatcher still runs (a timeout ends the step)
            failures.append(str(exc))
            continue
        runs[dispatcher] = got
        first[dispatcher] = _losses(its)[0]
        numbers.update({f"{dispatcher}_{k}": got[k] for k in ("last_loss", "ms_per_iter", "time_err_pct",
                                                              "mem_err_pct")})
    if len(first) == 2:
        a, b = (first[d] for d in MOE_DISPATCHERS)
        numbers["dispatchers_first_loss_rel_diff"] = float(f"{abs(a - b) / abs(b):.2g}")
        if not numbers["dispatchers_first_loss_rel_diff"] <= 1e-3:
            failures.append(f"the dispatchers' first losses differ: {first}")
    notes = [*failures, gemm["notes"], "planned analytically (h100-80g), run with --plan"]
    status = "FAILED" if failures or gemm["status"] != "ok" else "ok"
    return {"status": status, "numbers": numbers, "details": {"grouped_gemm": gemm, "runs": runs},
            "notes": "; ".join(notes)}


def step_cp(ctx: Context) -> dict:
    """Context parallelism's kernels on one GPU: cp_blocks' fused path per block and a ring's pairs in one process
    against the math path and float64 (tools/gpu_check_moe_cp.py)."""
    out = ctx.steps_script("cp_blocks")
    blocks, ring = out["blocks"]["cases"], out["ring"]["cases"]
    numbers: dict = {"fused_kernel": next(iter(blocks.values()))["fused_kernel"]}

    def worst(row: dict, prefix: str = "") -> float | None:
        errs = [v for k, v in row.items() if k.startswith(prefix) and k.endswith("_err")]
        return max(errs) if errs else None

    for dtype, short in (("bfloat16", "bf16"), ("float16", "fp16")):
        rows = [r for k, r in blocks.items() if k.startswith(dtype) and "fused_fwd_ms" in r]
        if rows:
            numbers[f"{short}_fused_max_err"] = max(worst(r, "fused_") for r in rows)
            for phase in ("fwd", "bwd"):
                numbers[f"{short}_fused_{phase}_speedup"] = round(statistics.mean(
                    r[f"math_{phase}_ms"] / r[f"fused_{phase}_ms"] for r in rows), 2)
        by = {k.split("_", 1)[1]: r for k, r in ring.items() if k.startswith(dtype + "_")}
        pairs = next((r for k, r in by.items() if k.startswith("ring")), {})
        for key, row in (("ring_pairs", pairs), ("cp1", by.get("cp1_context_attention", {})),
                         ("sdpa", by.get("sdpa", {}))):
            numbers[f"{short}_{key}_max_err"] = worst(row)
        if "fwd_bwd_ms" in pairs and "fwd_bwd_ms" in by.get("sdpa", {}):
            numbers[f"{short}_ring_pairs_over_sdpa_time"] = round(pairs["fwd_bwd_ms"] / by["sdpa"]["fwd_bwd_ms"], 2)
    return {"status": "ok" if out["status"] == "ok" else "FAILED", "numbers": numbers,
            "details": {k: out[k] for k in ("blocks", "ring")}, "notes": out["notes"]}


def step_covered(ctx: Context) -> dict:
    """device.covered_seconds on known kernels and on the kernel model's 1.3B layer at micro-batch 1
    (tools/gpu_check_covered.py)."""
    out = ctx.steps_script("covered")
    keys = ("sleep_clock_ghz", "sleep_covered_over_asked", "small_covered_us", "small_events_us", "small_host_us",
            "small_events_over_covered", "layer_covered_over_modelled", "layer_uncovered_over_modelled",
            "max_host_over_cover")
    return {"status": "ok" if out["status"] == "ok" else "FAILED",
            "numbers": {k: out[k] for k in keys if k in out}, "details": out, "notes": out["notes"]}


def step_optimizer(ctx: Context) -> dict:
    out = ctx.steps_script("optimizer")
    if out["status"] != "ok":
        raise StepFailed(f"optimizer: {out['notes']}")
    return {"numbers": {k: out[k] for k in ("backend", "fused", "max_abs_diff_vs_foreach")}, "notes": out["notes"]}


def step_store(ctx: Context) -> dict:
    out = ctx.steps_script("store")
    if out["status"] != "ok":
        raise StepFailed(f"activation store: {out['notes']}")
    keys = ("device_to_pinned_host_GBps", "pinned_host_to_device_GBps", "peak_bytes")
    return {"numbers": {"checks_passed": len(out["checks"]), **{k: out[k] for k in keys if k in out}},
            "details": out, "notes": out["notes"]}


def step_param_gather(ctx: Context) -> dict:
    out = ctx.steps_script("param_gather")
    if out["status"] != "ok":
        raise StepFailed(f"param_gather: {out['notes']}")
    return {"numbers": {"checks_passed": len(out["checks"]), "buckets": out["buckets"], "backend": out["backend"]},
            "details": out, "notes": out["notes"]}


def step_grad_accum(ctx: Context) -> dict:
    out = ctx.steps_script("grad_accum")
    keys = ("parameters", "backward_ms", "accumulation_ms", "predicted_ms", "measured_over_predicted", "add_GBps",
            "fused_accumulation_ms", "fused_kernel")
    return {"numbers": {k: out[k] for k in keys}, "details": out, "notes": out["notes"]}


def step_launch(ctx: Context) -> dict:
    out = ctx.steps_script("launch")
    numbers = {f"{mbs}_{k.replace('_over_stream', '')}": v for mbs, r in out["results"].items()
               for k, v in r.items() if k.endswith("_over_stream")}
    numbers.update({f"{mbs}_stream_ms": r["stream_ms"] for mbs, r in out["results"].items()})
    numbers.update({f"{mbs}_host_us_per_op": r["host_us_per_op_if_host_bound"] for mbs, r in out["results"].items()
                    if "host_us_per_op_if_host_bound" in r})
    for key, short in (("us_per_backward_call", "us_per_backward_call"),
                       ("sync_over_unit_calls_stream", "sync_over_unit_calls"),
                       ("sync_and_forwards_over_full_recompute", "sync_and_forwards_over_recompute")):
        numbers.update({f"{mbs}_{short}": r[key] for mbs, r in out["results"].items() if key in r})
    return {"numbers": numbers, "details": out, "notes": out["notes"]}


def fusion_flags(model: list[str], batch: list[str], flags: list[str], iters: int) -> list[str]:
    """pretrain_gpt.py's flags for one variant of the fusions step."""
    return [*COMMON, *LR, *model, *batch, "--bf16", *flags, "--lr-warmup-iters", "0", "--train-iters", str(iters)]


def _fusion_row(ctx: Context, model: list[str], batch: list[str], flags: list[str], what: str) -> dict:
    run = ctx.pretrain(fusion_flags(model, batch, flags, ctx.sizes.fusion_iters), what)
    its = run["iterations"]
    row = {**_timing(its, warmup=min(4, len(its) - 1)), "first_loss": _losses(its)[0]}
    peak = ctx.env.get("peak_bf16_tflops")
    if peak and "tflops" in row:
        row["mfu_pct"] = round(100 * row["tflops"] / peak, 1)
    memory = parse_log(run["log"]).peak_memory_bytes
    if memory:
        row["peak_gib"] = round(memory / 2**30, 2)
    return row


def step_fusions(ctx: Context) -> dict:
    """Each model's kernel choices in turn (FUSION_VARIANTS: cuDNN attention, the fused cross entropy, SwiGLU and
    rope): ms/iter, MFU and peak memory against the model's first variant; the first iteration's loss of every
    variant within bf16's 1% of the baseline's."""
    numbers, details, failures = {}, {}, []
    for label, model, batch in ctx.sizes.fusions:
        rows = {}
        for name, flags in FUSION_VARIANTS[label]:
            try:
                rows[name] = _fusion_row(ctx, model, batch, flags, f"{label} {name} run")
            except StepFailed as exc:
                failures.append(f"{label} {name}: {exc}")
        details[label] = rows
        base = rows.get(FUSION_VARIANTS[label][0][0])
        for name, row in rows.items():
            for key in ("ms_per_iter", "mfu_pct", "peak_gib"):
                if key in row:
                    numbers[f"{label}_{name}_{key.replace('_per_iter', '')}"] = row[key]
            if base and row is not base:
                numbers[f"{label}_{name}_speedup"] = round(base["ms_per_iter"] / row["ms_per_iter"], 3)
                rel = abs(row["first_loss"] - base["first_loss"]) / abs(base["first_loss"])
                if not rel <= 1e-2:
                    failures.append(f"{label} {name}: first loss {row['first_loss']:.4f} against "
                                    f"{base['first_loss']:.4f} ({rel:.2%}, bf16 allows 1%)")
        if rows:
            numbers[f"{label}_fastest"] = min(rows, key=lambda n: rows[n]["ms_per_iter"])
    if failures:
        raise StepFailed("; ".join(failures))
    return {"numbers": numbers, "details": details}


def step_kernels(ctx: Context) -> dict:
    """benchmarks/kernel_model.py: the planner's GEMM, attention and memory-bound kernel times against this GPU's."""
    path = os.path.join(ctx.work, "kernels.json")
    flags = ["--small", "--device", "cpu", "--repeats", "1", "--models", "bloom,1.3b"] if ctx.dry_run else []
    ctx.command([ctx.python, os.path.join(ROOT, "benchmarks", "kernel_model.py"), "--json", path, *flags],
                "benchmarks/kernel_model.py")
    with open(path) as f:
        out = json.load(f)
    numbers = {f"{k.replace(' ', '_')}_ratio": round(v, 3) for k, v in out["median_ratio_by_category"].items()}
    numbers.update({f"{name}_spearman": round(m["spearman"], 2) for name, m in out["models"].items()})
    for name, m in out["models"].items():
        for t in m.get("tp_scaling", []):
            numbers[f"{name}_mbs{t['mbs']}_tp{t['tp'][1]}_over_tp{t['tp'][0]}"] = \
                f"{t['measured']:.3f} (modelled {t['modelled']:.3f})"
    numbers["largest_gemm_fraction_of_peak"] = round(out["largest_gemm"]["fraction_of_peak"], 3)
    return {"numbers": numbers, "details": {k: out[k] for k in ("layouts", "largest_gemm", "device_type", "dtype")},
            "notes": f"kernel model of device type {out['device_type']} ({out['dtype']}); measured/modelled per kind"}


def search_args(model: list[str], batch: list[str], space: list[str], path: str, profile: str | None) -> list[str]:
    """autoconfig.py's arguments for a one-GPU plan (an H100's memory; analytic times without `profile`)."""
    spaces = [x for s in ["tp=1", "pp=1", *space] for x in ("--space", s)]
    return ["search", "--cluster", PLAN_CLUSTER, "--num-nodes", "1", "--world-size", "1",
            *(["--profile", profile] if profile else []), *MODEL_FLAGS, *model, *batch, "--bf16",
            "--attention-backend", "flash", *spaces, "--no-progress", "--top-k", "1", "--output", path]


def _plan(ctx: Context, model: list[str], batch: list[str], space: list[str], path: str, profile: str | None,
          what: str) -> None:
    ctx.autoconfig(search_args(model, batch, space, path, profile), what)


def _plan_numbers(run: dict) -> dict:
    pc = run["plan_check"]
    if "predicted_s" not in pc or not pc.get("stages"):
        raise StepFailed("the --plan run printed no plan check lines")
    stage = pc["stages"][0]

    def err(measured: float, predicted: float) -> float | None:  # a tiny dry-run prediction prints as 0
        return round(100 * (measured / predicted - 1), 1) if predicted > 0 else None

    return {"time_pred_s": pc["predicted_s"], "time_meas_s": pc["measured_s"],
            "time_err_pct": err(pc["measured_s"], pc["predicted_s"]),
            "mem_pred_gib": round(stage["predicted_bytes"] / 2**30, 3),
            "mem_meas_gib": round(stage["measured_bytes"] / 2**30, 3),
            "mem_err_pct": err(stage["measured_bytes"], stage["predicted_bytes"])}


def big_space(batch: list[str]) -> list[str]:
    return ["mbs=" + batch[1], "recompute=none,selective"]


def planned_space(mbs: int, recompute: str) -> list[str]:
    return [f"mbs={mbs}", f"recompute={recompute}", "recompute-granularity=uniform"]


def step_big(ctx: Context) -> dict:
    """The largest GPT of the list that runs: tokens/s, MFU, the memory model against the measured peak."""
    failures = []
    for name, model, batch in ctx.sizes.big:
        plan = os.path.join(ctx.work, f"plan_big_{name.split()[-1]}.json")
        try:
            _plan(ctx, model, batch, big_space(batch), plan, None, f"search for {name}")
            run = ctx.pretrain([*COMMON, *LR, *model, *batch, "--bf16", "--attention-backend", "flash", "--plan",
                                plan, "--train-iters", str(ctx.sizes.big_iters)], f"{name} run")
        except StepFailed as exc:
            failures.append(f"{name}: {exc}")
            continue
        its = run["iterations"]
        numbers = {"model": name, **_timing(its, warmup=5)}
        count = re.search(r"number of parameters on .*: (\d+)", run["log"])
        if count:
            numbers["params_M"] = round(int(count.group(1)) / 1e6, 1)
        gbs, seq = int(batch[3]), int(model[model.index("--seq-length") + 1])
        numbers["tokens_per_s"] = round(gbs * seq / (numbers["ms_per_iter"] / 1e3))
        peak = ctx.env.get("peak_bf16_tflops")
        if peak and "tflops" in numbers:
            numbers["mfu_pct"] = round(100 * numbers["tflops"] / peak, 1)
        elif ctx.cuda:
            failures.append("no MFU: " + ("run the env step with it" if not ctx.env else
                                          f"no bf16 peak known for {ctx.env.get('gpu')}"))
        numbers.update(_plan_numbers(run))
        ctx.big = (name, model, batch)
        losses = _losses(its)
        if not all(math.isfinite(x) for x in losses):
            raise StepFailed(f"{name}: a loss is not finite")
        notes = "; ".join(failures)
        return {"numbers": numbers, "notes": (notes + "; " if notes else "") +
                f"plan: {os.path.basename(plan)} (analytic h100-80g profile; time prediction is analytic)"}
    raise StepFailed("; ".join(failures))


def step_peer(ctx: Context) -> dict:
    """Ours against megatron-core (when importable) on the big step's model, no recomputation, same run."""
    name, model, batch = ctx.big or ctx.sizes.big[0]
    path = os.path.join(ctx.work, "peer.json")
    argv = [ctx.python, os.path.join(ROOT, "benchmarks", "megatron_core_peer.py"), "--iters", str(ctx.sizes.peer_iters),
            "--warmup", "5", "--json", path, *(["--allow-cpu"] if not ctx.cuda else []), "--", *model, *batch]
    try:
        ctx.command(argv, "megatron_core_peer.py")
    except StepFailed:
        if not os.path.exists(path):
            raise
    with open(path) as f:
        result = json.load(f)
    rows = result["rows"]
    numbers: dict = {"model": name}
    for peer, row in rows.items():
        for key, scale, digits in (("seconds", 1e3, 1), ("tflops", 1, 1), ("mfu_pct", 1, 1),
                                   ("peak_bytes", 2**-30, 2)):
            if row.get(key) is not None:
                label = {"seconds": "ms", "peak_bytes": "peak_gib"}.get(key, key)
                numbers[f"{peer}_{label}"] = round(row[key] * scale, digits)
    for key in ("ours_over_mcore_time", "ours_over_mcore_memory"):
        if key in result:
            numbers[key] = round(result[key], 3)
    errors = {peer: row["error"] for peer, row in rows.items() if "error" in row}
    if "error" in rows.get("ours", {}):
        raise StepFailed(f"ours: {errors['ours'][:300]}")
    notes = "megatron-core: local spec, SDPA core attention, Float16Module, fp32 grad buffers, no TE/apex"
    if "not importable" in errors.get("mcore", ""):
        return {"status": "ok (ours only)", "numbers": numbers,
                "notes": errors["mcore"][:200] + "; carry its wheel (scripts/gpu_check.sh GPU_CHECK_WHEELS)"}
    if errors:
        raise StepFailed(f"megatron-core: {errors['mcore'][:300]}")
    return {"numbers": numbers, "details": result, "notes": notes}


def _profile(ctx: Context, path: str, model: list[str] | None = None, mbs: str | None = None) -> None:
    s = ctx.sizes
    ctx.autoconfig(["profile", "--output", path, *MODEL_FLAGS, *(model or s.profiled), "--bf16", "--attention-backend",
                    "flash", "--profile-micro-batch-sizes", mbs or s.profile_mbs, "--no-links", "--device-type",
                    PLAN_DEVICE], "autoconfig.py profile")


def synchronised_profile(path: str, out: str) -> bool:
    """The profile at `path` without its "stream" record, written to `out`: its units summed as synchronised
    timings, the alternative the GPU check predicts beside the profile (whose unit times the cost model takes at the
    stream's share, profile_data.py `stream_factor`). False where the profile recorded no stream (a CPU profile)."""
    with open(path) as f:
        data = json.load(f)
    if not data.pop("stream", None):
        return False
    with open(out, "w") as f:
        json.dump(data, f)
    return True


def _planner_case(ctx: Context, label: str, model: list[str], gbs: int, iters: int, profile: str | None,
                  planned: list[tuple[int, str]] | None = None, profile_mbs: str | None = None) -> tuple[dict, list]:
    """One planner case: profile `model`, then each planned configuration (default Sizes.planned) searched with the
    profile as measured, run with --plan, predicted against measured; beside it the prediction of its copy without
    the stream record (a GPU profile's synchronised unit sums) and the analytic one (no profile). `profile` None:
    the analytic prediction alone (no profile taken)."""
    from megatron_bmw.planner.plan import Plan

    s = ctx.sizes
    alternatives = []
    if profile is not None:
        _profile(ctx, profile, model, profile_mbs)
        synced = profile.replace(".json", "_sync.json")
        alternatives = [("sync", synced)] if synchronised_profile(profile, synced) else []
        alternatives.append(("analytic", None))
    rows, failures = {}, []
    for mbs, recompute in planned or s.planned:
        name = f"{label}mbs{mbs}-{recompute}"
        plan = os.path.join(ctx.work, f"plan_{name}.json")
        batch = _batch(mbs, gbs)
        space = planned_space(mbs, recompute)
        try:
            _plan(ctx, model, batch, space, plan, profile, f"search for {name}")
            run = ctx.pretrain([*COMMON, *LR, *model, *batch, "--bf16", "--attention-backend", "flash",
                                "--plan", plan, "--train-iters", str(iters)], f"{name} run")
            p = _plan_numbers(run)
            rows[name] = {k: p[k] for k in ("time_pred_s", "time_meas_s", "time_err_pct", "mem_err_pct")}
            for key, source in alternatives:
                alt = os.path.join(ctx.work, f"plan_{name}_{key}.json")
                _plan(ctx, model, batch, space, alt, source, f"search for {name} ({key})")
                pred = Plan.load(alt).prediction["iteration_time_s"]
                rows[name].update({f"time_pred_{key}_s": round(pred, 4),
                                   f"time_err_{key}_pct": round(100 * (p["time_meas_s"] / pred - 1), 1)})
        except StepTimeout:
            raise
        except StepFailed as exc:
            failures.append(f"{name}: {exc}")
    return rows, failures


def step_planner(ctx: Context) -> dict:
    """autoconfig.py profile on this device, then predicted against measured step time (and memory) for a few
    single-GPU configurations planned with that profile: the big step's 1.3B (bound by the device), then an
    8-layer GPT (bound by the host); beside each prediction the one from the profile's synchronised unit sums
    (without its "stream" record, which the cost model scales them by) and the analytic one."""
    s = ctx.sizes
    cases = [("", s.profiled, s.planned_gbs, s.planned_iters, os.path.join(ctx.work, "profile.json"))]
    if s.host_bound is not None:
        model, gbs, iters = s.host_bound
        cases.append(("small-", model, gbs, iters, os.path.join(ctx.work, "profile_small.json")))
    rows, failures = {}, []
    for label, model, gbs, iters, profile in cases:
        got, failed = _planner_case(ctx, label, model, gbs, iters, profile)
        rows.update(got)
        failures += failed
    if not rows:
        raise StepFailed("; ".join(failures) or "no configuration ran")

    def worst(small: bool, key: str) -> float | None:
        values = [abs(r[key]) for n, r in rows.items() if n.startswith("small-") == small and r.get(key) is not None]
        return max(values) if values else None

    numbers = {"configs": len(rows), "worst_time_err_pct": worst(False, "time_err_pct"),
               "worst_mem_err_pct": worst(False, "mem_err_pct"),
               "worst_time_err_sync_pct": worst(False, "time_err_sync_pct"),
               "worst_time_err_analytic_pct": worst(False, "time_err_analytic_pct")}
    if s.host_bound is not None:
        numbers.update(small_worst_time_err_pct=worst(True, "time_err_pct"),
                       small_worst_time_err_sync_pct=worst(True, "time_err_sync_pct"),
                       small_worst_time_err_analytic_pct=worst(True, "time_err_analytic_pct"))
    for label, *_ in cases:
        numbers.update(pick_numbers(label, {n: r for n, r in rows.items() if n.startswith(label)
                                            and (label or not n.startswith("small-"))}))
    if failures:
        raise StepFailed("; ".join(failures))
    return {"numbers": numbers, "details": rows}


def step_planner_archs(ctx: Context) -> dict:
    """The planner step's comparison for a Llama-style GPT (profiled here: the profile's, its synchronised sums' and
    the analytic prediction) and a Mixtral-like MoE (analytic: a profile times the MoE unit as an "mlp", and search
    refuses it for an MoE model), a couple of single-GPU plans each, predicted against measured."""
    rows, failures, numbers = {}, [], {}
    for label, model, profile_mbs, planned, gbs, iters in ctx.sizes.archs:
        profile = os.path.join(ctx.work, f"profile_{label.rstrip('-')}.json") if profile_mbs else None
        got, failed = _planner_case(ctx, label, model, gbs, iters, profile, planned, profile_mbs)
        rows.update(got)
        failures += failed
        for key in ("time_err_pct", "mem_err_pct", "time_err_sync_pct", "time_err_analytic_pct"):
            values = [abs(r[key]) for r in got.values() if r.get(key) is not None]
            if values:
                numbers[f"{label}worst_{key}"] = max(values)
        numbers.update(pick_numbers(label, got))
    if not rows:
        raise StepFailed("; ".join(failures) or "no configuration ran")
    notes = "MoE: analytic prediction only (autoconfig.py profile times an MoE model's expert layer as kind 'mlp'; " \
            "search with that profile stops at 'has no moe timings')"
    if failures:
        return {"status": "FAILED", "numbers": numbers, "details": rows, "notes": "; ".join(failures) + "; " + notes}
    return {"numbers": numbers, "details": rows, "notes": notes}


def pick_numbers(label: str, rows: dict) -> dict:
    """What a search among one case's configurations would have picked: the measured time of the fastest predicted
    one over the fastest measured (per prediction: the profile's, the synchronised sums', the analytic one)."""
    if len(rows) < 2:
        return {}
    best = min(r["time_meas_s"] for r in rows.values())
    out = {}
    for key, pred in (("", "time_pred_s"), ("sync_", "time_pred_sync_s"), ("analytic_", "time_pred_analytic_s")):
        if all(r.get(pred) for r in rows.values()):
            picked = min(rows.values(), key=lambda r: r[pred])
            out[f"{label}{key}pick_over_best_pct"] = round(100 * (picked["time_meas_s"] / best - 1), 1)
    return out


def synthetic_numbers(flags: list[str]) -> dict:
    """planner/allocation_trace.py for the run of `flags` (one GPU; the --plan's choices where given): the
    memory model's tensors in the schedule's order through the caching-allocator model, to set beside the
    recorded trace. {"error": ...} where it cannot be built."""
    from megatron_bmw.arguments import run_config_from_argv
    from megatron_bmw.planner.allocation_trace import synthetic_allocator
    from megatron_bmw.planner.spec import RunSpec

    try:
        run = run_config_from_argv(flags, 1).run
        spec = RunSpec.of(run.model, 1, 1, 1, run.pipeline)
        got = synthetic_allocator(spec, iterations=2)
    except (UsageError, ValueError) as exc:
        return {"error": str(exc)}
    return {"synthetic_peak_allocated_gib": round(got["peak_allocated"] / 2**30, 3),
            "synthetic_allocator_fraction": round(got["allocator_fraction"], 4), "segments": got["segments"]}


def derived_terms(model: list[str], mbs: int, cluster: str, device_type: str):
    """planner/cuda_allowance.py's terms for `model` (flags) on one GPU of `device_type` (tp, dp, pp 1), bf16."""
    from megatron_bmw.arguments import run_config_from_argv
    from megatron_bmw.planner.cluster import load_cluster
    from megatron_bmw.planner.cuda_allowance import allowance_terms
    from megatron_bmw.planner.memory_model import precision_from

    flags = ["--mock-data", *MODEL_FLAGS, *model, "--bf16", *_batch(mbs, mbs)]
    cfg = run_config_from_argv(flags, 1).run.model
    device = load_cluster(cluster).device_type(device_type)
    return allowance_terms(device, cfg, 1, 1, 1, mbs, False, precision_from(cfg, False))


def allowance_numbers(profile: dict, model: list[str], mbs: int, cluster: str, device_type: str) -> dict:
    """The CUDA allowance's terms a profile measured (its "cuda_memory", training/cuda_memory.py) beside those
    planner/cuda_allowance.py derives without it, for the profiled model on one GPU of `device_type` (tp, dp, pp 1)
    at micro-batch `mbs`. StepFailed when a measured term is missing on CUDA or out of range."""
    derived = derived_terms(model, mbs, cluster, device_type)
    numbers = {"context_gib_derived": round(derived.context / 2**30, 3),
               "allocator_fraction_derived": round(derived.fragmentation, 4),
               "cublas_mib_derived": round(derived.cublas / 2**20, 1), "nccl_communicators": derived.communicators}
    measured = profile.get("cuda_memory") or {}
    if profile.get("device", {}).get("kind") != "cuda":
        if measured:
            raise StepFailed(f"a {profile.get('device', {}).get('kind')} profile holds CUDA readings: {measured}")
        return numbers
    after = measured.get("samples", {}).get("after", {})
    context, fraction = measured.get("context_bytes"), measured.get("allocator_fraction")
    if context is None or fraction is None or not after:
        raise StepFailed(f"the GPU profile has no measured CUDA terms (cuda_memory: {sorted(measured)})")
    if not 0 < context < after.get("total", 0) or not 0 <= fraction < 10 or not after.get("max_allocated"):
        raise StepFailed(f"measured terms out of range: context {context} B, allocator fraction {fraction}, "
                         f"readings {after}")
    numbers.update(context_gib_measured=round(context / 2**30, 3), allocator_fraction_measured=round(fraction, 4),
                   max_allocated_gib=round(after["max_allocated"] / 2**30, 3),
                   max_reserved_gib=round(after["max_reserved"] / 2**30, 3))
    if measured.get("nccl_bytes_per_communicator") is not None:
        numbers["nccl_mib_per_communicator_measured"] = round(measured["nccl_bytes_per_communicator"] / 2**20, 1)
    return numbers


def step_allowance(ctx: Context) -> dict:
    """The CUDA allowance's measured terms: the planner step's profile when it ran, else `autoconfig.py profile`
    on this device; against the derived terms."""
    s = ctx.sizes
    profile = os.path.join(ctx.work, "profile.json")
    source = "the planner step's profile"
    if not os.path.exists(profile):
        profile = os.path.join(ctx.work, "allowance_profile.json")
        source = "autoconfig.py profile"
        _profile(ctx, profile)
    with open(profile) as f:
        data = json.load(f)
    mbs = max(int(x) for x in s.profile_mbs.split(","))
    numbers = allowance_numbers(data, s.profiled, mbs, PLAN_CLUSTER, PLAN_DEVICE)
    notes = [f"measured: {source} ({os.path.basename(profile)}, micro-batch sizes {s.profile_mbs}); derived: "
             f"{PLAN_DEVICE} of {PLAN_CLUSTER}, micro-batch {mbs}; cuBLAS workspaces are allocated "
             "tensors to the allocator, so no reading isolates them; NCCL bytes need --profile-tp 2 on two GPUs"]
    if not ctx.cuda:
        notes.append("CPU: no CUDA readings, derived terms only")
    return {"numbers": numbers, "details": data.get("cuda_memory") or {}, "notes": "; ".join(notes)}


def step_allocator(ctx: Context) -> dict:
    """The big step's GPT (else the first one) for two iterations with --record-memory-history: the caching
    allocator's overhead at the peak, from the snapshot, against the allocator fraction planner/cuda_allowance.py
    derives, planner/caching_allocator.py replaying the recorded requests, and the same model on the synthetic
    trace of the run (planner/allocation_trace.py: the memory model's tensors in the schedule's order), to see
    whether it reserves what the real one did. The trace's (code, size, address)
    events are kept in the logs (allocator_trace.json); the snapshot itself is not (its stacks are large)."""
    from megatron_bmw.planner.caching_allocator import replay
    from megatron_bmw.training.memory_history import TRACE_CODES, read_snapshot, summarize, trace_events

    name, model, batch = ctx.big or ctx.sizes.big[0]
    snap = os.path.join(ctx.work, "snapshot.pickle")
    # two iterations (the optimizer's states appear in the first): the whole run fits the trace's 100,000 entries
    # (warm-up 1: a warm-up as long as the run is refused)
    flags = [*COMMON, *LR[:-2], "--lr-warmup-iters", "1", *model, *batch, "--bf16", "--attention-backend", "flash",
             "--train-iters", "2",
             "--log-interval", "2", "--record-memory-history", "--memory-snapshot-path", snap]
    plan = os.path.join(ctx.work, f"plan_big_{name.split()[-1]}.json")
    if ctx.big and os.path.exists(plan):
        flags += ["--plan", plan]
    ctx.pretrain(flags, f"{name} with --record-memory-history")
    try:
        data = read_snapshot(snap)
    finally:
        if os.path.exists(snap):
            os.remove(snap)
    s, events = summarize(data), trace_events(data)
    with open(os.path.join(ctx.work, "allocator_trace.json"), "w") as f:
        json.dump({"codes": TRACE_CODES, "fields": ["code", "size", "addr"], "events": [list(e) for e in events],
                   "end": {"allocated_bytes": s["allocated_end_bytes"], "reserved_bytes": s["reserved_end_bytes"]}},
                  f)
    if s["allocator_fraction"] is None:
        raise StepFailed(f"the snapshot recorded no allocation ({s['events']} events)")
    derived = derived_terms(model, int(batch[1]), PLAN_CLUSTER, PLAN_DEVICE)
    numbers = {"model": name, "events": s["events"], "peak_allocated_gib": round(s["peak_allocated_bytes"] / 2**30, 3),
               "peak_reserved_gib": round(s["peak_reserved_bytes"] / 2**30, 3),
               "allocator_fraction_measured": round(s["allocator_fraction"], 4),
               "allocator_fraction_derived": round(derived.fragmentation, 4)}
    try:  # planner/caching_allocator.py replaying the run's requests: does it reserve what the allocator did?
        replayed = replay(events)
        numbers.update(model_peak_reserved_gib=round(replayed["model_peak_reserved"] / 2**30, 3),
                       model_same_segments=replayed["same_segments"])
    except ValueError as exc:
        replayed = {"error": str(exc)}
    synthetic = synthetic_numbers([f for f in flags if f not in ("--record-memory-history", "--memory-snapshot-path",
                                                                 snap)])
    numbers.update({k: synthetic[k] for k in ("synthetic_peak_allocated_gib", "synthetic_allocator_fraction")
                    if k in synthetic})
    return {"numbers": numbers, "details": {**{k: v for k, v in s.items() if k != "most_requested"},
                                            "allocator_model": replayed, "synthetic": synthetic},
            "notes": "peaks over the recorded window (the last 100,000 events); the derived fraction counts "
                     "rounding and segment tails, not the gaps between live blocks"}


@dataclass(frozen=True)
class Step:
    name: str
    what: str
    run: Callable[[Context], dict]
    timeout_s: float
    cuda_only: bool = False


STEPS = [  # the most telling first: later ones are skipped when the check's time runs out
    Step("env", "torch/CUDA, GPU, apex/TE detection, bf16 matmul rate", step_env, 90),
    # CUDA paths no GPU has run yet (docs/gpu.md, "Steps for the MoE and context-parallel paths")
    Step("moe", "MoE on one GPU: grouped GEMM vs loop, training with both dispatchers, plan vs measured", step_moe,
         180),
    Step("cp", "context parallelism's fused flash blocks and a ring's pairs vs math and float64", step_cp, 90),
    Step("covered", "device.covered_seconds: sleep, tiny kernels and the 1.3B layer vs plain events", step_covered,
         60),
    Step("fusions", "kernel choices without Transformer Engine (cuDNN attention, fused cross entropy, SwiGLU, rope) "
         "on the 1.3B GPT and a Llama-style 1.2B: ms/iter, MFU, memory", step_fusions, 300),
    Step("kernels", "the planner's kernel model (GEMMs, attention, memory-bound) against this GPU's kernels",
         step_kernels, 120),
    Step("bf16", "bf16 GPT training, flash (SDPA) attention: loss falls", step_bf16, 120),
    Step("store", "BPipe activation store: side-stream copies, events, pinned host copies", step_store, 90),
    Step("optimizer", "our Adam (fused on CUDA) vs torch foreach AdamW", step_optimizer, 60),
    Step("param_gather", "ZeRO-1 --overlap-param-gather on a one-rank NCCL group: bit for bit with gathering at once",
         step_param_gather, 90),
    Step("big", "single-GPU GPT (1.3B, else 350M) seq 2048: tokens/s, MFU, memory model", step_big, 220),
    Step("peer", "the big step's GPT, ours vs megatron-core (if importable): ms/iter, MFU, memory", step_peer, 200),
    Step("planner", "autoconfig.py profile + predicted vs measured step time, 4 configs of a 1.3B and of an 8-layer "
         "GPT", step_planner, 420),
    Step("planner_archs", "predicted vs measured for a Llama-style GPT (profiled) and an MoE (analytic), 2 configs "
         "each", step_planner_archs, 300),
    Step("launch", "per-unit timings (synchronised, host, event span, behind a sleep) against a unit stream",
         step_launch, 90),
    Step("allowance", "CUDA allowance: measured (profile's cuda_memory) vs derived terms", step_allowance, 120),
    Step("allocator", "the caching allocator's overhead at the peak of a training run (--record-memory-history) vs "
         "the derived allocator fraction", step_allocator, 150, cuda_only=True),
    Step("grad_accum", "fp32 main_grad accumulation per micro-batch, unfused vs the planner's bytes, and fused",
         step_grad_accum, 60),
    Step("fp16", "fp16 with dynamic loss scaling from 2^32: skips, then loss falls", step_fp16, 120),
    Step("attention", "flash (SDPA) vs unfused attention: same loss on one batch", step_attention, 120),
    Step("llama", "rope + SwiGLU + RMSNorm + GQA, bf16: loss falls", step_llama, 120),
]


# steps whose details the report prints
DETAILED = ("kernels", "store", "param_gather", "peer", "planner", "launch", "allowance", "allocator", "moe", "cp",
            "covered", "planner_archs", "fusions")


# ---- the report ---------------------------------------------------------------------------------------------------
def _numbers_text(numbers: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in numbers.items() if v is not None)


def write_report(ctx: Context, results: list[dict], started: str, finished: bool) -> None:
    env = ctx.env
    data = {"started": started, "finished": finished, "mode": "dry-run" if ctx.dry_run else "gpu",
            "cuda": ctx.cuda, "device": env.get("gpu") or ("cpu" if not ctx.cuda else None), "steps": results}
    with open(os.path.join(ctx.out_dir, "report.json"), "w") as f:
        json.dump(data, f, indent=1, default=str)
    lines = [f"# GPU check ({data['mode']}), started {started}", "",
             f"device: {data['device']}; torch {env.get('torch')}; CUDA {env.get('cuda_runtime')}; "
             f"apex {env.get('apex_import')}; transformer-engine {env.get('transformer_engine_import')}",
             "" if finished else "**incomplete: the check was still running when this was written**", "",
             "| step | status | key numbers | seconds |", "|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['name']} | {r['status']} | {_numbers_text(r.get('numbers', {}))} | {r['seconds']} |")
    lines.append("")
    for r in results:
        if r.get("notes"):
            lines.append(f"- **{r['name']}**: {r['notes']}")
    for r in results:
        if r.get("details") and isinstance(r["details"], dict) and r["name"] in DETAILED:
            lines += ["", f"## {r['name']}", "", "```", json.dumps(r["details"], indent=1, default=str), "```"]
    lines += ["", "Logs of every command, the plans and the profile: logs.tar.gz."]
    with open(os.path.join(ctx.out_dir, "report.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with tarfile.open(os.path.join(ctx.out_dir, "logs.tar.gz"), "w:gz") as tar:
        tar.add(ctx.work, arcname="gpu_check")


INJECTED_HANG_S = 4.0


def run_step(ctx: Context, step: Step, timeout_cap: float | None) -> dict:
    t0 = time.monotonic()
    result = {"name": step.name, "what": step.what}
    ctx.log_path = os.path.join(ctx.work, f"{step.name}.log")
    limit = min(step.timeout_s, timeout_cap or step.timeout_s)
    if ctx.inject == "hang":  # the runner's kill path, without waiting out a real step's limit
        limit = min(limit, INJECTED_HANG_S)
    ctx.step_deadline = t0 + limit
    try:
        if step.cuda_only and not ctx.cuda:
            result.update(status="skipped: no CUDA")
        elif not ctx.cuda and not ctx.dry_run and step.name != "env":
            result.update(status="skipped: no CUDA (--dry-run runs the CPU sizes)")
        elif ctx.deadline - t0 < 5:
            result.update(status="skipped: out of time")
        else:
            result.update({"status": "ok", **step.run(ctx)})  # a step may return its own status
    except StepTimeout as exc:
        result.update(status="timeout", notes=str(exc))
    except StepFailed as exc:
        result.update(status="FAILED", notes=str(exc))
    except Exception as exc:  # noqa: BLE001 - a bug in a step must not stop the others
        result.update(status="FAILED", notes=f"{type(exc).__name__}: {exc}")
    result["seconds"] = round(time.monotonic() - t0, 1)
    return result


def _parse_inject(values: list[str]) -> dict[str, str]:
    out = {}
    for v in values:
        name, _, how = v.partition("=")
        if name not in {s.name for s in STEPS} or how not in ("fail", "hang"):
            raise UsageError(f"--inject {v!r}: give STEP=fail or STEP=hang with a step of "
                             f"{','.join(s.name for s in STEPS)}")
        out[name] = how
    return out


@exit_on_usage_error
def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="gpu_check.py", description=__doc__.splitlines()[0])
    p.add_argument("out_dir", help="report.md, report.json and logs.tar.gz are written here")
    p.add_argument("--dry-run", action="store_true", help="tiny sizes, on the CPU when there is no GPU")
    p.add_argument("--steps", default=None, help=f"comma-separated subset of {','.join(s.name for s in STEPS)}")
    p.add_argument("--budget-s", type=float, default=None, help="the whole check's time (default 510 s, dry 300)")
    p.add_argument("--step-timeout-s", type=float, default=None, help="cap every step's time limit")
    p.add_argument("--inject", action="append", default=[],
                   help="STEP=fail or STEP=hang (tests the runner; a hang is cut after 4 s)")
    p.add_argument("--python", default=sys.executable, help="interpreter for the steps")
    args = p.parse_args(argv)
    names = [s.name for s in STEPS]
    chosen = names if args.steps is None else args.steps.split(",")
    unknown = [n for n in chosen if n not in names]
    if unknown:
        raise UsageError(f"--steps: unknown step {unknown[0]!r} (steps: {','.join(names)})")
    inject = _parse_inject(args.inject)
    for flag, value in (("--budget-s", args.budget_s), ("--step-timeout-s", args.step_timeout_s)):
        if value is not None and not 0 < value < math.inf:
            raise UsageError(f"{flag} must be a number of seconds > 0, got {value:g}")
    check_output_dir("out_dir", args.out_dir)
    import torch

    cuda = torch.cuda.is_available()
    budget = args.budget_s or (300.0 if args.dry_run else 510.0)
    work = tempfile.mkdtemp(prefix="gpu_check_")
    ctx = Context(out_dir=args.out_dir, work=work, python=args.python, sizes=DRY if args.dry_run else GPU,
                  cuda=cuda, dry_run=args.dry_run, deadline=time.monotonic() + budget)
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    results: list[dict] = []
    for step in STEPS:
        if step.name not in chosen:
            continue
        ctx.inject = inject.get(step.name)
        result = run_step(ctx, step, args.step_timeout_s)
        results.append(result)
        print(f"[gpu_check] {step.name}: {result['status']} ({result['seconds']} s) "
              f"{_numbers_text(result.get('numbers', {}))} {result.get('notes', '')}".rstrip(), flush=True)
        write_report(ctx, results, started, finished=False)
    write_report(ctx, results, started, finished=True)
    shutil.rmtree(work, ignore_errors=True)
    print(f"[gpu_check] report: {os.path.join(args.out_dir, 'report.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
