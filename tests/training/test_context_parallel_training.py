"""--context-parallel-size through pretrain_gpt's flags: the same losses and grad norms as the serial run on cp2,
cp4, cp2 x tp2 + SP, cp2 x pp2 and cp2 x dp2 with ZeRO-1 (overlapped reduce and gather), and a torch_dist
checkpoint saved on cp2 resumed into another cp."""

import pytest

from megatron_bmw.arguments import configs_from_args, parse_args
from megatron_bmw.errors import UsageError
from tests.dist_harness import run_distributed
from tests.training.test_pretrain import BASE, LLAMA_FLAGS, _layout, _train

CP_MODEL = BASE + LLAMA_FLAGS + ["--seq-length", "128", "--max-position-embeddings", "128", "--hidden-dropout", "0",
                                 "--attention-dropout", "0", "--vocab-size", "128", "--eod-mask-loss"]


def _cp(n, comm="p2p"):
    return ["--context-parallel-size", str(n), "--cp-comm-type", comm]


def _runs(rank, world_size, runs):
    return [_train(rank, world_size, CP_MODEL + ["--train-iters", "3"] + extra) for extra in runs]


def _resume(rank, world_size, save_flags, load_flags, ckpt):
    fmt = ["--ckpt-format", "torch_dist", "--train-iters", "4"]
    _train(rank, world_size, CP_MODEL + fmt + save_flags + ["--save", ckpt, "--exit-interval", "2"])
    return _train(rank, world_size, CP_MODEL + fmt + load_flags + ["--load", ckpt])


def _same(hist, ref, name):
    assert len(hist) == len(ref), name
    for (it, loss, norm), (_, ref_loss, ref_norm) in zip(hist, ref):
        assert loss == pytest.approx(ref_loss, rel=1e-5), (name, it)
        assert norm == pytest.approx(ref_norm, rel=1e-4), (name, it)


@pytest.mark.slow
def test_context_parallel_layouts_train_alike_and_resume_into_another_cp(tmp_path):
    serial = run_distributed(1, _runs, [[], ["--train-iters", "4"]])[0]
    two = run_distributed(2, _runs, [_cp(2), _cp(2, "a2a")])[-1]
    four = {"cp4": _cp(4), "cp2-tp2-sp": _cp(2) + _layout(2, 1) + ["--sequence-parallel"],
            "cp2-pp2": _cp(2) + _layout(1, 2) + ["--pipeline-partition", "2,4"],
            "cp2-dp2-zero1": _cp(2) + ["--use-distributed-optimizer", "--overlap-grad-reduce",
                                       "--overlap-param-gather"]}
    got = run_distributed(4, _runs, list(four.values()))[-1]
    for name, hist in zip(("cp2", "cp2-a2a", *four), two + got):
        _same(hist, serial[0], name)
    ckpt = str(tmp_path / "ckpt")
    resumed = run_distributed(4, _resume, _cp(2) + ["--use-distributed-optimizer"], _cp(4), ckpt)[-1]
    assert [h[0] for h in resumed] == [3, 4]
    _same(resumed, serial[1][2:], "cp2-dp2 -> cp4")


@pytest.mark.parametrize("world,extra,needle", [
    (6, _cp(3), "--seq-length 128 is not divisible by 2 x 3"),
    (2, _cp(2) + ["--attention-dropout", "0.1"], "attention dropout"),
    (8, _cp(8, "a2a"), "--cp-comm-type a2a"),
    (2, ["--hierarchical-context-parallel-sizes", "2", "2"], "--hierarchical-context-parallel-sizes"),
    (2, _cp(2) + ["--unit-strategies", "dp1"], "--unit-strategies"),
    (8, _cp(2) + _layout(4, 1) + ["--sequence-parallel", "--num-query-groups", "4", "--seq-length", "12", "--max-position-embeddings", "12"],
     "do not split over tensor-parallel size 4"),
])
def test_bad_context_parallel_flags_one_line(world, extra, needle):
    with pytest.raises(UsageError, match=needle):
        configs_from_args(parse_args(CP_MODEL + extra), world)
