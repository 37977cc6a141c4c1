"""The profile's calibrated fields (overlap factor, memory allowance): a JSON round trip, old profiles (no fields, or
calibrate's former `calibration` section only) still read, and search/estimate/simulate use them unless a flag
says otherwise."""

import json

import pytest

from megatron_bmw.errors import UsageError
from megatron_bmw.cli.autoconfig import main
from megatron_bmw.planner.profile_data import Profile, Profiles, UnitTiming

MODEL = {"hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 256, "seq_length": 32, "vocab_size": 256,
         "attention_backend": "auto", "hidden_dropout": 0.1, "attention_dropout": 0.1}
FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--vocab-size", "256", "--make-vocab-size-divisible-by", "8", "--global-batch-size", "8"]
CLUSTER = """
name: gpu-test
device_types:
  gpu-test: {memory_gb: 16, peak_tflops: {fp32: 10}}
groups:
  - {nodes: 1, gpus_per_node: 4, device: gpu-test, intra_node: {bandwidth_GBps: 0.01, latency_us: 10}}
inter_node: {bandwidth_GBps: 0.01, latency_us: 10}
"""


def _profile(**extra) -> dict:
    units = [UnitTiming(k, 1, b, 1e-3 * b, 2e-3 * b).__dict__ for b in (1, 2) for k in
             ("embedding", "attention", "mlp", "head")]
    return {"format": 1, "mode": "measured", "device": {"name": "gpu-test", "kind": "cuda"}, "dtype": "fp32",
            "model": MODEL, "units": units, **extra}


def _write(tmp_path, data, name="prof.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


def test_round_trip_and_old_profiles(tmp_path):
    prof = Profile.from_json(_profile(overlap_factor=1.7, memory_allowance={"workspace_bytes": 3e8,
                                                                           "fragmentation": 0.05}))
    assert (prof.overlap_factor, prof.memory_workspace_bytes, prof.memory_fragmentation) == (1.7, 3e8, 0.05)
    prof.save(str(tmp_path / "again.json"))
    again = Profile.load(str(tmp_path / "again.json"))
    assert (again.overlap_factor, again.memory_workspace_bytes, again.memory_fragmentation) == (1.7, 3e8, 0.05)
    plain = Profile.from_json(_profile())  # a profile from before: the defaults
    assert plain.overlap_factor is None and plain.memory_workspace_bytes is None
    assert "overlap_factor" not in plain.to_json() and "memory_allowance" not in plain.to_json()
    old = Profile.from_json(_profile(calibration={"overlap_factor": 1.9, "memory_workspace_bytes": 1e8,
                                                  "memory_fragmentation": 0.2, "trials": 12}))
    assert (old.overlap_factor, old.memory_workspace_bytes, old.memory_fragmentation) == (1.9, 1e8, 0.2)
    assert old.to_json()["calibration"]["trials"] == 12 and old.to_json()["overlap_factor"] == 1.9
    with pytest.raises(UsageError, match="overlap_factor must be a number >= 1"):
        Profile.from_json(_profile(overlap_factor=0.5))
    with pytest.raises(UsageError, match="fragmentation"):
        Profile.from_json(_profile(memory_allowance={"fragmentation": "lots"}))
    both = Profiles([Profile.from_json(_profile(overlap_factor=1.2)),
                     Profile.from_json({**_profile(overlap_factor=1.6), "device": {"name": "other"}})])
    assert both.overlap_factor == 1.6  # the most cautious of the device types


def test_commands_use_the_profile_fields_unless_flags_say_otherwise(tmp_path, capsys):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(CLUSTER)
    plain = _write(tmp_path, _profile(), "plain.json")
    fitted = _write(tmp_path, _profile(overlap_factor=3.0, memory_allowance={"workspace_bytes": 2**30,
                                                                             "fragmentation": 0.5}), "fitted.json")
    layout = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1", "--micro-batch-size", "2",
              "--overlap-grad-reduce"]
    # hidden 2048 (the profile rescaled by FLOPs): more than one 40M-element gradient bucket, so some reduce
    # during the backward, where the overlap factor shows
    flags = [("2048" if f == "64" else f) for f in FLAGS]

    def run(command, prof, *extra):
        assert main([command, "--cluster", str(cluster), "--profile", prof, *flags, *layout, "--json", *extra]) == 0
        return json.loads(capsys.readouterr().out)

    base, cal = run("simulate", plain), run("simulate", fitted)
    assert cal["iteration_time_s"] > base["iteration_time_s"]  # overlap factor 3 against the default 1.3
    assert run("simulate", fitted, "--overlap-factor", "1.3")["iteration_time_s"] == \
        pytest.approx(base["iteration_time_s"])
    est_base, est_cal = run("estimate", plain)["stages"][0], run("estimate", fitted)["stages"][0]
    assert est_base["allowance_bytes"] != est_cal["allowance_bytes"]
    bare = est_cal["peak_bytes"] - est_cal["allowance_bytes"]
    assert est_cal["allowance_bytes"] == pytest.approx(2**30 + 0.5 * bare)
    flagged = run("estimate", fitted, "--memory-workspace-gb", "0", "--memory-fragmentation", "0")["stages"][0]
    assert flagged["allowance_bytes"] == 0
    # search: the plan's prediction carries the profile's overlap factor
    assert main(["search", "--cluster", str(cluster), "--profile", fitted, *flags, "--space", "tp=1",
                 "--space", "pp=1", "--no-progress", "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    assert main(["search", "--cluster", str(cluster), "--profile", fitted, *flags, "--space", "tp=1",
                 "--space", "pp=1", "--no-progress", "--json", "--overlap-factor", "1.0"]) == 0
    plain_plans = json.loads(capsys.readouterr().out)["plans"]
    assert plans[0]["prediction"]["iteration_time_s"] > 1.1 * plain_plans[0]["prediction"]["iteration_time_s"]


