"""benchmarks/wgrad_fusion.py: a tiny run prints both paths and equal gradients; bad input is one line, exit 2."""

import pytest

from benchmarks import wgrad_fusion


def test_a_tiny_run_times_both_paths_with_the_same_gradients(capsys):
    assert wgrad_fusion.main(["--hidden", "32", "--layers", "1", "--seq", "8", "--mbs", "1", "--micro", "2",
                              "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "fused kernel: addmm" in out and "| fused " in out and "| unfused " in out
    diff = float(out.rsplit("max |main_grad fused - unfused|:", 1)[1])
    assert diff < 1e-5


@pytest.mark.parametrize("args, message", [
    (["--rounds", "0"], "--rounds: must be >= 1"),
    (["--dtype", "bf16"], "--dtype: 16-bit runs need --device cuda"),
    (["--dtype", "fp8"], "argument --dtype: invalid choice"),
])
def test_bad_input_is_one_line(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        wgrad_fusion.main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
