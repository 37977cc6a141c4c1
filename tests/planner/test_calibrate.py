"""autoconfig.py calibrate: recovers known parameters from trials the cost model itself generated with perturbed
parameters, and reduces the error on real trials (tests/trials/data: 12 trials measured on 2 gloo ranks here,
with the profile `autoconfig.py profile` measured for them)."""

import copy
import json
import os

import pytest

from megatron_bmw.errors import UsageError
from megatron_bmw.planner.calibrate import Params, calibrate, scaled_profile
from megatron_bmw.cli.autoconfig import main
from megatron_bmw.planner.cost_model import CostSettings
from megatron_bmw.planner.evaluate import estimate_memory
from megatron_bmw.planner.memory_model import MemorySettings
from megatron_bmw.planner.profile_data import Profile, Profiles
from megatron_bmw.trials.results import load_results
from megatron_bmw.trials.specs import TrialModel

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "trials", "data")
PROFILE = os.path.join(DATA, "local_profile.json")
RESULTS = os.path.join(DATA, "local_results.jsonl")
GiB = 2**30


def _argv(hidden, pp, mbs, extra=""):
    return (f"--num-layers 4 --hidden-size {hidden} --num-attention-heads 4 --seq-length 64 --vocab-size 512 "
            f"--mock-data --global-batch-size 16 --pipeline-model-parallel-size {pp} --micro-batch-size {mbs} "
            f"{extra}").split()


CASES = [(64, 1, 1, ""), (64, 1, 4, "--overlap-grad-reduce"), (64, 2, 2, ""), (64, 2, 1, "--recompute-activations"),
         (64, 4, 1, ""), (64, 2, 4, "--recompute-granularity full"), (64, 2, 2, "--pipeline-partition 4,6"),
         (64, 2, 2, "--pipeline-partition 6,4"), (128, 1, 2, "--overlap-grad-reduce"), (128, 2, 1, ""),
         (128, 4, 2, "--recompute-activations"), (128, 2, 2, "--pipeline-partition 3,7"), (32, 1, 2, ""),
         (32, 4, 4, "")]


def _synthetic(truth: Params, workspace: float, fragmentation: float) -> list[dict]:
    base = Profile.load(PROFILE)
    model = TrialModel("local", Profiles([scaled_profile(base, truth)]), CostSettings(overlap_factor=truth.overlap))
    records = []
    for i, (hidden, pp, mbs, extra) in enumerate(CASES):
        r = {"id": f"t{i}", "status": "ok", "argv": _argv(hidden, pp, mbs, extra), "world_size": 4}
        r["median_iteration_s"] = model.predict(r)["iteration_time_s"]
        # CUDA-style memory: what the device reports = workspace + (1 + fragmentation) x the bare model
        bare = estimate_memory(model.spec(r), settings=MemorySettings(device="cuda"))
        r["stage_memory"] = {str(s): {"device_used": workspace + (1 + fragmentation) * m.peak_bytes}
                             for s, m in enumerate(bare)}
        records.append(r)
    return records


def test_recovers_known_parameters_from_synthetic_trials():
    truth = Params(time={"embedding": 1.0, "attention": 1.6, "mlp": 0.7, "head": 1.3}, overhead=2.0,
                   bandwidth=0.5, latency=3.0, overlap=1.8)
    records = _synthetic(truth, 1.25 * GiB, 0.08)
    out = calibrate(records, TrialModel.from_paths("local", [PROFILE]), CostSettings())
    p = out["params"]
    assert out["before"]["median_abs_error"] > 0.1
    assert out["after"]["median_abs_error"] < 0.01 and out["after"]["spearman"] > 0.99
    for kind in ("attention", "mlp", "head"):
        assert p.scale * p.time[kind] == pytest.approx(truth.time[kind], rel=0.05), (kind, p)
    assert p.overhead == pytest.approx(truth.overhead, rel=0.1)
    assert p.latency == pytest.approx(truth.latency, rel=0.1)  # small messages: latency, not bandwidth, shows
    # these models have one gradient bucket per rank, reduced after the last backward: no overlap to see
    assert p.overlap == CostSettings().overlap_factor
    workspace, fragmentation, samples = out["allowance"]
    assert samples == sum(1 for r in records for _ in r["stage_memory"])
    assert workspace == pytest.approx(1.25 * GiB, rel=1e-6) and fragmentation == pytest.approx(0.08, rel=1e-6)


def test_improves_the_error_on_real_trials():
    records = load_results(RESULTS)
    out = calibrate(records, TrialModel.from_paths("local", [PROFILE]), CostSettings())
    before, after = out["before"], out["after"]
    assert before["n"] == after["n"] == 12
    assert after["median_abs_error"] < 0.75 * before["median_abs_error"], (before, after)
    assert out["allowance"] is None  # CPU trials carry no CUDA memory figures


def test_cli_writes_a_profile_search_takes(tmp_path, capsys):
    output = tmp_path / "calibrated.json"
    assert main(["calibrate", "--results", RESULTS, "--profile", PROFILE, "--output", str(output)]) == 0
    text = capsys.readouterr().out
    assert "median |error|" in text and "Spearman" in text and f"profile written to {output}" in text
    data = json.loads(output.read_text())
    assert data["calibration"]["trials"] == 12 and "--overlap-factor" in data["calibration"]["search_flags"]
    calibrated = Profile.load(str(output))
    assert calibrated.device_type_name == Profile.load(PROFILE).device_type_name
    assert data["overlap_factor"] == data["calibration"]["overlap_factor"] == calibrated.overlap_factor  # first-class
    plan = tmp_path / "plan.json"
    assert main(["search", "--cluster", "local", "--profile", str(output), "--world-size", "2", "--num-layers", "4",
                 "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64", "--vocab-size", "512",
                 "--global-batch-size", "8", "--no-progress", "--output", str(plan)]) == 0
    assert json.loads(plan.read_text())["prediction"]["iteration_time_s"] > 0


def test_usage_errors(tmp_path, capsys):
    one = tmp_path / "one.jsonl"
    with open(RESULTS) as f:
        one.write_text(f.readline())
    for argv, message in ((["--results", str(tmp_path / "none.jsonl")], "no such file"),
                          (["--results", str(one)], "at least 2 measured")):
        with pytest.raises(SystemExit) as exc:
            main(["calibrate", *argv, "--profile", PROFILE, "--output", str(tmp_path / "out.json")])
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]
    with pytest.raises(UsageError, match="one --profile"):
        records = load_results(RESULTS)
        model = TrialModel.from_paths("local", [PROFILE, PROFILE])
        calibrate(copy.deepcopy(records), model)
