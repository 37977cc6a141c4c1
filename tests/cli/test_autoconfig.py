"""tools/autoconfig.py: estimate, simulate and profile, JSON shapes, and one-line errors with exit code 2."""

import json
import os
import subprocess
import sys

import pytest

from megatron_bmw.cli.autoconfig import main
from megatron_bmw.planner.memory_model import total_parameters

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--vocab-size", "200", "--micro-batch-size", "2"]
STAGE_KEYS = {"params_bytes", "grads_bytes", "optimizer_bytes", "activation_bytes", "peak_bytes",
              "peak_inflight_microbatches"}


def _json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_estimate_json(capsys):
    argv = ["estimate", "--cluster", "aws-p3.8xlarge", "--num-nodes", "2", *MODEL, "--pipeline-model-parallel-size",
            "4", "--global-batch-size", "16", "--bf16", "--json"]
    data = _json(capsys, argv)
    assert data["parameters_total"] > 0 and data["activation_bytes_per_layer"] > 0
    assert len(data["stages"]) == 4 and all(STAGE_KEYS <= set(s) for s in data["stages"])
    assert [s["peak_inflight_microbatches"] for s in data["stages"]] == [4, 3, 2, 1]
    assert data["fits"] is True and data["layout"]["dp"] == 2
    # bf16: 2-byte params, fp32 grads, fp32 master + Adam moments
    s0 = data["stages"][0]
    assert s0["grads_bytes"] == 2 * s0["params_bytes"] and s0["optimizer_bytes"] == 6 * s0["params_bytes"]


def test_estimate_detects_oom(capsys):
    argv = ["estimate", "--cluster", "aws-g4dn.12xlarge", "--num-layers", "48", "--hidden-size", "4096",
            "--num-attention-heads", "32", "--seq-length", "2048", "--vocab-size", "50257", "--micro-batch-size", "4",
            "--world-size", "1", "--json"]
    data = _json(capsys, argv)
    assert data["fits"] is False and data["parameters_total"] > 9e9
    assert main(argv[:-1]) == 0
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_simulate_json_and_timeline(capsys, tmp_path):
    png = tmp_path / "t.png"
    argv = ["simulate", "--cluster", "a100-40g-ib", *MODEL, "--pipeline-model-parallel-size", "2",
            "--tensor-model-parallel-size", "2", "--global-batch-size", "32", "--world-size", "8",
            "--pipeline-partition", "4,6", "--json", "--timeline", str(png)]
    data = _json(capsys, argv)
    assert data["iteration_time_s"] > 0 and 0 <= data["bubble_fraction"] < 1
    assert data["master_stage"] in (0, 1)
    for s in data["stages"]:
        assert STAGE_KEYS | {"busy_s", "idle_s"} <= set(s)
        assert s["busy_s"] + s["idle_s"] == pytest.approx(data["iteration_time_s"])
    assert data["layout"]["partition"] == [4, 6]
    assert png.exists() and png.stat().st_size > 1000


def test_blocking_launches_slow_the_simulation(capsys):
    argv = ["simulate", "--cluster", "a100-40g-ib", *MODEL, "--global-batch-size", "8", "--world-size", "1", "--json"]
    device = _json(capsys, argv + ["--host-op-us", "0"])["iteration_time_s"]
    ahead = _json(capsys, argv)["iteration_time_s"]  # our runtime: a unit takes at least its host time
    held = _json(capsys, argv + ["--cuda-launch-blocking"])["iteration_time_s"]
    slower = _json(capsys, argv + ["--cuda-launch-blocking", "--host-op-us", "200"])["iteration_time_s"]
    assert device < ahead < held < slower  # a tiny model: its units' host time dominates
    other = _json(capsys, argv + ["--engine", "megatron-core"])["iteration_time_s"]
    assert other < ahead  # another engine's host is not modelled


