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
            "--steps", "env,kernels,bf16,store,optimizer,param_gather,peer,launch,allowance,grad_accum,fp16",
            "--inject",
            "optimizer=hang",
            "--inject", "fp16=fail",
            "--step-timeout-s", "150"]  # a cap for a real hang (peer took >40 s on a loaded 2-core CI machine);
    # the injected hang is cut after 4 s
    run = subprocess.run(argv, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert run.returncode == 0, run.stderr
    data = json.loads((out / "report.json").read_text())
    assert data["finished"] is True and data["mode"] == "dry-run"
    steps = {s["name"]: s for s in data["steps"]}
    assert list(steps) == ["env", "kernels", "bf16", "store", "optimizer", "param_gather", "peer", "launch",
                           "allowance", "grad_accum", "fp16"]  # the table's
    # order, after the failures too
    assert all({"name", "what", "status", "seconds"} <= set(s) for s in data["steps"])
    assert steps["env"]["status"] == "ok" and steps["env"]["numbers"]["torch"]
    kernels = steps["kernels"]  # tiny shapes on the CPU beside the h100-80g's modelled times
    assert kernels["status"] == "ok", kernels
    assert kernels["numbers"]["forward_ratio"] > 0 and "bloom_mbs1_tp2_over_tp1" in kernels["numbers"]
    assert kernels["details"]["device_type"] == "h100-80g" and len(kernels["details"]["layouts"]) == 6
    bf16 = steps["bf16"]
    assert bf16["status"] == "ok", bf16
    assert bf16["numbers"]["last_loss"] < bf16["numbers"]["first_loss"]
    assert steps["store"]["status"] == "ok" and all(steps["store"]["details"]["checks"].values())
    assert steps["optimizer"]["status"] == "timeout" and steps["optimizer"]["seconds"] < 60
    gather = steps["param_gather"]  # its CPU form: a one-rank gloo group, the gathers pending after each step
    assert gather["status"] == "ok", gather
    checks = gather["details"]["checks"]
    assert all(checks.values()) and len(checks) == 5 and "CPU" in gather["notes"]
    peer = steps["peer"]  # no big step ran: the last big model (the tiny one), ours and megatron-core (test extra)
    assert peer["status"] == "ok", peer
    rows = peer["details"]["rows"]
    assert rows["ours"]["parameters"] == rows["mcore"]["parameters"] > 0  # the same model on both sides
    assert peer["numbers"]["model"] == "GPT tiny" and peer["numbers"]["ours_over_mcore_time"] > 0
    launch = steps["launch"]  # the CPU times two ways (sync, host); both summed against the unit stream
    assert launch["status"] == "ok", launch
    assert {"mbs1_sync", "mbs1_host", "mbs2_sync", "mbs2_stream_ms", "mbs1_host_us_per_op"} <= set(launch["numbers"])
    assert launch["numbers"]["mbs2_stream_ms"] > 0 and "mbs1_span" not in launch["numbers"]
    details = launch["details"]["results"]["mbs1"]  # the per-call and recomputed streams ran too
    assert details["unit_calls_stream_ms"] > 0 and details["full_recompute_stream_ms"] > 0
    assert {"mbs1_us_per_backward_call", "mbs2_sync_and_forwards_over_recompute"} <= set(launch["numbers"])
    allowance = steps["allowance"]  # no planner step ran: its own profile, derived terms only on the CPU
    assert allowance["status"] == "ok", allowance
    assert allowance["numbers"]["context_gib_derived"] == 0.5 and "context_gib_measured" not in allowance["numbers"]
    assert "autoconfig.py profile (allowance_profile.json" in allowance["notes"]
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
    (["--budget-s", "nan"], "--budget-s must be a number of seconds > 0, got nan"),
    (["--step-timeout-s", "-5"], "--step-timeout-s must be a number of seconds > 0, got -5"),
    (["--steps", "env"], "out_dir {tmp}/a_file: exists and is not a directory"),
])
def test_usage_errors_are_one_line(tmp_path, capsys, argv, message):
    (tmp_path / "a_file").write_text("")
    out = tmp_path / ("a_file" if "out_dir" in message else "out")
    message = message.replace("{tmp}", str(tmp_path))
    with pytest.raises(SystemExit) as exc:
        gpu_check.main([str(out), *argv])
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
    small, small_gbs, _ = sizes.host_bound
    for model, gbs in ((sizes.profiled, sizes.planned_gbs), (small, small_gbs)):
        for mbs, recompute in sizes.planned:
            path = str(tmp_path / f"plan{mbs}{recompute}.json")
            batch = gpu_check._batch(mbs, gbs)
            assert main(gpu_check.search_args(model, batch, gpu_check.planned_space(mbs, recompute), path,
                                              None)) == 0
            pipeline = Plan.load(path).spec.pipeline
            assert pipeline.micro_batch_size == mbs
            assert set(pipeline.recompute or ()) - {None} == ({"full"} if recompute == "full" else set()), pipeline
    capsys.readouterr()