def _unit_edit(i, **change):
    def edit(data):
        data["units"][i].update(change)
    return edit


@pytest.mark.parametrize("edit,needle", [
    (_unit_edit(1, forward_s=-1e-3), "units[1].forward_s must be a number >= 0"),
    (_unit_edit(2, backward_s=float("nan")), "units[2].backward_s must be a number >= 0"),
    (_unit_edit(0, forward_s="fast"), "units[0].forward_s must be a number"),
    (_unit_edit(3, tp=0), "units[3].tp must be an integer >= 1"),
    (_unit_edit(3, micro_batch_size=1.5), "units[3].micro_batch_size must be an integer >= 1"),
    (_unit_edit(0, kind="conv"), "units[0].kind must be one of embedding, attention, mlp, head"),
    (_unit_edit(0, saved_bytes=-5), "units[0].saved_bytes must be a number >= 0"),
    (_unit_edit(0, unit=-1), "units[0].unit must be a unit index >= 0"),
    (_unit_edit(0, recompute="full"), "units[0].recompute must be null (never recomputed) for embedding units"),
    (_unit_edit(2, recompute="selective"), "units[2].recompute must be one of full or null for mlp units"),
    (_unit_edit(1, recompute="all"), "units[1].recompute must be one of full, selective or null for attention"),
    (lambda d: d["units"].append(7), "units[8] must be a mapping"),
    (lambda d: d.update(links={"p2p": {"bandwidth_Bps": 0, "latency_s": 0}}), "links.p2p.bandwidth_Bps must be a number > 0"),
    (lambda d: d.update(overhead={"forward_s": -1}), "overhead.forward_s must be a number >= 0"),
])
def test_bad_unit_times_are_named(tmp_path, capsys, edit, needle):
    data = _profile()
    edit(data)
    path = _write(tmp_path, data)
    with pytest.raises(UsageError) as err:
        Profile.load(path)
    assert needle in str(err.value) and str(err.value).startswith(f"--profile {path}: "), str(err.value)
    with pytest.raises(SystemExit) as exit_:  # through the command, as the probe ran it
        main(["simulate", *FLAGS, "--cluster", "local", "--profile", path])
    assert exit_.value.code == 2 and needle in capsys.readouterr().err


