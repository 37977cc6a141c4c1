"""benchmarks/context_parallel_planner.py: a tiny run prints a predicted and a measured time per configuration;
bad input is one line, exit 2, before any rank starts."""

import pytest

from benchmarks import context_parallel_planner


@pytest.mark.slow
def test_a_tiny_run_predicts_and_measures_every_configuration(capsys):
    assert context_parallel_planner.main(["--models", "llama", "--seq", "32", "--hidden", "16", "--layers", "1",
                                          "--vocab", "64", "--rounds", "1", "--per-round", "1", "--warmup", "0",
                                          "--profile-repeats", "1"]) == 0
    out = capsys.readouterr().out
    for config in ("cp1 x dp2", "cp2 p2p", "cp2 a2a"):
        row = [line for line in out.splitlines() if line.startswith(f"| llama | {config} ")]
        assert len(row) == 1, out
        predicted, measured = (float(x) for x in row[0].split("|")[3:5])
        assert predicted > 0 and measured > 0, row
    assert "| llama | ranking " in out


@pytest.mark.parametrize("args, message", [
    (["--rounds", "0"], "argument --rounds: must be >= 1"),
    (["--per-round", "0"], "argument --per-round: must be >= 1"),
    (["--warmup", "-1"], "argument --warmup: must be >= 0"),
    (["--profile-repeats", "0"], "argument --profile-repeats: must be >= 1"),
    (["--models", "bert"], "--models: unknown bert"),
    (["--models", ","], "--models: unknown empty list"),
    (["--hidden", "130"], "--hidden 130: not divisible by --heads 4"),
    (["--seq", "1026"], "--seq 1026: cp 2 cuts a sequence into 4 chunks"),
    (["--groups", "3"], "--groups 3: must divide --heads 4"),
    (["--models", "gpt2", "--heads", "3", "--hidden", "129"], "--heads 3: cp 2's all-to-all"),
    (["--tolerance", "0.5"], "--tolerance 0.5: must be >= 1"),
    (["--json", "/no/such/folder/out.json"], "--json"),
])
def test_bad_input_is_one_line(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        context_parallel_planner.main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
