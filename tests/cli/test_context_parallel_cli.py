"""tools/autoconfig.py with --context-parallel-size: estimate shows the memory of one cp rank, simulate times it,
search takes `--space cp=...` and its plan carries cp; `estimate --plan` reads it back."""

import json

import pytest

from megatron_bmw.cli.autoconfig import main

MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--group-query-attention",
         "--num-query-groups", "2", "--swiglu", "--position-embedding-type", "rope", "--normalization", "RMSNorm",
         "--disable-bias-linear", "--seq-length", "16384", "--max-position-embeddings", "16384", "--vocab-size",
         "1000", "--bf16", "--attention-dropout", "0", "--hidden-dropout", "0", "--mock-data"]


def _json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def _estimate(capsys, cp: int, *extra) -> dict:
    return _json(capsys, ["estimate", "--cluster", "h100-80g-ib", "--world-size", str(2 * cp), *MODEL,
                          "--tensor-model-parallel-size", "2", "--sequence-parallel", "--micro-batch-size", "1",
                          "--global-batch-size", "4", "--use-distributed-optimizer", "--context-parallel-size",
                          str(cp), *extra, "--json"])


def test_estimate_per_cp_rank(capsys):
    one, two, four = (_estimate(capsys, cp) for cp in (1, 2, 4))
    assert [d["layout"]["cp"] for d in (one, two, four)] == [1, 2, 4]
    assert [d["layout"]["dp"] for d in (one, two, four)] == [1, 1, 1]
    a = [d["stages"][0]["activation_bytes"] for d in (one, two, four)]
    assert a[0] > 1.9 * a[1] and a[1] > 1.9 * a[2]  # the local sequence (grouped k, v: a little under half)
    s = [d["stages"][0] for d in (one, two)]
    assert s[1]["params_bytes"] == s[0]["params_bytes"]
    assert s[1]["optimizer_bytes"] == pytest.approx(s[0]["optimizer_bytes"] / 2)  # ZeRO-1 over dp x cp
    assert _estimate(capsys, 2, "--cp-comm-type", "a2a")["layout"]["cp_comm_type"] == "a2a"


def test_estimate_text_names_cp(capsys):
    assert main(["estimate", "--cluster", "h100-80g-ib", "--world-size", "4", *MODEL, "--tensor-model-parallel-size",
                 "2", "--micro-batch-size", "1", "--global-batch-size", "2", "--context-parallel-size", "2"]) == 0
    assert "tp 2 cp 2 (p2p) pp 1 dp 1" in capsys.readouterr().out


def test_cp_that_does_not_split_is_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["estimate", "--cluster", "h100-80g-ib", "--world-size", "6", *MODEL, "--micro-batch-size", "1",
              "--global-batch-size", "2", "--context-parallel-size", "3"])
    assert exc.value.code == 2
    assert "not divisible by 2 x 3" in capsys.readouterr().err


def test_search_with_cp_space_and_its_plan(capsys, tmp_path):
    out = tmp_path / "plan.json"
    got = _json(capsys, ["search", "--cluster", "h100-80g-ib", "--world-size", "8", *MODEL, "--global-batch-size",
                         "4", "--space", "cp=2", "--space", "pp=1", "--output", str(out), "--json", "--no-progress"])
    assert {p["layout"]["cp"] for p in got["plans"]} == {2}
    plan = json.loads(out.read_text())
    assert plan["parallel"]["context_parallel_size"] == 2 and len(plan["devices"]) == 8
    again = _json(capsys, ["estimate", "--cluster", "h100-80g-ib", "--plan", str(out), "--json"])
    assert again["layout"]["cp"] == 2
    sim = _json(capsys, ["simulate", "--cluster", "h100-80g-ib", "--plan", str(out), "--json"])
    assert sim["iteration_time_s"] > 0