def test_interleaved_and_gpipe(capsys):
    big = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "1024",
           "--micro-batch-size", "2"]  # compute, not link latency, dominates
    base = ["simulate", "--cluster", "h100-80g-ib", *big, "--pipeline-model-parallel-size", "2",
            "--global-batch-size", "16", "--world-size", "2", "--json"]
    inter = _json(capsys, base + ["--num-layers-per-virtual-pipeline-stage", "1"])
    plain = _json(capsys, base)
    gpipe = _json(capsys, base + ["--pipeline-schedule", "gpipe"])
    assert inter["layout"]["schedule"] == "interleaved" and inter["bubble_fraction"] < plain["bubble_fraction"]
    assert gpipe["stages"][0]["peak_inflight_microbatches"] == 8


def test_profile_then_simulate_locally(capsys, tmp_path):
    prof = tmp_path / "prof.json"
    assert main(["profile", "--output", str(prof), *MODEL, "--profile-micro-batch-sizes", "1,2",
                 "--profile-repeats", "1", "--profile-warmup", "0", "--no-links"]) == 0
    capsys.readouterr()
    data = json.loads(prof.read_text())
    assert {u["kind"] for u in data["units"]} == {"embedding", "attention", "mlp", "head"}
    assert all(u["saved_bytes"] > 0 for u in data["units"])
    assert set(data["host_memory"]) == {"runtime_bytes", "fraction"}  # what a CPU run holds beyond its tensors
    # a measured profile without links cannot describe the local cluster, but works on a described one
    with pytest.raises(SystemExit) as err:
        main(["simulate", "--profile", str(prof), *MODEL, "--pipeline-model-parallel-size", "2"])
    assert err.value.code == 2
    assert "no measured links" in capsys.readouterr().err
    # a profile of another device type is refused, not rescaled; named for the cluster's type, it is used
    with pytest.raises(SystemExit) as err:
        main(["simulate", "--cluster", "aws-p3.8xlarge", "--profile", str(prof), *MODEL,
              "--pipeline-model-parallel-size", "2", "--world-size", "2"])
    assert err.value.code == 2 and "no profile for device type v100-16g" in capsys.readouterr().err
    data["device"]["type"] = "v100-16g"
    prof.write_text(json.dumps(data))
    sim = _json(capsys, ["simulate", "--cluster", "aws-p3.8xlarge", "--profile", str(prof), *MODEL,
                         "--pipeline-model-parallel-size", "2", "--world-size", "2", "--json"])
    assert sim["iteration_time_s"] > 0
    del data["device"]["type"]
    data["links"] = {"p2p": {"bandwidth_Bps": 1e9, "latency_s": 1e-4}}
    data["host_memory"] = {"runtime_bytes": 5e7, "fraction": 0.1}  # (this process trained before: measured ~0)
    prof.write_text(json.dumps(data))
    local = _json(capsys, ["simulate", "--profile", str(prof), *MODEL, "--pipeline-model-parallel-size", "2",
                           "--global-batch-size", "8", "--json"])
    assert local["cluster"] == "local" and local["iteration_time_s"] > 0
    # the ranks of this machine share its memory: each stage's capacity is its share (probe, session 12: the whole)
    assert data["device"]["kind"] == "cpu"
    assert [st["capacity_bytes"] for st in local["stages"]] == [data["device"]["memory_bytes"] / 2] * 2
    # and what a CPU run holds beyond its tensors is each local rank's allowance
    for st in local["stages"]:
        bare = st["peak_bytes"] - st["allowance_bytes"]
        assert st["allowance_bytes"] == pytest.approx(5e7 + 0.1 * bare)
    # a micro-batch beyond the profiled sizes (1, 2) is extrapolated, and says so
    assert "extrapolated_micro_batch" not in local
    flags = ["simulate", "--profile", str(prof), *MODEL, "--micro-batch-size", "4", "--global-batch-size", "8"]
    beyond = _json(capsys, [*flags, "--json"])
    assert beyond["extrapolated_micro_batch"] == {"micro_batch_size": 4, "profiled_up_to": 2}
    assert main(flags) == 0
    assert ("note: micro-batch size 4 is beyond the sizes --profile timed (up to 2): unit times extrapolated "
            "linearly; to measure them, autoconfig.py profile --profile-micro-batch-sizes 1,2,4") in capsys.readouterr().out


