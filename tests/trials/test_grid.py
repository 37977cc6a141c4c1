"""Grid expansion, YAML grids, plan files, infeasible points and the command line's usage errors."""

import os
import subprocess
import sys

import pytest

from megatron_bmw.errors import UsageError
from megatron_bmw.trials.grid import expand, load_grid_file, load_plans, parse_flag_tokens

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --vocab-size 256 --mock-data"


def _expand(text: str, world: int = 4):
    axes, fixed = parse_flag_tokens(text.split())
    return expand(axes, fixed, world)


def test_comma_lists_are_axes_crossed_in_order():
    trials = _expand(f"{MODEL} --global-batch-size 8 --tensor-model-parallel-size 1,2 --micro-batch-size 1,2")
    assert [(t.layout["tp"], t.layout["micro_batch_size"]) for t in trials] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert [t.layout["dp"] for t in trials] == [4, 4, 2, 2]
    assert all(t.flags["--hidden-size"] == "64" and t.flags["--mock-data"] is True for t in trials)
    assert len({t.id for t in trials}) == 4
    # the id is a hash of the flags: the same point in another order of flags has the same id
    again = _expand(f"--micro-batch-size 1,2 --tensor-model-parallel-size 1,2 --global-batch-size 8 {MODEL}")
    assert {t.id for t in again} == {t.id for t in trials}


def test_infeasible_points_carry_the_reason():
    trials = _expand(f"{MODEL} --global-batch-size 8 --pipeline-model-parallel-size 1,3 --micro-batch-size 1,4")
    reasons = {(t.point["--pipeline-model-parallel-size"], t.point["--micro-batch-size"]): t.skip_reason
               for t in trials}
    assert reasons[("1", "1")] is None and reasons[("1", "4")] is not None  # 8 not divisible by 4 x dp 4
    assert "--global-batch-size 8 is not divisible" in reasons[("1", "4")]
    assert "not divisible" in reasons[("3", "1")]  # tp x pp does not divide 4 ranks
    heads = _expand(f"{MODEL} --tensor-model-parallel-size 3,4")
    assert heads[0].skip_reason and not heads[1].skip_reason
    interleaved = _expand(f"{MODEL} --pipeline-model-parallel-size 2 --global-batch-size 6 "
                          "--num-layers-per-virtual-pipeline-stage 1 --micro-batch-size 1,2", world=2)
    assert "needs a multiple of --pipeline-model-parallel-size" in interleaved[1].skip_reason and not interleaved[0].skip_reason


def test_switches_none_and_native_comma_flags():
    trials = _expand(f"{MODEL} --tensor-model-parallel-size 2 --sequence-parallel on,off "
                     "--recompute-granularity none,full --pipeline-partition 3,7;5,5 --pipeline-model-parallel-size 2",
                     world=4)
    assert len(trials) == 8
    assert {t.layout["sp"] for t in trials} == {True, False}
    assert {t.layout["recompute"] for t in trials} == {"none", "full"}
    assert {tuple(t.layout["partition"]) for t in trials} == {(3, 7), (5, 5)}
    assert all("--recompute-granularity" not in t.flags for t in trials if t.layout["recompute"] == "none")


def test_yaml_grid(tmp_path):
    path = tmp_path / "grid.yaml"
    path.write_text("grid:\n  tensor-model-parallel-size: [1, 2]\n  recompute-granularity: [null, selective]\n"
                    "flags:\n  num-layers: 2\n  hidden-size: 64\n  num-attention-heads: 4\n  seq-length: 32\n"
                    "  vocab-size: 256\n  mock-data: true\n  global-batch-size: 4\n")
    axes, fixed = load_grid_file(str(path))
    trials = expand(axes, fixed, 2)
    assert [(t.layout["tp"], t.layout["recompute"]) for t in trials] == \
        [(1, "none"), (1, "selective"), (2, "none"), (2, "selective")]
    bad = tmp_path / "bad.yaml"
    bad.write_text("grid:\n  not-a-flag: [1, 2]\n")
    with pytest.raises(UsageError, match="not-a-flag"):
        load_grid_file(str(bad))


def test_plans_with_world_size_and_conflicting_flags(tmp_path):
    from megatron_bmw.trials.plans import search_plans

    flags = f"{MODEL} --global-batch-size 8".split()
    cluster = tmp_path / "cpu.yaml"
    cluster.write_text("name: cpu-ranks\ninter_node: {bandwidth_GBps: 1, latency_us: 50}\n"
                       "device_types: {cpu: {memory_gb: 8, peak_tflops: {fp32: 0.05}}}\n"
                       "groups: [{nodes: 1, gpus_per_node: 2, device: cpu, "
                       "intra_node: {bandwidth_GBps: 1, latency_us: 50}}]\n")
    paths = search_plans(flags, str(cluster), [], 2, 2, ["pp=1,2"], str(tmp_path / "plans"), progress=False)
    assert len(paths) == 2 and all(os.path.exists(p) for p in paths)
    plans = load_plans([str(tmp_path / "plans")])
    axes, fixed = parse_flag_tokens(flags)
    trials = expand(axes, fixed, None, plans)
    assert [t.world_size for t in trials] == [2, 2] and not any(t.skip_reason for t in trials)
    assert trials[0].argv()[:2] == ["--plan", paths[0]]
    axes, fixed = parse_flag_tokens(flags + ["--micro-batch-size", "64"])  # disagrees with both plans
    assert all("disagrees" in t.skip_reason for t in expand(axes, fixed, None, plans))
    assert all("planned for 2 ranks" in t.skip_reason for t in expand(*parse_flag_tokens(flags), 4, plans))


