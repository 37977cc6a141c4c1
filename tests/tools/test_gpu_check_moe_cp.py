"""The GPU check's MoE, context-parallel, covered-timing and planner_archs steps in their CPU form (issue #52): the
in-process parts run the CPU kernels at tiny sizes, and the whole steps through tools/gpu_check.py --dry-run."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", f"{name}.py"))
    module = sys.modules[name] = importlib.util.module_from_spec(spec)  # tools/ is not a package
    spec.loader.exec_module(module)
    return module


gpu_check = _load("gpu_check")


def _steps(tmp_path, step: str) -> dict:
    steps = _load("gpu_check_steps")
    path = tmp_path / f"{step}.json"
    assert steps.main([step, "--small", "--json", str(path)]) == 0
    return json.loads(path.read_text())


def test_grouped_gemm_runs_the_experts_both_ways_against_fp32(tmp_path):
    import torch

    from megatron_bmw.models import moe_experts

    before = dict(moe_experts._GROUPED_OK)
    out = _steps(tmp_path, "grouped_gemm")
    assert out["status"] == "ok", out["notes"]
    assert out["device"] == "cpu" and out["dtype"] == "bf16" and out["counts"][1] == 0 and sum(out["counts"]) == 64
    assert out["grouped_mm_available"] is True  # torch 2.13's CPU grouped GEMM takes bf16
    assert set(out["grouped_vs_loop"]) == {"output", "d_rows", "d_fc1_weight", "d_fc2_weight"}
    assert max(out["grouped_vs_loop"].values()) < 2e-2 and 0 < max(out["loop_vs_fp32"].values()) < 2e-2
    assert out["grouped_fwd_bwd_ms"] > 0 and out["loop_fwd_bwd_ms"] > 0
    # the forced results are put back: what is left is the probe's own (fp32 was forced for the reference only)
    assert moe_experts._GROUPED_OK == {**before, ("cpu", torch.bfloat16): True}


def test_cp_blocks_fused_and_math_against_float64(tmp_path):
    from megatron_bmw.parallel import cp_blocks

    out = _steps(tmp_path, "cp_blocks")
    assert out["status"] == "ok", out["notes"]
    assert cp_blocks.USE_FUSED  # put back
    cases = out["blocks"]["cases"]
    assert set(cases) == {"bfloat16_causal", "bfloat16_unmasked", "float16_causal", "float16_unmasked"}
    for name, row in cases.items():
        assert row["fused_kernel"] == "cpu"  # the CPU's flash kernels: the fused path ran, not the math one
        assert row["fused_out_err"] > row["math_out_err"]  # the fused block's output is 16-bit, the math one fp32
        assert all(row[f"{p}_{k}_err"] < 3e-2 for p in ("fused", "math") for k in ("out", "lse", "dq", "dk", "dv"))
        assert row["fused_fwd_ms"] > 0 and row["math_bwd_ms"] > 0
    assert out["blocks"]["shape"]["g"] < out["blocks"]["shape"]["n"]  # grouped-query heads
    ring = out["ring"]["cases"]
    assert set(ring) == {f"{d}_{c}" for d in ("bfloat16", "float16")
                         for c in ("ring2_pairs", "cp1_context_attention", "sdpa")}
    assert all(r["out_err"] < 3e-2 and r["dk_err"] < 3e-2 and r["fwd_bwd_ms"] > 0 for r in ring.values())
    assert "cannot share one GPU under NCCL" in out["notes"]


def test_covered_step_runs_the_kernel_models_layer_on_the_cpu(tmp_path):
    out = _steps(tmp_path, "covered")
    assert out["status"] == "ok" and out["device"] == "cpu" and "need CUDA" in out["notes"]
    assert out["device_type"] == "h100-80g" and out["layer_uncovered_over_modelled"] > 0
    assert "layer_covered_over_modelled" not in out and "sleep_clock_ghz" not in out
    kernels = {r["kernel"] for r in out["rows"]}
    assert {"QKV fwd", "fc1 wgrad", "flash fwd", "logits fwd"} <= kernels
    assert all(r["uncovered_ms"] > 0 and r["covered_ms"] is None for r in out["rows"])


def test_the_new_steps_gpu_sizes_plan_on_one_h100(tmp_path, capsys):
    """The MoE step's GPT (both dispatchers) and planner_archs' models get a one-GPU plan that fits an H100 80GB
    with room to spare (torch-free searches, as the GPU run makes them)."""
    from megatron_bmw.cli.autoconfig import main
    from megatron_bmw.planner.plan import Plan

    model, batch, _ = gpu_check.GPU.moe
    cases = [([*model, "--moe-token-dispatcher-type", d], batch, ["mbs=" + batch[1], "recompute=none"])
             for d in gpu_check.MOE_DISPATCHERS]
    for _, arch, _, planned, gbs, _ in gpu_check.GPU.archs:
        cases += [(arch, gpu_check._batch(mbs, gbs), gpu_check.planned_space(mbs, rc)) for mbs, rc in planned]
    for i, (m, b, space) in enumerate(cases):
        path = str(tmp_path / f"plan{i}.json")
        assert main(gpu_check.search_args(m, b, space, path, None)) == 0
        plan = Plan.load(path)
        stage = plan.prediction["stages"][0]
        assert stage["peak_bytes"] < 0.6 * stage["capacity_bytes"], (m, stage)
        assert plan.spec.pipeline.micro_batch_size == int(b[1])
    capsys.readouterr()


@pytest.mark.slow
def test_dry_run_of_the_moe_cp_covered_and_planner_archs_steps(tmp_path):
    out = tmp_path / "report"
    argv = [sys.executable, os.path.join(ROOT, "tools", "gpu_check.py"), str(out), "--dry-run",
            "--steps", "moe,cp,covered,planner_archs", "--step-timeout-s", "200"]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=400, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert run.returncode == 0, run.stderr
    data = json.loads((out / "report.json").read_text())
    steps = {s["name"]: s for s in data["steps"]}
    assert list(steps) == ["moe", "cp", "covered", "planner_archs"]  # the table's order
    assert all(s["status"] == "ok" for s in steps.values()), {k: s.get("notes") for k, s in steps.items()}
    moe = steps["moe"]["numbers"]  # both dispatchers trained, with their auxiliary losses, and were predicted
    assert moe["grouped_mm"] is True and moe["grouped_vs_loop_max_err"] < 2e-2
    assert moe["dispatchers_first_loss_rel_diff"] <= 1e-3
    for d in gpu_check.MOE_DISPATCHERS:
        run_ = steps["moe"]["details"]["runs"][d]
        assert run_["last_loss"] < run_["first_loss"] and run_["load_balancing_loss"] > 0 and run_["z_loss"] > 0
        assert run_["time_pred_s"] > 0 and run_["mem_pred_gib"] > 0 and moe[f"{d}_ms_per_iter"] > 0
    cp = steps["cp"]["numbers"]
    assert cp["fused_kernel"] == "cpu" and cp["bf16_fused_max_err"] < 3e-2 and cp["fp16_ring_pairs_max_err"] < 5e-3
    assert steps["covered"]["numbers"]["layer_uncovered_over_modelled"] > 0
    archs = steps["planner_archs"]
    rows = archs["details"]
    assert set(rows) == {"llama-mbs2-full", "moe-mbs1-none"}  # the dry run's one configuration of each
    assert all(r["time_pred_s"] > 0 and r["time_meas_s"] > 0 for r in rows.values())
    assert "time_pred_analytic_s" in rows["llama-mbs2-full"] and "time_pred_analytic_s" not in rows["moe-mbs1-none"]
    assert {"llama-worst_time_err_pct", "moe-worst_mem_err_pct"} <= set(archs["numbers"])  # picks: one row each
    assert "analytic prediction only" in archs["notes"]
    table = (out / "report.md").read_text()
    assert all(f"## {name}" in table for name in steps)  # their details are printed


def test_a_fused_kernel_that_raises_is_recorded_and_the_other_cases_still_run(monkeypatch):
    """cp_blocks sent down its CUDA branch on CPU tensors (the CUDA kernel does not take them): every fused case
    records the error, the math path, the float64 reference and SDPA still run, and the step's numbers skip what
    is missing."""
    import torch

    from megatron_bmw.parallel import cp_blocks

    moe_cp = _load("gpu_check_moe_cp")
    monkeypatch.setattr(cp_blocks, "fused_kind", lambda q: None if q.dtype == torch.float64 or not cp_blocks.USE_FUSED
                        else "cuda")
    blocks, problems = moe_cp.block_cases(True, torch.device("cpu"))
    ring, ring_problems = moe_cp.ring_cases(True, torch.device("cpu"))
    assert all("fused_error" in r and "fused_out_err" not in r and r["math_out_err"] < 1e-4
               for r in blocks["cases"].values())
    assert len(problems) == 4 and all("the fused path raised" in p for p in problems)
    assert {k for k, r in ring["cases"].items() if "error" in r} == {
        f"{d}_{c}" for d in ("bfloat16", "float16") for c in ("ring2_pairs", "cp1_context_attention")}
    assert ring["cases"]["bfloat16_sdpa"]["out_err"] < 3e-2 and len(ring_problems) == 4

    class Ctx:
        @staticmethod
        def steps_script(step):
            return {"status": "failed", "blocks": blocks, "ring": ring, "notes": "; ".join(problems + ring_problems)}

    out = gpu_check.step_cp(Ctx)
    assert out["status"] == "FAILED" and out["numbers"]["fused_kernel"] == "cuda"
    assert "bf16_fused_max_err" not in out["numbers"] and out["numbers"]["bf16_ring_pairs_max_err"] is None
    assert out["numbers"]["bf16_sdpa_max_err"] < 3e-2