def test_analytic_profile(capsys, tmp_path):
    prof = tmp_path / "a.json"
    assert main(["profile", "--analytic", "--cluster", "aws-g4dn.12xlarge", "--output", str(prof), *MODEL,
                 "--achievable-fraction", "0.4"]) == 0
    data = json.loads(prof.read_text())
    assert data["mode"] == "analytic" and data["device"]["name"] == "t4"


@pytest.mark.parametrize("argv,message", [
    (["estimate", "--cluster", "nope.yaml"], "--cluster nope.yaml: not a built-in cluster"),
    (["estimate", "--cluster", "aws-p3.8xlarge", "--tensor-model-parallel-size", "3"],
     "world size 4 is not divisible by --tensor-model-parallel-size 3"),
    (["simulate", "--cluster", "aws-p3.8xlarge", "--world-size", "8"], "--world-size 8 exceeds the 4 GPUs"),
    (["estimate", "--cluster", "a100-80g-ib", "--pipeline-model-parallel-size", "2", "--pipeline-partition", "3,3"],
     "--pipeline-partition 3,3: sums to 6"),
    (["simulate", "--cluster", "aws-p3.8xlarge", "--achievable-fraction", "2"], "--achievable-fraction"),
    # subcommands' float flags are finite, and a value starting with '-' reaches its check (#28)
    (["search", "--cluster", "a100-80g-ib", "--lr", "nan"], "--lr must be a finite number"),
    (["search", "--cluster", "a100-80g-ib", "--overlap-factor", "inf"], "--overlap-factor must be a finite number"),
    (["estimate", "--cluster", "a100-80g-ib", "--memory-fragmentation", "5"], "--memory-fragmentation must be in [0, 1)"),
    (["estimate", "--cluster", "a100-80g-ib", "--memory-workspace-gb", "-1"], "--memory-workspace-gb must be >= 0"),
    # this machine's built-in figures are placeholders: no plan, time or memory from them (#29)
    (["search", "--global-batch-size", "8"], "--cluster local: this machine has not been measured; run"),
    (["simulate", "--cluster", "local"], "add --profile prof.json"),
    (["estimate"], "--cluster local: this machine has not been measured"),
    (["simulate", "--cluster", "a100-80g-ib", "--engine", "megatron-core", "--host-op-us", "50"],
     "--host-op-us: engine megatron-core's host is not modelled"),
    (["simulate", "--cluster", "a100-80g-ib", "--cuda-launch-blocking", "--host-op-us", "-1"], "--host-op-us must"),
    (["profile", "--output", "unwritten.json", "--profile-tp", "1,3"], "--profile-tp 3 does not divide"),
    (["search", "--cluster", "a100-80g-ib", "--bert-no-binary-head", "--global-batch-size", "8"],
     "--bert-no-binary-head: applies to --model-type bert"),
    (["search", "--cluster", "a100-80g-ib", "--engine", "megatron-core", "--space", "bpipe=on",
      "--global-batch-size", "8"], "--space bpipe=on: engine megatron-core has no BPipe"),
    (["search", "--cluster", "a100-80g-ib", "--engine", "deepspeed", "--fp16", "--space", "slicing=on",
      "--global-batch-size", "8"], "--space slicing=on: engine deepspeed has no micro-batch slicing"),
    # what Megatron-LM does not run is refused, as DeepSpeed's is
    (["simulate", "--cluster", "a100-80g-ib", "--world-size", "2", "--pipeline-model-parallel-size", "2",
      "--engine", "megatron-core", "--pipeline-schedule", "gpipe"],
     "--engine megatron-core runs the 1F1B, interleaved 1F1B, zb-h1"),
    (["simulate", "--cluster", "a100-80g-ib", "--world-size", "2", "--pipeline-model-parallel-size", "2",
      "--engine", "megatron-core", "--bpipe"], "--engine megatron-core has no BPipe"),
    (["simulate", "--cluster", "a100-80g-ib", "--world-size", "2", "--pipeline-model-parallel-size", "2",
      "--engine", "megatron-core", "--microbatch-slicing", "1"], "--engine megatron-core has no micro-batch slicing"),
    (["simulate", "--cluster", "a100-80g-ib", "--world-size", "2", "--pipeline-model-parallel-size", "2",
      "--engine", "megatron-core", "--pipeline-partition", "4,6"],
     "--pipeline-partition 4,6 starts a stage at mlp_1"),
])
def test_usage_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as err:
        main(argv + MODEL)
    assert err.value.code == 2
    out = capsys.readouterr().err
    assert out.startswith("error: ") and message in out and out.count("\n") == 1


