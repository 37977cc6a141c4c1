"""benchmarks/megatron_core_peer.py's bad input (its CPU run, both sides on the same tiny GPT, is the gpu_check dry
run's peer step: tests/tools/test_gpu_check.py)."""

import pytest

from benchmarks import megatron_core_peer

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64", "--vocab-size", "512", "--micro-batch-size", "2", "--global-batch-size", "4"]


@pytest.mark.parametrize("args, message", [
    (["--allow-cpu", "--", *TINY, "--swiglu"], "GPT-2 style models only"),
    (["--peers", "ours,deepspeed"], "--peers 'ours,deepspeed': choose from ours,mcore"),
])
def test_bad_input_is_one_line(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        megatron_core_peer.main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
