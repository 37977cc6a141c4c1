"""autoconfig.py tune's loop in one process (fast tier): the trials are measured by a stand-in for the trial runner
whose iteration time is a function of the plan's layout. What the loop decides: the plan file it writes carries the
calibrated prediction."""

import json
import os
import re

import pytest

from megatron_bmw.cli import tune
from megatron_bmw.trials.cli import _record

HERE = os.path.dirname(os.path.abspath(__file__))
PROFILE = os.path.join(os.path.dirname(HERE), "trials", "data", "local_profile.json")  # micro-batch 1, 2, 4; tp 1
MODEL = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --vocab-size 512 "
         "--make-vocab-size-divisible-by 128 --mock-data").split()


def default_truth(lay: dict) -> float:
    """A machine where the profile's tp 1 times hold, slower with ZeRO-1."""
    return 0.02 * lay["num_microbatches"] * (1 + 0.1 * lay["micro_batch_size"]) * (1.15 if lay["zero1"] else 1.0)


@pytest.fixture
def loop(tmp_path, monkeypatch):
    """Fake trials (their times from `state["truth"]`), the calls recorded."""
    monkeypatch.chdir(tmp_path)
    state = {"truth": default_truth, "runs": []}

    def run_trial(rep, runner, opts, results, log_dir):
        seconds = state["truth"](rep.layout)
        state["runs"].append(rep.layout)
        rec = _record(rep, "ok", median_iteration_s=seconds, iteration_times_s=[seconds] * 3,
                      tokens_per_s=rep.layout["global_batch_size"] * rep.layout["seq_length"] / seconds)
        results.append(rec)
        return rec

    monkeypatch.setattr(tune, "run_trial", run_trial)
    return state


def _tune(*extra):
    return tune.main(["--nproc-per-node", "2", "--profile", PROFILE, "--trial-iters", "4", "--warmup-iters", "1",
                      "--repeats", "1", "--output-dir", "out", *extra, *MODEL])


def _report_rows(text: str) -> dict:
    """trial id -> (pred then, pred now, measured) from the report's second table."""
    rows = {}
    for line in text.splitlines():
        m = re.match(r"([0-9a-f]{12})\s+\d+\s+([0-9.]+|-)\s+([0-9.]+|-)\s+([0-9.]+)\s", line)
        if m:
            rows[m.group(1)] = tuple(float(x) if x != "-" else None for x in m.groups()[1:])
    return rows


def test_the_plan_file_carries_the_calibrated_prediction(loop, capsys):
    """The plan the search wrote in round 1 predicts on the uncalibrated profile; tune's plan.json must carry what
    the report shows after calibration, or `pretrain_gpt.py --plan` measures against the wrong number (+318%)."""
    loop["truth"] = lambda lay: 4 * default_truth(lay)  # the machine runs 4x slower than its profile said
    assert _tune("--global-batch-size", "8", "--top-k", "3", "--max-trials", "6") == 0
    report = open("out/report.txt").read()
    pick = re.search(r"pick: ([0-9a-f]{12})", report).group(1)
    then, now, measured = _report_rows(report)[pick]
    plan = json.load(open("out/plan.json"))
    assert plan["prediction"]["iteration_time_s"] == pytest.approx(now, abs=5e-5)
    assert abs(now / measured - 1) < 0.5 < abs(then / measured - 1)  # calibrated; the search's was far off
    assert plan["search"]["tune"]["predicted_when_searched_s"] == pytest.approx(then, abs=5e-5)
    assert plan["profiles"][0]["source"] == plan["search"]["tune"]["profile"] != PROFILE
    assert plan["prediction"]["stages"] and plan["prediction"]["mfu"] is None  # CPU ranks: no peak
    assert f"predicted {now:.4f} s by the calibrated profile" in capsys.readouterr().out
