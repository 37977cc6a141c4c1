"""tools/autoconfig.py on MoE models: estimate takes --expert-model-parallel-size/--expert-tensor-parallel-size and
--moe-load-imbalance, search takes `--space ep=... --space etp=...` (MoE models only) and its plan carries them."""

import json

import pytest

from megatron_bmw.cli.autoconfig import main

DENSE = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--group-query-attention",
         "--num-query-groups", "2", "--swiglu", "--position-embedding-type", "rope", "--normalization", "RMSNorm",
         "--disable-bias-linear", "--seq-length", "1024", "--max-position-embeddings", "1024", "--vocab-size",
         "1000", "--bf16", "--attention-dropout", "0", "--hidden-dropout", "0", "--mock-data"]
MOE = DENSE + ["--num-experts", "8", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall"]


def _json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def _estimate(capsys, *extra):
    return _json(capsys, ["estimate", "--cluster", "h100-80g-ib", "--world-size", "8", *MOE, "--micro-batch-size",
                          "1", "--global-batch-size", "8", "--use-distributed-optimizer", *extra, "--json"])


def test_estimate_over_ep(capsys):
    one, four = _estimate(capsys), _estimate(capsys, "--expert-model-parallel-size", "4")
    assert (one["layout"]["ep"], four["layout"]["ep"], four["layout"]["etp"]) == (1, 4, 1)
    a, b = one["stages"][0], four["stages"][0]
    assert b["params_bytes"] < a["params_bytes"] / 2  # the experts are most of the parameters
    assert four["moe_load_imbalance"] == 1.0
    hot = _estimate(capsys, "--expert-model-parallel-size", "4", "--moe-load-imbalance", "2")
    assert hot["moe_load_imbalance"] == 2.0 and hot["stages"][0]["activation_bytes"] > b["activation_bytes"]


def test_estimate_refuses_a_bad_expert_layout_in_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        _estimate(capsys, "--expert-model-parallel-size", "3")
    assert exc.value.code == 2 and "does not divide --num-experts 8" in capsys.readouterr().err


def test_search_over_ep_etp_and_its_plan(capsys, tmp_path):
    out = tmp_path / "plan.json"
    got = _json(capsys, ["search", "--cluster", "h100-80g-ib", "--world-size", "8", *MOE, "--global-batch-size", "8",
                         "--space", "ep=1,2,4", "--space", "etp=1", "--space", "pp=1", "--output", str(out), "--json",
                         "--no-progress"])
    assert {p["layout"]["ep"] for p in got["plans"]} <= {1, 2, 4}
    assert {p["layout"]["etp"] for p in got["plans"]} == {1}
    plan = json.loads(out.read_text())
    assert plan["parallel"]["expert_model_parallel_size"] == got["plans"][0]["layout"]["ep"]
    assert plan["prediction"]["moe_load_imbalance"] == 1.0
    again = _json(capsys, ["estimate", "--cluster", "h100-80g-ib", "--plan", str(out), "--json"])
    assert again["layout"]["ep"] == plan["parallel"]["expert_model_parallel_size"]


def test_dense_model_refuses_ep_space(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["search", "--cluster", "h100-80g-ib", "--world-size", "8", *DENSE, "--global-batch-size", "8",
              "--space", "ep=2", "--no-progress"])
    assert exc.value.code == 2 and "no experts" in capsys.readouterr().err


TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--vocab-size", "200", "--micro-batch-size", "2", "--num-experts", "4", "--moe-layer-freq", "[0,1]",
        "--moe-ffn-hidden-size", "32"]


def test_profile_times_moe_units_and_the_planner_reads_them(capsys, tmp_path):
    """`profile` of a model with a dense and an MoE layer times both kinds (the MoE unit plain and fully recomputed);
    simulate and search read the MoE times (set to a second, the iteration takes seconds), and a profile without them
    leaves the MoE unit to the kernel model."""
    prof = tmp_path / "prof.json"
    assert main(["profile", "--output", str(prof), *TINY, "--profile-micro-batch-sizes", "1,2", "--profile-repeats",
                 "1", "--profile-warmup", "0", "--no-links"]) == 0
    capsys.readouterr()
    data = json.loads(prof.read_text())
    assert {(u["kind"], u["recompute"]) for u in data["units"]} >= {("mlp", None), ("moe", None), ("moe", "full")}
    assert all(u["saved_bytes"] > 0 for u in data["units"] if u["kind"] == "moe")
    assert data["model"]["moe"]["num_experts"] == 4 and data["model"]["ffn_hidden_size"] == 256
    data["links"] = {"p2p": {"bandwidth_Bps": 1e9, "latency_s": 1e-4}}
    data["host_memory"] = {"runtime_bytes": 5e7, "fraction": 0.1}  # (a process that trained before measures noise)
    prof.write_text(json.dumps(data))
    flags = ["--profile", str(prof), *TINY, "--global-batch-size", "8", "--json"]
    base = _json(capsys, ["simulate", *flags])["iteration_time_s"]
    assert base < 1.0
    for u in data["units"]:  # a second per MoE pass: an iteration of 4 micro-batches takes seconds
        if u["kind"] == "moe":
            u["forward_s"] = u["backward_s"] = 1.0
    slow = tmp_path / "slow.json"
    slow.write_text(json.dumps(data))
    assert _json(capsys, ["simulate", *flags[2:], "--profile", str(slow)])["iteration_time_s"] > 4.0
    best = [_json(capsys, ["search", *flags[2:], "--profile", str(p), "--no-progress"])["plans"][0]["prediction"]
            for p in (prof, slow)]
    assert best[0]["iteration_time_s"] < 1.0 < best[1]["iteration_time_s"]
    data["units"] = [u for u in data["units"] if u["kind"] != "moe"]
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(data))
    assert _json(capsys, ["simulate", *flags[2:], "--profile", str(bare)])["iteration_time_s"] > 0
