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
