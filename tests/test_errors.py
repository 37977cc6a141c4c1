"""errors.report: one line per bad input, never lost when rank 0 is slower than the others."""

import os
import subprocess
import sys

import pytest

from megatron_bmw import errors
from megatron_bmw.errors import UsageError, report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_usage_error_before_init_rank0_prints_at_once(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(errors.time, "sleep", lambda s: pytest.fail("rank 0 must not wait"))
    assert report(UsageError("--save /x: cannot be created")) == 2
    assert capsys.readouterr().err == "error: --save /x: cannot be created\n"


@pytest.mark.slow
def test_usage_error_before_init_other_rank_under_torchrun_prints_after_grace(monkeypatch, capsys):
    """torchrun stops the other ranks once one has failed: a rank still alive after the grace (rank 0 was the
    slower one, and was stopped before it printed) prints the same line, so it is never lost."""
    waited = []
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setattr(errors.time, "sleep", waited.append)
    assert report(UsageError("--save /x: cannot be created")) == 2
    assert waited == [errors.REPORT_GRACE_S]
    assert capsys.readouterr().err == "error: --save /x: cannot be created\n"


@pytest.mark.slow
def test_usage_error_before_init_other_rank_elsewhere_is_silent(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setattr(errors.time, "sleep", lambda s: pytest.fail("no wait outside torchrun"))
    assert report(UsageError("--save /x: cannot be created")) == 2
    assert capsys.readouterr().err == ""


@pytest.mark.slow
def test_a_closed_pipe_ends_quietly():
    """`grid_search.py --dry-run | head -1` printed a BrokenPipeError traceback."""
    code = ("from megatron_bmw.errors import exit_on_usage_error\n"
            "@exit_on_usage_error\n"
            "def main():\n"
            "    for i in range(200000):\n"
            "        print('line', i)\n"
            "main()\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 1 and "Traceback" not in err, err


def test_ctrl_c_before_a_handler_is_one_line(monkeypatch, capsys):
    """Ctrl-C in a run's start-up (before pretrain's own handler saves) printed a KeyboardInterrupt traceback."""
    monkeypatch.setenv("RANK", "0")

    @errors.exit_on_usage_error
    def main():
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as exc:
        main()
    assert exc.value.code == 130 and capsys.readouterr().err == "error: interrupted (SIGINT); stopped\n"