@pytest.mark.slow
def test_bad_cluster_file_exit_code(tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text("device_types: {x: {memory_gb: 8, peak_tflops: {fp32: 1}}}\ngroups: []\ninter_node: {}\n")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "autoconfig.py"), "estimate", "--cluster",
                           str(bad), *MODEL], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stderr == f"error: {bad}: groups is empty\n"


def test_parameters_total_matches_model(capsys):
    from megatron_bmw.config import ModelConfig

    data = _json(capsys, ["estimate", "--cluster", "a100-80g-ib", *MODEL, "--json", "--world-size", "1"])
    padded = 256  # 200 padded to a multiple of 128
    cfg = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=padded)
    assert data["parameters_total"] == total_parameters(cfg)


def test_bpipe_and_slicing_flags(capsys):
    base = ["estimate", "--cluster", "a100-80g-ib", *MODEL, "--pipeline-model-parallel-size", "8",
            "--num-layers", "8", "--global-batch-size", "32", "--world-size", "8", "--json"]
    plain = _json(capsys, base)
    bpipe = _json(capsys, base + ["--bpipe"])
    assert [s["peak_inflight_microbatches"] for s in plain["stages"]] == [8, 7, 6, 5, 4, 3, 2, 1]
    assert max(s["peak_inflight_microbatches"] for s in bpipe["stages"]) <= 5  # mu_opt(8)
    assert bpipe["layout"]["bpipe"] is True
    sim = _json(capsys, ["simulate"] + base[1:] + ["--microbatch-slicing", "auto"])
    assert sim["layout"]["sliced_microbatches"] >= 1
    with pytest.raises(SystemExit):
        main(["estimate"] + base[1:] + ["--microbatch-slicing", "2", "--micro-batch-size", "1"])
    assert "--microbatch-slicing needs an even --micro-batch-size" in capsys.readouterr().err


LLAMA = ["--position-embedding-type", "rope", "--swiglu", "--group-query-attention", "--num-query-groups", "2",
         "--normalization", "RMSNorm", "--disable-bias-linear", "--untie-embeddings-and-output-weights"]


def test_the_planner_plans_llama_layers(capsys):
    """A Llama-family model is counted as it is built (GQA's QKV rows, SwiGLU's three matrices, RMSNorm, no
    biases, no position table) and searched."""
    from megatron_bmw.config import ModelConfig

    data = _json(capsys, ["estimate", "--cluster", "a100-80g-ib", *MODEL, *LLAMA, "--json", "--world-size", "1"])
    cfg = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=256,
                      position_embedding_type="rope", swiglu=True, num_query_groups=2, normalization="RMSNorm",
                      add_bias_linear=False, untie_embeddings_and_output_weights=True)
    assert data["parameters_total"] == total_parameters(cfg)
    gpt2 = _json(capsys, ["estimate", "--cluster", "a100-80g-ib", *MODEL, "--json", "--world-size", "1"])
    assert data["parameters_total"] != gpt2["parameters_total"]
    assert main(["search", "--cluster", "a100-80g-ib", *MODEL, *LLAMA, "--global-batch-size", "8",
                 "--world-size", "8", "--no-progress"]) == 0
    assert "tp" in capsys.readouterr().out


