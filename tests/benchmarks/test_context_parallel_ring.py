"""benchmarks/context_parallel_ring.py: a tiny run prints the three methods with equal results; bad input is one
line, exit 2, before any rank starts."""

import pytest

from benchmarks import context_parallel_ring


@pytest.mark.slow
def test_a_tiny_run_times_the_ring_and_the_all_gather_with_the_same_results(capsys):
    assert context_parallel_ring.main(["--cp", "2", "--seqs", "32", "--repeats", "1", "--heads", "2",
                                       "--kv-heads", "1", "--head-dim", "4"]) == 0
    out = capsys.readouterr().out
    row = [line for line in out.splitlines() if line.startswith("| 2  | 32 ")]
    assert len(row) == 1, out
    assert float(row[0].rstrip(" |").rsplit("|", 1)[1]) < 1e-5


@pytest.mark.parametrize("args, message", [
    (["--cp", "1"], "--cp 1: a ring needs at least 2 ranks"),
    (["--cp", "4", "--seqs", "12"], "--seqs 12: not divisible by 2 x --cp 4"),
    (["--heads", "4", "--kv-heads", "3"], "--heads 4: not a multiple of --kv-heads 3"),
    (["--repeats", "0"], "argument --repeats: must be >= 1"),
])
def test_bad_input_is_one_line(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        context_parallel_ring.main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
