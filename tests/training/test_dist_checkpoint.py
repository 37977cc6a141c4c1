"""--ckpt-format torch_dist: a checkpoint saved on one layout resumes on any other exactly (losses and grad norms of
the continued run equal the source layout's own continuation), atomic saves, clear errors."""

import os
import shutil

import pytest

from megatron_bmw.training.loop import build_trainer
from tests.dist_harness import run_distributed

GPT = ["--mock-data", "--vocab-size", "128", "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
       "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "16", "--lr", "1e-3",
       "--lr-warmup-iters", "2", "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1",
       "--make-vocab-size-divisible-by", "4", "--attention-backend", "unfused", "--hidden-dropout", "0",
       "--attention-dropout", "0", "--seed", "7"]
TP, PP = "--tensor-model-parallel-size", "--pipeline-model-parallel-size"
ZERO1 = "--use-distributed-optimizer"
# name: (world size, flags); 4 layers = 10 units
LAYOUTS = {
    "serial": (1, []),
    "tp2-pp2-sp": (4, [TP, "2", PP, "2", "--sequence-parallel"]),
    "pp2-v2-cut": (2, [PP, "2", "--num-layers-per-virtual-pipeline-stage", "1", "--pipeline-partition", "2,3,3,2"]),
    "dp2-zero1": (2, [ZERO1]),
    "pp4-bpipe": (4, [PP, "4", "--bpipe"]),
    "tp2": (2, [TP, "2"]),
    "dp4": (4, []),
    "pp2-dp2-zero1": (4, [PP, "2", ZERO1]),
}
NAMES = list(LAYOUTS)
# each layout resumes from two sources and is the source of two resumes (16 ordered pairs)
PAIRS = [(NAMES[i], NAMES[(i + k) % len(NAMES)]) for i in range(len(NAMES)) for k in (1, 3)]


def _train(rank, world_size, argv):
    trainer = build_trainer(argv)
    trainer.train()
    trainer.finish()
    return trainer.history


def _run(layout: str, extra: list[str]):
    world, flags = LAYOUTS[layout]
    return run_distributed(world, _train, GPT + flags + extra)[-1]


def _checkpoint_at(src_dir: str, iteration: int, dst_dir: str) -> str:
    """A checkpoint directory whose tracker names `iteration` of `src_dir`."""
    name = f"iter_{iteration:07d}"
    shutil.copytree(os.path.join(src_dir, name), os.path.join(dst_dir, name))
    with open(os.path.join(dst_dir, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))
    return dst_dir


def _same(hist, ref, what):
    assert [h[0] for h in hist] == [h[0] for h in ref], what
    for (it, loss, norm), (_, ref_loss, ref_norm) in zip(hist, ref):
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=0), (what, it)
        assert norm == pytest.approx(ref_norm, rel=1e-4, abs=0), (what, it)


@pytest.mark.slow
def test_resume_on_any_layout(tmp_path):
    """Every layout trains 8 iterations saving torch_dist at 4; every pair resumes B from A's iteration 4 and
    continues exactly as A did."""
    refs, ckpts = {}, {}
    for name in NAMES:
        ckpts[name] = str(tmp_path / name)
        refs[name] = _run(name, ["--train-iters", "8", "--save", ckpts[name], "--save-interval", "4",
                                 "--ckpt-format", "torch_dist"])
        assert [h[0] for h in refs[name]] == list(range(1, 9))
        assert os.path.isfile(os.path.join(ckpts[name], "iter_0000004", ".metadata"))
    for src, dst in PAIRS:
        start = _checkpoint_at(ckpts[src], 4, str(tmp_path / f"{src}-to-{dst}"))
        resumed = _run(dst, ["--train-iters", "8", "--load", start])
        _same(resumed, refs[src][4:], f"{src} -> {dst}")
