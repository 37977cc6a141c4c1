"""autoconfig.py tune: the loop (search, measure in interleaved repeats, calibrate, re-search) on a fake launcher
and a stand-in trainer whose time depends on the plan; it converges, resumes, survives failing trials, and takes
SLURM's path. No torch: the trainer is tests/trials/fake/fake_trainer.py, launched by the fake srun."""

import json
import os
import shutil

import pytest

from megatron_bmw.cli.tune import aggregate, main

HERE = os.path.dirname(os.path.abspath(__file__))
FAKE = os.path.join(os.path.dirname(HERE), "trials", "fake")
PROFILE = os.path.join(os.path.dirname(HERE), "trials", "data", "local_profile.json")
MODEL = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --vocab-size 512 "
         "--make-vocab-size-divisible-by 128 --global-batch-size 8 --mock-data").split()


@pytest.fixture
def slurm(tmp_path, monkeypatch):
    """The fake srun first on PATH, inside a pretend allocation; the trainer's base step time."""
    folder = tmp_path / "bin"
    folder.mkdir()
    shutil.copy(os.path.join(FAKE, "srun"), folder / "srun")
    os.chmod(folder / "srun", 0o755)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("FAKE_ITER_S", "0.01")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _tune(*extra):
    return main(["--nproc-per-node", "2", "--launcher", "srun", "--profile", PROFILE, "--script",
                 os.path.join(FAKE, "fake_trainer.py"), "--trial-iters", "4", "--warmup-iters", "1",
                 "--repeats", "2", "--top-k", "3", *extra, *MODEL])


def _records(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_converges_to_the_measured_best_and_writes_its_plan(slurm, capsys):
    assert _tune("--output-dir", "out") == 0
    out = capsys.readouterr().out
    assert "the pick is stable" in out
    measured = {r["id"]: r for r in _records("out/measured.jsonl")}
    best = min((r for r in measured.values() if r["status"] == "ok"), key=lambda r: r["median_iteration_s"])
    plan = json.load(open("out/plan.json"))
    assert plan["pipeline"]["micro_batch_size"] == best["layout"]["micro_batch_size"]
    assert not plan["training"]["distributed_optimizer"]  # ZeRO-1 is slower in the stand-in
    assert os.path.isfile("out/report.txt") and os.path.isfile("out/profile_1.json")
    repeats = [r for r in _records("out/trials.jsonl") if r["status"] == "ok"]
    assert len(repeats) >= 2 * len(measured)  # every trial measured in its repeats
    assert f"pick: {best['id']}" in out


@pytest.mark.slow
def test_an_interrupted_tune_resumes_without_measuring_again(slurm, capsys):
    _tune("--output-dir", "out", "--max-trials", "1")
    first = _records("out/trials.jsonl")
    assert "--max-trials 1 measured" in capsys.readouterr().out
    _tune("--output-dir", "out", "--max-trials", "3")
    again = _records("out/trials.jsonl")
    ids = [r["id"] for r in again if r["status"] == "running"]
    assert len(ids) == len(set(ids))  # no repeat ran twice
    assert again[:len(first)] == first


@pytest.mark.slow
def test_a_trial_that_runs_out_of_memory_does_not_stop_the_loop(slurm, capsys, monkeypatch):
    monkeypatch.setenv("FAKE_OOM_MBS", "4")
    assert _tune("--output-dir", "out") == 0
    measured = _records("out/measured.jsonl")
    assert {r["status"] for r in measured} == {"ok", "oom"}
    assert json.load(open("out/plan.json"))["pipeline"]["micro_batch_size"] != 4


def test_repeats_aggregate_to_their_median_and_spread():
    reps = [{"id": "a.1", "status": "ok", "median_iteration_s": 1.0, "layout": {"global_batch_size": 8, "seq_length": 4}},
            {"id": "a.2", "status": "ok", "median_iteration_s": 1.2},
            {"id": "a.3", "status": "ok", "median_iteration_s": 1.1},
            {"id": "a.4", "status": "running"}]
    agg = aggregate("a", reps)
    assert agg["median_iteration_s"] == pytest.approx(1.1) and agg["spread"] == pytest.approx(0.2 / 1.1)
    assert agg["repeats"] == 3 and agg["tokens_per_s"] == pytest.approx(32 / 1.1)
    assert aggregate("a", reps + [{"id": "a.5", "status": "hang", "reason": "killed"}])["status"] == "hang"
    assert aggregate("a", [{"id": "a.1", "status": "running"}]) is None


@pytest.mark.parametrize("extra,needle", [
    (["--nproc-per-node", "0"], "--nproc-per-node must be >= 1"),
    (["--nproc-per-node", "2", "--micro-batch-size", "1,2"], "tune searches the layout itself"),
    (["--nproc-per-node", "2", "--script", "nope.py"], "--script nope.py: no such file"),
    (["--nproc-per-node", "2", "--max-spread", "0"], "--max-spread must be > 0"),
    (["--nproc-per-node", "2", "--cluster", "a100-80g-ib"], "give --profile"),
    (["--nproc-per-node", "2", "--kill-grace", "-1"], "--kill-grace must be >= 0 seconds"),
    (["--nproc-per-node", "2", "--kill-grace", "nan"], "--kill-grace must be >= 0 seconds"),
])
def test_bad_input_is_one_line(tmp_path, monkeypatch, capsys, extra, needle):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(SystemExit) as err:
        main([*extra, *MODEL])
    lines = capsys.readouterr().err.strip().splitlines()
    assert err.value.code == 2 and len(lines) == 1 and needle in lines[0], lines


def _refused(capsys, *extra):
    with pytest.raises(SystemExit) as err:
        main(["--nproc-per-node", "2", "--profile", PROFILE, "--output-dir", "out", *extra, *MODEL])
    lines = capsys.readouterr().err.strip().splitlines()
    assert err.value.code == 2 and len(lines) == 1, lines
    return lines[0]


def test_an_output_dir_holds_one_tune(tmp_path, monkeypatch, capsys):
    """Another model, batch or space into a folder that holds a tune is refused before anything runs or is
    overwritten; tune.json records the folder's run."""
    monkeypatch.chdir(tmp_path)
    os.makedirs("out")
    mine = {"flags": ["--nproc-per-node", "2"], "world_size": 2, "cluster": "local", "space": []}
    with open("out/tune.json", "w") as f:
        json.dump(mine, f)
    line = _refused(capsys)
    assert line.startswith("error: --output-dir out holds a tune of another run (flags: --nproc-per-node 2)"), line
    assert json.load(open("out/tune.json")) == mine and sorted(os.listdir("out")) == ["tune.json"]
    with open("out/tune.json", "w") as f:
        f.write("{")
    assert "tune.json is unreadable" in _refused(capsys)


@pytest.mark.parametrize("record,needle", [
    ({"id": "06dd8b804778.9", "status": "ok"}, "line 2: an ok trial needs median_iteration_s > 0, got None"),
    ({"id": 3, "status": "ok"}, "line 2: id must be a string, got 3"),
    ({"id": "a.1", "status": "fine"}, "line 2: status must be one of ok, oom, crash, hang, infeasible or running"),
])
def test_a_hand_edited_trials_file_is_one_line(tmp_path, monkeypatch, capsys, record, needle):
    monkeypatch.chdir(tmp_path)
    os.makedirs("out")
    with open("out/trials.jsonl", "w") as f:
        f.write(json.dumps({"id": "a.1", "status": "running"}) + "\n" + json.dumps(record) + "\n")
    line = _refused(capsys)
    assert line.startswith("error: --output-dir out/trials.jsonl: ") and needle in line, line