def test_synchronised_profile_drops_the_stream_record(tmp_path):
    """The copy keeps the units as timed and loses the stream the cost model scales them by; nothing without one."""
    units = [{"kind": "mlp", "tp": 1, "micro_batch_size": b, "forward_s": 1.0, "backward_s": 2.0} for b in (1, 2, 4)]
    stream = {"1": {"depth": 8, "stream_s": 6.0, "units_s": 10.0}}
    src, out = tmp_path / "p.json", str(tmp_path / "s.json")
    src.write_text(json.dumps({"units": units, "stream": stream}))
    assert gpu_check.synchronised_profile(str(src), out)
    got = json.loads(open(out).read())
    assert "stream" not in got and got["units"] == units
    src.write_text(json.dumps({"units": units}))
    assert not gpu_check.synchronised_profile(str(src), out)


def test_allowance_numbers_put_a_gpu_profiles_measured_terms_beside_the_derived():
    from megatron_bmw.arguments import build_parser, configs_from_args, parse_args
    from megatron_bmw.planner.cluster import load_cluster
    from megatron_bmw.planner.cuda_allowance import allowance_terms
    from megatron_bmw.planner.memory_model import precision_from
    from megatron_bmw.training.cuda_memory import measured_terms

    GiB = 2**30
    before = {"reserved": 0, "allocated": 0, "max_reserved": 0, "max_allocated": 0, "free": 79 * GiB, "total": 80 * GiB}
    after = {"reserved": 6 * GiB, "allocated": GiB, "max_reserved": 6 * GiB, "max_allocated": 5 * GiB,
             "free": 73 * GiB + GiB // 2, "total": 80 * GiB}
    profile = {"device": {"kind": "cuda"}, "cuda_memory": measured_terms(before, after)}
    model, where = gpu_check.GPU.profiled, (gpu_check.PLAN_CLUSTER, gpu_check.PLAN_DEVICE)
    numbers = gpu_check.allowance_numbers(profile, model, 4, *where)
    assert numbers["context_gib_measured"] == 0.5 and numbers["allocator_fraction_measured"] == 0.2
    assert numbers["max_reserved_gib"] == 6.0 and "nccl_mib_per_communicator_measured" not in numbers
    cfg = configs_from_args(parse_args(["--mock-data", *gpu_check.MODEL_FLAGS, *model, "--bf16",
                                        *gpu_check._batch(4, 4)], build_parser()), 1).model
    derived = allowance_terms(load_cluster(where[0]).groups[0].device, cfg, 1, 1, 1, 4, False,
                              precision_from(cfg, False))
    assert numbers["allocator_fraction_derived"] == round(derived.fragmentation, 4) > 0
    assert numbers["context_gib_derived"] == 0.5 and numbers["cublas_mib_derived"] == 128.0  # H100: 2 x (32 + 32)
    assert numbers["nccl_communicators"] == 0
    with pytest.raises(gpu_check.StepFailed, match="no measured CUDA terms"):
        gpu_check.allowance_numbers({"device": {"kind": "cuda"}}, model, 4, *where)
    broken = dict(profile, cuda_memory=measured_terms(before, dict(after, free=0, reserved=0)))  # context = total
    with pytest.raises(gpu_check.StepFailed, match="out of range"):
        gpu_check.allowance_numbers(broken, model, 4, *where)
    with pytest.raises(gpu_check.StepFailed, match="a cpu profile holds CUDA readings"):
        gpu_check.allowance_numbers(dict(profile, device={"kind": "cpu"}), model, 4, *where)


def test_grad_accum_step_measures_the_hooks_beside_the_planners_count(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_check_steps", os.path.join(ROOT, "tools", "gpu_check_steps.py"))
    steps = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(steps)
    path = tmp_path / "grad_accum.json"
    assert steps.main(["grad_accum", "--small", "--json", str(path)]) == 0
    out = json.loads(path.read_text())
    assert out["status"] == "ok" and out["device"] == "cpu" and out["dtype"] == "fp32"
    assert out["parameters"] == 64 * 256 * 2 + 256 + 64 + 2 * 64  # fc1, fc2 and their biases, the LayerNorm
    assert out["predicted_ms"] > 0 and out["with_hooks_ms"] > 0 and out["add_GBps"] > 0
    assert out["fused_ms"] > 0 and out["fused_kernel"] == "addmm"  # fp32 weights: addmm_ into main_grad
    assert "grad_accum" in [s.name for s in gpu_check.STEPS]


def test_allocator_step_reads_the_snapshot_keeps_its_trace_and_drops_it(tmp_path):
    import pickle
    from types import SimpleNamespace

    MiB = 2**20
    trace = [{"action": "segment_alloc", "size": 20 * MiB, "addr": 64},
             {"action": "alloc", "size": 8 * MiB, "addr": 64},
             {"action": "alloc", "size": 4 * MiB, "addr": 64 + 8 * MiB},
             {"action": "free_requested", "size": 4 * MiB, "addr": 64 + 8 * MiB},
             {"action": "free_completed", "size": 4 * MiB, "addr": 64 + 8 * MiB}]
    end = [{"device": 0, "total_size": 20 * MiB, "blocks": [{"size": 8 * MiB, "requested_size": 8 * MiB,
                                                             "state": "active_allocated"}]}]
    runs = []

    def pretrain(flags, what):
        runs.append(flags)
        path = flags[flags.index("--memory-snapshot-path") + 1]
        with open(path, "wb") as f:
            pickle.dump({"segments": end, "device_traces": [trace]}, f)
        return {"iterations": [{}], "log": ""}

    ctx = SimpleNamespace(big=None, sizes=gpu_check.GPU, work=str(tmp_path), pretrain=pretrain)
    out = gpu_check.step_allocator(ctx)
    assert "--record-memory-history" in runs[0] and "--plan" not in runs[0]  # no big step ran: no plan
    n = out["numbers"]
    assert n["model"] == "GPT 1.3B" and n["peak_allocated_gib"] == round(12 / 1024, 3)
    assert n["allocator_fraction_measured"] == round(20 / 12 - 1, 4) and n["allocator_fraction_derived"] > 0
    assert n["model_same_segments"] is True and n["model_peak_reserved_gib"] == n["peak_reserved_gib"]
    # the synthetic trace of the same run: the memory model's peak, through the allocator model
    assert n["synthetic_peak_allocated_gib"] > 20 and 0 <= n["synthetic_allocator_fraction"] < 0.1
    kept = json.loads((tmp_path / "allocator_trace.json").read_text())
    assert kept["events"] == [[2, 20 * MiB, 64], [0, 8 * MiB, 64], [0, 4 * MiB, 64 + 8 * MiB],
                              [1, 4 * MiB, 64 + 8 * MiB]]
    assert not (tmp_path / "snapshot.pickle").exists()  # too large for the logs


def test_launch_steps_host_floor_is_the_planners_model():
    from tools.gpu_check_launch import _host_floor
    from megatron_bmw.planner.cost_model import HOST_OP_S

    ops = {"embedding": (2, 1), "attention": (10, 20), "mlp": (5, 5), "head": (4, 4)}
    device = {"embedding": (1e-6, 1e-6), "attention": (1.0, 1.0), "mlp": (1e-6, 1e-6), "head": (1e-6, 1e-6)}
    phases = {k: {"covered_device_f": f, "covered_device_b": b} for k, (f, b) in device.items()}
    got = _host_floor(phases, ops, layers=3)
    host = {k: (f * HOST_OP_S, b * HOST_OP_S) for k, (f, b) in ops.items()}
    want = sum(host["embedding"]) + 3 * (2.0 + sum(host["mlp"])) + sum(host["head"])  # attention: device-bound
    assert got == pytest.approx(want)
    assert _host_floor({**phases, "mlp": {"covered_device_f": None, "covered_device_b": 1.0}}, ops, 3) is None


def test_pick_numbers_say_how_far_each_predictions_pick_is_from_the_best_measured():
    rows = {"mbs1": {"time_meas_s": 0.42, "time_pred_s": 0.39, "time_pred_analytic_s": 0.30},
            "mbs4": {"time_meas_s": 0.32, "time_pred_s": 0.31, "time_pred_analytic_s": 0.35}}
    assert gpu_check.pick_numbers("small-", rows) == {"small-pick_over_best_pct": 0.0,
                                                      "small-analytic_pick_over_best_pct": 31.2}
    assert gpu_check.pick_numbers("", {"mbs1": rows["mbs1"]}) == {}


def test_a_step_may_return_its_own_status(tmp_path):
    """peer's "ok (ours only)" and the MoE/cp steps' "FAILED" with their numbers (run_step had raised a TypeError)."""
    ctx = gpu_check.Context(out_dir=str(tmp_path), work=str(tmp_path), python=sys.executable, sizes=gpu_check.DRY,
                            cuda=False, dry_run=True, deadline=gpu_check.time.monotonic() + 60)
    step = gpu_check.Step("peer", "test", lambda c: {"status": "ok (ours only)", "numbers": {"x": 1}}, 10)
    got = gpu_check.run_step(ctx, step, None)
    assert got["status"] == "ok (ours only)" and got["numbers"] == {"x": 1}
