"""tools/gpu_check.py's dry run on the CPU: the report's shape, a failing and a hanging step recorded while the
others still run, and one-line usage errors."""

import importlib.util
import json
import os
import subprocess
import sys
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "tools", "gpu_check.py"))
gpu_check = sys.modules["gpu_check"] = importlib.util.module_from_spec(_spec)  # tools/ is not a package
_spec.loader.exec_module(gpu_check)


@pytest.mark.slow
def test_dry_run_reports_every_step_and_survives_failures(tmp_path):
    out = tmp_path / "report"
    argv = [sys.executable, os.path.join(ROOT, "tools", "gpu_check.py"), str(out), "--dry-run",
            "--steps", "env,bf16,store,optimizer,fp16", "--inject", "optimizer=hang", "--inject", "fp16=fail",
            "--step-timeout-s", "12"]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert run.returncode == 0, run.stderr
    data = json.loads((out / "report.json").read_text())
    assert data["finished"] is True and data["mode"] == "dry-run"
    steps = {s["name"]: s for s in data["steps"]}
    assert list(steps) == ["env", "bf16", "store", "optimizer", "fp16"]  # the table's order, after the failures too
    assert all({"name", "what", "status", "seconds"} <= set(s) for s in data["steps"])
    assert steps["env"]["status"] == "ok" and steps["env"]["numbers"]["torch"]
    bf16 = steps["bf16"]
    assert bf16["status"] == "ok", bf16
    assert bf16["numbers"]["last_loss"] < bf16["numbers"]["first_loss"]
    assert steps["store"]["status"] == "ok" and all(steps["store"]["details"]["checks"].values())
    assert steps["optimizer"]["status"] == "timeout" and steps["optimizer"]["seconds"] < 60
    assert steps["fp16"]["status"] == "FAILED" and "injected failure" in steps["fp16"]["notes"]
    table = (out / "report.md").read_text()
    assert "| step | status | key numbers | seconds |" in table
    for name, step in steps.items():
        assert f"| {name} | {step['status']} |" in table
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = set(tar.getnames())
    assert {f"gpu_check/{n}.log" for n in steps} <= names
    assert sorted(os.listdir(out)) == ["logs.tar.gz", "report.json", "report.md"]  # few files: $OUT's limit


@pytest.mark.parametrize("argv, message", [
    (["--steps", "env,warp"], "--steps: unknown step 'warp'"),
    (["--inject", "env=explode"], "--inject 'env=explode': give STEP=fail or STEP=hang"),
])
def test_usage_errors_are_one_line(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        gpu_check.main([str(tmp_path / "out"), *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_the_gpu_sizes_plan_on_one_h100(tmp_path, capsys):
    """The searches the GPU run will make (torch-free, here): the big models fit one H100 80GB with room to spare,
    and every planner configuration gets a plan with the micro-batch size and recomputation asked for."""
    from megatron_bmw.cli.autoconfig import main
    from megatron_bmw.planner.plan import Plan

    sizes = gpu_check.GPU
    for i, (_, model, batch) in enumerate(sizes.big):
        path = str(tmp_path / f"big{i}.json")
        assert main(gpu_check.search_args(model, batch, gpu_check.big_space(batch), path, None)) == 0
        stage = Plan.load(path).prediction["stages"][0]
        assert stage["peak_bytes"] < 0.8 * stage["capacity_bytes"]
    for mbs, recompute in sizes.planned:
        path = str(tmp_path / f"plan{mbs}{recompute}.json")
        batch = gpu_check._batch(mbs, sizes.planned_gbs)
        assert main(gpu_check.search_args(sizes.profiled, batch, gpu_check.planned_space(mbs, recompute), path,
                                          None)) == 0
        pipeline = Plan.load(path).spec.pipeline
        assert pipeline.micro_batch_size == mbs
        assert set(pipeline.recompute or ()) - {None} == ({"full"} if recompute == "full" else set()), pipeline
    capsys.readouterr()
