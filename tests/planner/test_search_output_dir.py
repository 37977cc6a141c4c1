"""`autoconfig.py search --output-dir DIR`: the top-k plans as plan files that tools/grid_search.py runs."""

import json

import pytest

from megatron_bmw.cli.autoconfig import main
from megatron_bmw.planner.plan import Plan
from megatron_bmw.trials.grid import load_plans

MODEL_FLAGS = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
               "--vocab-size", "256", "--make-vocab-size-divisible-by", "8", "--global-batch-size", "16"]


def test_output_dir_writes_the_top_k_plans(tmp_path, capsys):
    out, best = tmp_path / "plans", tmp_path / "best.json"
    out.mkdir()
    (out / "plan_7.json").write_text("{}")  # left by an earlier, longer search
    (out / "notes.json").write_text("{}")  # not ours
    assert main(["search", "--cluster", "a100-80g-ib", *MODEL_FLAGS, "--top-k", "3", "--output", str(best),
                 "--output-dir", str(out), "--no-progress", "--json"]) == 0
    table = json.loads(capsys.readouterr().out)
    assert sorted(p.name for p in out.iterdir()) == ["notes.json", "plan_1.json", "plan_2.json", "plan_3.json"]
    plans = [Plan.load(str(out / f"plan_{i}.json")) for i in (1, 2, 3)]
    assert [p.search["rank"] for p in plans] == [1, 2, 3]
    times = [p.prediction["iteration_time_s"] for p in plans]
    assert times == sorted(times) and times == pytest.approx([p["prediction"]["iteration_time_s"] for p in table["plans"]])
    assert [p.spec for p in plans] != [plans[0].spec] * 3  # three different plans
    assert plans[0].spec == Plan.load(str(best)).spec  # plan_1 is --output's plan
    # what tools/grid_search.py --plans DIR reads (every JSON file of the folder)
    (out / "notes.json").unlink()
    assert len(load_plans([str(out)])) == 3


def test_output_dir_numbers_with_the_digits_k_needs(tmp_path, capsys):
    out = tmp_path / "plans"
    assert main(["search", "--cluster", "a100-80g-ib", *MODEL_FLAGS, "--top-k", "12", "--output-dir", str(out),
                 "--no-progress"]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert len(names) >= 10 and names[0] == "plan_01.json"
    assert f"{len(names)} plans written to {out}" in capsys.readouterr().out


def test_output_dir_must_be_a_directory(tmp_path, capsys):
    path = tmp_path / "file"
    path.write_text("")
    with pytest.raises(SystemExit) as exc:
        main(["search", "--cluster", "a100-80g-ib", *MODEL_FLAGS, "--output-dir", str(path)])
    assert exc.value.code == 2
    assert "--output-dir" in capsys.readouterr().err