def test_simulate_and_estimate_a_plan_file(capsys, tmp_path):
    """--plan: the plan's own layout, schedule and engine, simulated to its prediction; flags beside it agree."""
    plan = tmp_path / "p.json"
    assert main(["search", "--cluster", "a100-80g-ib", "--num-nodes", "1", "--world-size", "4", *MODEL,
                 "--global-batch-size", "16", "--no-progress", "--output", str(plan)]) == 0
    capsys.readouterr()
    saved = json.loads(plan.read_text())
    sim = _json(capsys, ["simulate", "--cluster", "a100-80g-ib", "--plan", str(plan), "--json"])
    assert sim["iteration_time_s"] == pytest.approx(saved["prediction"]["iteration_time_s"], rel=1e-9)
    assert sim["layout"]["tp"] * sim["layout"]["pp"] * sim["layout"]["dp"] == 4
    assert sim["layout"]["partition"] == saved["pipeline"]["partition"]
    est = _json(capsys, ["estimate", "--cluster", "a100-80g-ib", "--plan", str(plan), "--num-layers", "4", "--json"])
    assert [s["peak_bytes"] for s in est["stages"]] == [s["peak_bytes"] for s in sim["stages"]]
    for argv, message in (
            (["--hidden-size", "128"], "--hidden-size 128 disagrees with --plan"),
            (["--world-size", "2"], "--world-size 2 disagrees with --plan"),
            (["--engine", "megatron-core"], "--engine: engine megatron-core disagrees with --plan"),
            (["--model-type", "bert"], "--model-type bert disagrees with --plan")):
        with pytest.raises(SystemExit) as err:
            main(["simulate", "--cluster", "a100-80g-ib", "--plan", str(plan), *argv])
        out = capsys.readouterr().err
        assert err.value.code == 2 and message in out and out.count("\n") == 1, out
    for command in ("search", "profile"):
        with pytest.raises(SystemExit) as err:
            main([command, "--cluster", "a100-80g-ib", "--plan", str(plan), "--output", str(tmp_path / "x.json")])
        out = capsys.readouterr().err
        assert err.value.code == 2 and f"--plan: {command} does not read a plan file" in out
    assert main(["simulate", "--cluster", "aws-p3.8xlarge", "--plan", str(plan)]) == 0  # another 4-GPU cluster
    small = tmp_path / "small.yaml"
    small.write_text("name: two\ndevice_types:\n  g: {memory_gb: 16, peak_tflops: {fp32: 15, fp16: 125}}\n"
                     "groups:\n  - {nodes: 1, gpus_per_node: 2, device: g, intra_node: {bandwidth_GBps: 150, "
                     "latency_us: 5}}\ninter_node: {bandwidth_GBps: 10, latency_us: 10}\n")
    with pytest.raises(SystemExit) as err:  # a plan for more GPUs than the cluster has
        main(["simulate", "--cluster", str(small), "--plan", str(plan)])
    assert err.value.code == 2 and "needs 4 GPUs" in capsys.readouterr().err


def test_unit_strategies_simulate_on_a_named_cluster(capsys):
    """The host-time model's serial model drops the per-unit strategies (and the schedule) like tp and pp."""
    argv = ["simulate", "--cluster", "a100-80g-ib", "--num-nodes", "1", "--world-size", "2", *MODEL,
            "--global-batch-size", "8", "--micro-batch-size", "1", "--json"]
    hybrid = _json(capsys, argv + ["--unit-strategies", "dp2"])
    plain = _json(capsys, argv)
    assert hybrid["iteration_time_s"] > 0 and plain["layout"]["dp"] == 2


def test_host_op_us_with_a_profile_says_why(capsys, tmp_path):
    prof = tmp_path / "a.json"
    assert main(["profile", "--analytic", "--cluster", "a100-80g-ib", "--output", str(prof), *MODEL]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as err:
        main(["simulate", "--cluster", "a100-80g-ib", "--profile", str(prof), *MODEL, "--world-size", "1",
              "--host-op-us", "100"])
    out = capsys.readouterr().err
    assert err.value.code == 2 and "--host-op-us applies to analytic unit times" in out and out.count("\n") == 1
