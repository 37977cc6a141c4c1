"""benchmarks/kernel_model.py: it times the kernels the planner sums, picks the device type by the GPU's name, and
bad input is one line, exit 2."""

import json

import pytest
import torch

from benchmarks import kernel_model
from megatron_bmw.errors import UsageError
from megatron_bmw.planner.cost_model import CostSettings
from megatron_bmw.planner.kernel_time import device_kernels, unit_kernel_times


@pytest.mark.parametrize("name", ["bloom", "gpt3"])  # unfused and flash attention
def test_its_kernels_are_the_ones_the_planner_sums(name):
    dev = kernel_model.device_type_for("NVIDIA H100 80GB HBM3", 80e9, None, None)
    kd = device_kernels(dev, "fp32", CostSettings().fraction(dev))
    cfg, _ = kernel_model.model_config(name, small=True, dtype="fp32")
    for tp, b in ((1, 1), (2, 2)):
        kernels = kernel_model.layout_kernels(cfg, tp, b, kd, 1e12, torch.float32, torch.device("cpu"))
        for unit in ("attention", "mlp"):
            timed = sum(k.modelled_s for k in kernels if k.unit == unit and k.category != "memory-bound")
            assert timed == pytest.approx(sum(unit_kernel_times(unit, cfg, b, tp, kd)), rel=1e-12)


def test_the_gpu_name_picks_the_device_type():
    h200 = kernel_model.device_type_for("NVIDIA H200", 141e9, None, None)
    assert h200.name == "h100-80g" and h200.memory_bandwidth == 4.8e12 and h200.sm_count == 132
    assert kernel_model.device_type_for("NVIDIA H100 80GB HBM3", 80e9, None, None).memory_bandwidth == 3.35e12
    assert kernel_model.device_type_for("NVIDIA A100-SXM4-40GB", 40e9, None, None).name == "a100-40g"
    assert kernel_model.device_type_for("NVIDIA A100-SXM4-80GB", 80e9, None, None).name == "a100-80g"
    assert kernel_model.device_type_for("Tesla T4", 16e9, "aws-g4dn.12xlarge", "t4").name == "t4"
    with pytest.raises(UsageError, match="no device type known for 'Radeon'"):
        kernel_model.device_type_for("Radeon", 16e9, None, None)


def test_a_small_run_reports_every_kernel_and_the_summary(tmp_path, capsys):
    path = tmp_path / "k.json"
    assert kernel_model.main(["--small", "--device", "cpu", "--repeats", "1", "--models", "bloom,1.3b",
                              "--json", str(path)]) == 0
    out = capsys.readouterr().out
    result = json.loads(path.read_text())
    assert {r["kernel"] for r in result["rows"]} >= {"QKV fwd", "fc2 wgrad", "scores QK^T", "flash bwd", "logits dgrad",
                                                      "softmax fwd", "context copy"}
    assert all(r["measured_ms"] > 0 and r["modelled_ms"] > 0 for r in result["rows"])
    assert len(result["layouts"]) == 6 and set(result["models"]) == {"bloom", "1.3b"}
    assert [t["tp"] for t in result["models"]["bloom"]["tp_scaling"]] == [[1, 2]]
    assert "median measured/modelled by kind: forward" in out and "largest GEMM (" in out


@pytest.mark.parametrize("args, message", [
    (["--models", "gpt5"], "--models: unknown gpt5"),
    (["--repeats", "0"], "--repeats: must be >= 1"),
    (["--device-type", "nope", "--cluster", "h100-80g-ib", "--device", "cpu"], "cluster h100-80g-ib has no device"),
])
def test_bad_input_is_one_line(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        kernel_model.main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
