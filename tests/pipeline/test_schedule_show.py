"""The text timeline CLI."""

import subprocess
import sys

import pytest

from megatron_bmw.pipeline import show


def _run(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "megatron_bmw.pipeline.show", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


@pytest.mark.slow
def test_cli_prints_timeline():
    out = _run("--pp", "4", "--microbatches", "8", "--schedule", "1f1b")
    assert out.returncode == 0, out.stderr
    assert "rank 0: F0 F1 F2 F3 B0 F4 B1" in out.stdout
    row = next(line for line in out.stdout.splitlines() if line.startswith("rank 3 ") and ":" not in line)
    assert row.split()[2:8] == [".", ".", ".", "F0", "B0", "B0"]  # one column per time unit, B takes 2
    assert "makespan 33" in out.stdout and "bubble fraction 27.3%" in out.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,text",
    [
        (["--pp", "0", "--microbatches", "8"], "--pipeline-model-parallel-size"),
        (["--pp", "4", "--microbatches", "6", "--schedule", "interleaved", "--virtual-stages", "2"], "multiple"),
    ],
)
def test_cli_bad_input(args, text):
    out = _run(*args)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and text in lines[0]


def test_main_in_process(capsys):
    show.main(["--pp", "2", "--microbatches", "4", "--schedule", "interleaved", "--virtual-stages", "2"])
    text = capsys.readouterr().out
    assert "F0.0" in text and "B3.0" in text and "makespan" in text
    with pytest.raises(SystemExit) as info:
        show.main(["--pp", "2", "--microbatches", "4", "--schedule", "gpipe", "--virtual-stages", "2"])
    assert info.value.code == 2
    assert capsys.readouterr().err.startswith("error: --pipeline-schedule gpipe cannot interleave")


def test_1f1b_with_virtual_stages_is_the_interleaved_schedule(capsys):
    """The README's example: 1F1B over virtual stages means Megatron's interleaved 1F1B."""
    show.main(["--pp", "4", "--microbatches", "8", "--schedule", "1f1b", "--virtual-stages", "2"])
    as_1f1b = capsys.readouterr().out
    assert as_1f1b.startswith("schedule interleaved: p=4 m=8 v=2")
    assert "rank 0: F0.0 F1.0 F2.0 F3.0 F0.1" in as_1f1b  # chunk 0 of a round of p micro-batches, then chunk 1
    show.main(["--pp", "4", "--microbatches", "8", "--schedule", "interleaved", "--virtual-stages", "2"])
    assert as_1f1b == capsys.readouterr().out
    show.main(["--pp", "4", "--microbatches", "8", "--schedule", "1f1b"])
    assert capsys.readouterr().out.startswith("schedule 1f1b: p=4 m=8 v=1")


def test_error_names_a_flag_of_the_tool(capsys):
    """The schedule's errors speak of --pipeline-schedule, which the tool accepts beside --schedule."""
    with pytest.raises(SystemExit) as info:
        show.main(["--pp", "2", "--microbatches", "4", "--pipeline-schedule", "gpipe", "--virtual-stages", "2"])
    assert info.value.code == 2
    assert capsys.readouterr().err.startswith("error: --pipeline-schedule gpipe cannot interleave")


def test_zb_h1_shows_b_and_w(capsys):
    show.main(["--pp", "4", "--microbatches", "8", "--schedule", "zb-h1"])
    text = capsys.readouterr().out
    assert "rank 3: F0 B0 F1 B1 F2 B2 F3 B3 W0 F4" in text
    assert "makespan 27" in text  # 1F1B: 33 (B and W one time unit each)
    with pytest.raises(SystemExit) as info:
        show.main(["--pp", "2", "--microbatches", "4", "--schedule", "zb-h1", "--virtual-stages", "2"])
    assert info.value.code == 2
    assert capsys.readouterr().err.startswith("error: --pipeline-schedule zb-h1 cannot interleave")


def test_zb_h2_and_zbv_show(capsys):
    show.main(["--pp", "2", "--microbatches", "4", "--schedule", "zbv"])
    text = capsys.readouterr().out
    assert text.startswith("schedule zbv: p=2 m=4 v=2")
    assert "rank 0: F0.0 F1.0 F2.0 F0.1 B0.1 W0.1" in text
    # one time unit per chunk's F, B and W (a chunk is half a stage here): each rank computes 24, one idle unit
    assert "makespan 25, busiest rank computes 24" in text
    show.main(["--pp", "2", "--microbatches", "4", "--schedule", "zb-h2"])
    assert "rank 0: F0 F1 F2 B0 W0 B1 F3" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        show.main(["--pp", "2", "--microbatches", "4", "--schedule", "zbv", "--virtual-stages", "3"])
    assert info.value.code == 2
    assert capsys.readouterr().err.startswith("error: --pipeline-schedule zbv holds 2 model chunks per rank, not 3")