@pytest.mark.parametrize("change,message", [
    ({"overhead": -1}, "overhead must be a mapping, got -1"),
    ({"links": {"p2p": 3}}, "links.p2p must be a mapping, got 3"),
    ({"mode": "bogus"}, "mode must be measured or analytic, got 'bogus'"),
    ({"device": {"name": "gpu-test", "memory_bytes": 0}}, "device.memory_bytes must be a number > 0, got 0"),
    ({"device": "gpu-test"}, "device must be a mapping"),
    ({"load": 3}, "load must be a mapping, got 3"),
    ({"load": {"cores": 2, "start": [1, 1, 1], "end": [1, 1, 1], "seconds": 5}}, "missing field 'load.own'"),
    ({"load": {"cores": 0, "start": [1, 1, 1], "end": [1, 1, 1], "seconds": 5, "own": 1}},
     "load.cores must be an integer >= 1, got 0"),
    ({"load": {"cores": 2, "start": [1, 1], "end": [1, 1, 1], "seconds": 5, "own": 1}},
     "load.start must be the 1, 5 and 15-minute load averages, got [1, 1]"),
    ({"load": {"cores": 2, "start": [1, 1, 1], "end": [1, None, 1], "seconds": 5, "own": 1}},
     "load.end[1] must be a number >= 0, got None"),
    ({"load": {"cores": 2, "start": [1, 1, 1], "end": [1, 1, 1], "seconds": -5, "own": 1}},
     "load.seconds must be a number >= 0, got -5"),
])
def test_malformed_sections_are_named(tmp_path, change, message):
    with pytest.raises(UsageError) as err:
        Profile.load(_write(tmp_path, _profile(**change)))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_gpu_profiles_stream_scales_every_unit_time():
    """Unit times are taken at stream_s / units_s of their timing: interpolated in the micro-batch size, the nearest
    record beyond the recorded sizes, never above 1, for every tp and recomputed entries alike; 1 without a stream."""
    from megatron_bmw.config import ModelConfig

    data = _profile(stream={"1": {"depth": 2, "stream_s": 5.0, "units_s": 10.0},
                            "2": {"depth": 2, "stream_s": 16.0, "units_s": 10.0}})
    data["units"] += [UnitTiming("mlp", 2, 1, 1e-3, 2e-3).__dict__,
                      UnitTiming("mlp", 1, 1, 3e-3, 4e-3, recompute="full").__dict__]
    prof = Profile.from_json(data)
    plain = Profile.from_json({k: v for k, v in data.items() if k != "stream"})
    model = ModelConfig(num_layers=2, **MODEL)
    assert [prof.stream_factor(b) for b in (0.5, 1, 1.5, 2, 8)] == pytest.approx([0.5, 0.5, 0.75, 1.0, 1.0])
    assert plain.stream_factor(1) == 1.0
    for tp, rc, want in ((1, None, (1e-3, 2e-3)), (2, None, (1e-3, 2e-3)), (1, "full", (3e-3, 4e-3))):
        assert plain.unit_time("mlp", tp, 1, model, recompute=rc) == pytest.approx(want)
        assert prof.unit_time("mlp", tp, 1, model, recompute=rc) == pytest.approx((want[0] / 2, want[1] / 2))
    assert prof.unit_time("mlp", 1, 2, model) == pytest.approx((2e-3, 4e-3))  # a stream slower than the sum: 1
    assert prof.achieved_flops() == pytest.approx(2 * plain.achieved_flops())  # the best MLP was at micro-batch 1


def test_cpu_plans_show_no_mfu_against_a_profiles_measured_rate(tmp_path, capsys):
    """A CPU profile's device peak is the best rate it measured on its MLP units, and CPU ranks share the node's
    cores: no peak to take MFU against. Its micro-batch 2 timed slow (a busy moment), the linear extrapolation to 4
    runs faster per sample than anything measured, which showed as MFU 153%: the plan says null, the table '-'. A
    cluster file's stated peak still gives the MFU."""
    units = [UnitTiming(k, 1, b, (1e-3 if k in ("attention", "mlp") else 1e-5) * (1 + 0.1 * (b - 1)),
                        (2e-3 if k in ("attention", "mlp") else 2e-5) * (1 + 0.1 * (b - 1))).__dict__
             for b in (1, 2) for k in ("embedding", "attention", "mlp", "head")]
    cpu = _write(tmp_path, _profile(units=units, device={"name": "cpu-1-thread", "kind": "cpu", "threads": 1,
                                                         "cores": 2, "memory_bytes": 2**34},
                                    links={"p2p": {"bandwidth_Bps": 1e9, "latency_s": 1e-5}}), "cpu.json")
    flags = [*FLAGS, "--space", "tp=1", "--space", "pp=1", "--space", "mbs=4", "--no-progress", "--world-size", "2"]
    assert main(["search", "--cluster", "local", "--profile", cpu, *flags, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["plans"][0]
    assert plan["layout"]["micro_batch_size"] == 4 and plan["prediction"]["mfu"] is None
    assert plan["prediction"]["tflops_per_gpu"] > 0
    assert main(["search", "--cluster", "local", "--profile", cpu, *flags]) == 0
    row = capsys.readouterr().out.splitlines()[1].split()
    assert row[0] == "1" and row[3] == "-", row  # #, iter s, tokens/s, MFU
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(CLUSTER)
    gpu = _write(tmp_path, _profile(units=units), "gpu.json")
    assert main(["search", "--cluster", str(cluster), "--profile", gpu, *flags, "--json"]) == 0
    mfu = json.loads(capsys.readouterr().out)["plans"][0]["prediction"]["mfu"]
    assert mfu is not None and 0 < mfu < 1