@pytest.mark.parametrize("argv, message", [
    (["--nproc-per-node", "2", "--no-such-flag", "1"], "--no-such-flag: not a pretrain_gpt.py flag"),
    (["--nproc-per-node", "2", "--train-iters", "5"], "use --trial-iters"),
    (["--tensor-model-parallel-size", "1,2"], "give --nproc-per-node"),
    (["--nproc-per-node", "2", "--warmup-iters", "10", "--trial-iters", "10"], "leaves no measured iteration"),
    (["--nproc-per-node", "2", "--retry", "crashed"], "unknown status"),
    (["--nproc-per-node", "2", "--launcher", "srun"], "inside a SLURM allocation"),
    (["--plans", "/nonexistent/plan.json"], "no such file"),
])
def test_usage_errors_exit_2(tmp_path, monkeypatch, capsys, argv, message):
    from megatron_bmw.trials.cli import main

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--results", str(tmp_path / "r.jsonl")])
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines


def _one_error_line(main, argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def test_bad_sweep_inputs_named_in_one_line(tmp_path, monkeypatch, capsys):
    """The adversarial probe's grid_search.py inputs (#28): tracebacks, usage blocks, silent acceptance."""
    from megatron_bmw.trials.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.yaml").write_text("\n")
    (tmp_path / "empty_axis.yaml").write_text("grid:\n  micro-batch-size: []\n")
    (tmp_path / "a_file").write_text("")
    (tmp_path / "garbage.jsonl").write_text('{"id": "a", "status": "ok", "median_iteration_s": 1}\ngarbage\n'
                                           '{"id": "b", "status": "ok", "median_iteration_s": 1}\n')
    run = ["--nproc-per-node", "1", *MODEL.split()]
    for argv, message in [
        (["--nnodes", "0", *run, "--dry-run"], "--nnodes must be >= 1, got 0"),
        (["--nproc-per-node", "0", *MODEL.split(), "--dry-run"], "--nproc-per-node must be >= 1, got 0"),
        (["--nproc-per-node", "abc"], "argument --nproc-per-node: invalid int value: 'abc'"),
        (["--kill-grace", "-5", *run], "--kill-grace must be >= 0 seconds"),
        (["--trial-timeout", "0", *run], "--trial-timeout must be > 0 seconds"),
        (["--plot", "a_file/x.png", "--report-only", "--results", "garbage.jsonl"], "--plot a_file/x.png: cannot create"),
        (["--plot", ".", "--report-only", "--results", "garbage.jsonl"], "--plot .: is a directory"),
        (["--grid", "empty.yaml", *run], "--grid empty.yaml: empty"),
        (["--grid", "empty_axis.yaml", *run], "the axis --micro-batch-size has no values"),
        ([*run, "--micro-batch-size", "2,", "--dry-run"], "--micro-batch-size '2,': an empty value"),
        (["--report-only", "--results", "garbage.jsonl"], "--results garbage.jsonl: line 2 is not a JSON record"),
        (["--report-only", "--results", "missing.jsonl"], "--results missing.jsonl: no such file"),
        ([*run, "--script", "nope.py"], "--script nope.py: no such file"),
        ([*run, "--results", "a_file/r.jsonl"], "--results a_file/r.jsonl: cannot create folder"),
        ([*run, "--log-dir", "a_file/logs"], "--log-dir a_file/logs: cannot create folder"),
    ]:
        assert message in _one_error_line(main, argv, capsys), argv


def test_a_results_line_cut_by_a_kill_is_skipped_and_not_glued_to(tmp_path, capsys):
    from megatron_bmw.trials.results import Results

    path = tmp_path / "r.jsonl"
    ok = '"status": "ok", "median_iteration_s": 1'
    path.write_text('{"id": "a", ' + ok + '}\n{"id": "b", "sta')
    results = Results(str(path))
    assert set(results.latest) == {"a"} and "line 2 was cut short" in capsys.readouterr().err
    results.append({"id": "c", "status": "ok", "median_iteration_s": 1})
    assert set(Results(str(path)).latest) == {"a", "c"}  # the cut line is dropped
    path.write_text('{"id": "a", ' + ok + '}')  # whole, but without its newline
    results = Results(str(path))
    results.append({"id": "c", "status": "ok", "median_iteration_s": 1})
    assert set(Results(str(path)).latest) == {"a", "c"}


def test_dry_run_lists_without_running(tmp_path, capsys):
    from megatron_bmw.trials.cli import main

    results = tmp_path / "new" / "r.jsonl"  # its folder is created, as the other outputs' are
    main(["--nproc-per-node", "2", *MODEL.split(), "--pipeline-model-parallel-size", "1,2,4", "--dry-run",
          "--results", str(results)])
    out = capsys.readouterr().out
    assert "3 trials: 1 infeasible" in out and "infeasible: world size 2" in out
    assert not results.exists() and results.parent.is_dir()


@pytest.mark.slow
def test_the_sweep_does_not_import_torch():
    code = ("import sys, megatron_bmw.trials.cli, megatron_bmw.trials.specs, megatron_bmw.planner.calibrate; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def test_the_plot_note_names_the_file_written(tmp_path):
    pytest.importorskip("matplotlib")
    from megatron_bmw.trials.report import plot

    rows = [{"id": f"t{i}", "status": "ok", "median_iteration_s": 0.1 * i} for i in (1, 2)]
    note = plot(rows, {"t1": 0.11, "t2": 0.19}, str(tmp_path / "myplot"))
    assert note == f"predicted vs measured written to {tmp_path / 'myplot.png'}"
    assert (tmp_path / "myplot.png").is_file()
