"""autoconfig.py tune's loop in one process (fast tier): the trials are measured by a stand-in for the trial runner
whose iteration time is a function of the plan's layout, and the micro-batch sizes tune profiles are timed by a
stand-in too. What the loop decides: the plan file it writes carries the calibrated prediction, it profiles the
micro-batch sizes of the plans it is about to measure, and it spends its trial budget on the plans predicted
within the predictions' error of the pick before it stops."""

import json
import os
import re

import pytest

from megatron_bmw.cli import tune
from megatron_bmw.planner.profile_data import Profile, UnitTiming
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
    """Fake trials (their times from `state["truth"]`), fake profiling (linear in the micro-batch size from the
    profile's largest size), the calls recorded."""
    monkeypatch.chdir(tmp_path)
    state = {"truth": default_truth, "runs": [], "profiled": []}

    def run_trial(rep, runner, opts, results, log_dir):
        seconds = state["truth"](rep.layout)
        state["runs"].append(rep.layout)
        rec = _record(rep, "ok", median_iteration_s=seconds, iteration_times_s=[seconds] * 3,
                      tokens_per_s=rep.layout["global_batch_size"] * rep.layout["seq_length"] / seconds)
        results.append(rec)
        return rec

    def measure(args, base, need):
        state["profiled"].append({tp: sorted(sizes) for tp, sizes in need.items()})
        units = []
        for tp, sizes in need.items():
            top = {u.kind: u for u in base.units if u.tp == tp and u.micro_batch_size == 4 and u.recompute is None}
            for b in sizes:
                units += [UnitTiming(k, tp, b, u.forward_s * b / 4, u.backward_s * b / 4, u.saved_bytes)
                          for k, u in top.items()]
        return units

    monkeypatch.setattr(tune, "run_trial", run_trial)
    monkeypatch.setattr(tune, "measure_micro_batches", measure)
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


def test_the_micro_batch_sizes_it_measures_are_profiled_first(loop, capsys):
    """The profile timed micro-batch 1, 2, 4; a global batch of 32 on 2 ranks makes 8, 16 and 32 the search's
    favourites, extrapolated. Tune profiles the sizes of the plans it is about to measure (only those, at the tp
    they run), searches again, and measures no plan at a size its profile did not time."""
    given = open(PROFILE).read()
    assert _tune("--global-batch-size", "32", "--top-k", "2", "--max-trials", "4") == 0
    assert loop["profiled"] and all(sizes for step in loop["profiled"] for sizes in step.values())
    extended = Profile.load("out/profile_0.json")
    timed = {(u.tp, u.micro_batch_size) for u in extended.units if u.kind == "mlp"}
    assert {1, 2, 4} < {b for tp, b in timed if tp == 1}  # the given sizes kept, new ones added
    assert loop["runs"] and all((1, lay["micro_batch_size"]) in timed for lay in loop["runs"])
    assert all(tp == 1 for step in loop["profiled"] for tp in step)  # the profile has no tp 2 entries to extend
    assert open(PROFILE).read() == given  # the given file untouched: the extended one is tune's
    assert extended.device["extends"] == [os.path.abspath(PROFILE)]
    out = capsys.readouterr().out
    assert "[tune] profiling micro-batch sizes" in out and "extrapolated" not in out
    # a resumed tune reads the extended profile and measures nothing again
    profiled = len(loop["profiled"])
    runs = len(loop["runs"])
    assert _tune("--global-batch-size", "32", "--top-k", "2", "--max-trials", "4") == 0
    assert len(loop["runs"]) == runs and len(loop["profiled"]) == profiled


def test_the_trial_budget_goes_to_the_closest_rivals_before_it_stops(loop, capsys):
    """Top-1 a round: round 1 measures the pick, which stays the pick. Before, tune stopped there with 3 of 4
    trials unspent while an untried neighbour predicted just behind it ran faster; it now measures the plans
    predicted within the predictions' error of the pick, and stops only when none is left untried."""
    loop["truth"] = lambda lay: default_truth(lay) * (0.7 if lay["zero1"] else 1.0)  # ZeRO-1 25% faster here
    assert _tune("--global-batch-size", "8", "--top-k", "1", "--max-trials", "4") == 0
    out = capsys.readouterr().out
    measured = [json.loads(line) for line in open("out/measured.jsonl")]
    assert len(measured) >= 2
    best = min(measured, key=lambda r: r["median_iteration_s"])
    assert best["layout"]["zero1"]  # a rival, not the search's first pick
    assert json.load(open("out/plan.json"))["training"]["distributed_optimizer"]
    stop = re.search(r"stopped: (.*)", out).group(1)
    if "--max-trials" not in stop:  # stopped early: no untried plan within the margin of the last search's pick
        margin = float(re.search(r"within ([0-9.]+)%", stop).group(1)) / 100
        rnd = int(re.search(r"round (\d+)", stop).group(1))
        folder = f"out/round_{rnd}"
        plans = [json.load(open(os.path.join(folder, f))) for f in sorted(os.listdir(folder))]
        best_pred = min(p["prediction"]["iteration_time_s"] for p in plans)
        close = [p for p in plans if p["prediction"]["iteration_time_s"] <= best_pred * (1 + margin)]
        tried = {(r["layout"]["micro_batch_size"], r["layout"]["tp"], r["layout"]["pp"], r["layout"]["zero1"])
                 for r in measured}
        assert all((p["pipeline"]["micro_batch_size"], p["parallel"]["tensor_model_parallel_size"],
                    p["parallel"]["pipeline_model_parallel_size"], p["training"]["distributed_optimizer"]) in tried
                   for p in close)


def test_contenders_are_the_top_k_and_the_plans_within_the_margin():
    def trial(t):
        return tune.Trial(flags={}, world_size=2, plan={"prediction": {"iteration_time_s": t}})

    ranked = [trial(t) for t in (1.0, 1.05, 1.1, 1.2, 1.5)]
    assert tune.contenders(ranked, 2, 0.12) == ranked[:3]
    assert tune.contenders(ranked, 1, 0.25) == ranked[:4]
    assert tune.contenders(ranked, 4, 0.0) == ranked[:4] and tune.contenders([], 3, 0.1) == []


def test_the_added_sizes_are_timed_as_the_profile_timed_its_own():
    """measure_micro_batches (what tune's stand-in replaces above) times the asked sizes at the asked tp on this
    machine, units only, in this process at tp 1, with the profile's threads."""
    from megatron_bmw.arguments import parse_args
    from megatron_bmw.cli.profile_commands import measure_micro_batches
    from megatron_bmw.planner_args import build_autoconfig_parser

    args = parse_args(["profile", *MODEL, "--global-batch-size", "8", "--output", "-"], build_autoconfig_parser())
    units = measure_micro_batches(args, Profile.load(PROFILE), {1: {3}})
    assert {(u.kind, u.tp, u.micro_batch_size) for u in units if u.recompute is None} == {
        (k, 1, 3) for k in ("embedding", "attention", "mlp", "head")}
    assert all(u.forward_s > 0 and u.backward_s > 0 for u in units)
