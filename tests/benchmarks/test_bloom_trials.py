"""The BLOOM trials benchmark's data and its mapping onto the planner (not its accuracy: that is the benchmark's)."""

import json

import pytest

from benchmarks.bloom_trials import evaluate, load_data, run_spec, stage_layers
from megatron_bmw.errors import UsageError


def test_partition_methods_as_the_trials_ran_them():
    assert stage_layers("type:transformer", 72, 12) == [6] * 12
    assert stage_layers("type:transformer", 78, 12) == [7] * 11 + [1]  # the author's note (section Re-do)
    assert stage_layers("type:transformer|embedding", 70, 12) == [5] + [6] * 10 + [5]
    with pytest.raises(UsageError):
        stage_layers("type:transformer|embedding", 72, 12)


def test_every_row_maps_onto_a_run_spec():
    data = load_data()
    for row in data["rows"]:
        spec = run_spec(row, data["setup"])
        assert spec.world_size == 8 * row["nodes"] and spec.global_batch_size == row["gbs"]
        assert sum(spec.pipeline.partition) == 2 * row["layers"] + 2
        assert all(spec.pipeline.recompute[i] == "full" for i in range(1, 2 * row["layers"] + 1))


def test_a_group_evaluates():
    data = load_data()
    result = evaluate(data, ["02-27 h12288 L106"])
    assert [r["line"] for r in result["rows"]] == [891, 892]
    assert all(r["predicted_s"] > 0 and abs(r["error"]) < 1 for r in result["rows"])
    assert result["groups"]["02-27 h12288 L106"]["n"] == 2
    assert result["pairs"]["attention heads"][1] == 1


def test_blocking_launches_charge_the_host_per_micro_batch():
    """The trials ran with CUDA_LAUNCH_BLOCKING=1: each unit's host time adds to its device time, so more, smaller
    micro-batches cost more per sample, and most at tp 8 (line 607: micro-batch 1, 609: 4)."""
    data = load_data()
    assert data["setup"]["kernel_launches"]["blocking"] is True
    group = ["02-21 h14336 L72"]
    held, ahead = evaluate(data, group), evaluate(data, group, launch="async")
    by_line = {r["line"]: r for r in held["rows"]}
    async_line = {r["line"]: r for r in ahead["rows"]}
    added = {line: by_line[line]["predicted_s"] - async_line[line]["predicted_s"] for line in by_line}
    assert all(x > 0 for x in added.values())
    assert added[607] > 2 * added[609]  # four times the micro-batches, each with the same operators


def test_a_bad_row_is_a_usage_error(tmp_path):
    data = load_data()
    data["rows"][0]["dp"] += 1
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(UsageError, match="tp x pp x dp"):
        load_data(str(path))


def test_deepspeeds_whole_layer_checkpoints_and_states_hold_less_than_ours():
    data = load_data()
    group = ["02-21 h14336 L72"]
    theirs, ours = evaluate(data, group), evaluate(data, group, engine="megatron_bmw")
    for a, b in zip(theirs["rows"], ours["rows"]):
        assert a["predicted_peak_gb"] < b["predicted_peak_gb"]  # one checkpoint per layer, not two
    assert ours["false_oom"] >= 1 and theirs["false_oom"] == 0  # line 610 ran at 69 GB
