"""A run whose loss stops being finite stops (TrainingDiverged, every rank at the same iteration) and saves
nothing diverged; fp16's loss-scale overflows are skipped and logged without a loss, as in Megatron."""

import os
import re

import pytest

from megatron_bmw.config import OptimizerConfig
from megatron_bmw.training.loop import TrainingDiverged, build_trainer, divergence
from megatron_bmw.training.optimizer import StepResult
from tests.dist_harness import run_distributed
from tests.training.test_pretrain import BASE, _cli, iteration_lines

OK, SKIPPED = StepResult(True, 1.0, 1.0), StepResult(False, None, 1.0)


def test_rule():
    fp32, bf16 = OptimizerConfig(lr=1.0), OptimizerConfig(lr=1.0, bf16=True)
    fp16 = OptimizerConfig(lr=1.0, fp16=True, min_loss_scale=2.0)
    constant = OptimizerConfig(lr=1.0, fp16=True, loss_scale=128.0)
    for cfg in (fp32, bf16, constant):  # Megatron's --check-for-nan-in-loss-and-grad: the first one stops
        assert divergence(2.0, OK, 1.0, cfg) is None
        assert divergence(float("nan"), SKIPPED, 1.0, cfg) == "lm loss is nan"
        assert divergence(float("inf"), OK, 1.0, cfg) == "lm loss is inf"
        assert "gradients are not finite" in divergence(2.0, SKIPPED, 1.0, cfg)
    # dynamic fp16: an overflow is normal while the scale can still go down
    assert divergence(2.0, SKIPPED, 4.0, fp16) is None and divergence(float("nan"), SKIPPED, 4.0, fp16) is None
    assert "even at the minimum loss scale 2" in divergence(float("nan"), SKIPPED, 2.0, fp16)
    assert divergence(2.0, OK, 2.0, fp16) is None


def _diverging(rank, world_size, ckpt, extra):
    trainer = build_trainer(BASE + ["--train-iters", "6", "--lr", "1e20", "--save", ckpt, "--save-interval", "1"]
                            + extra)
    with pytest.raises(TrainingDiverged) as err:
        trainer.train()
    return trainer.iteration, str(err.value)


@pytest.mark.slow
@pytest.mark.parametrize("world_size,extra", [(1, []), (1, ["--bf16"]), (2, ["--pipeline-model-parallel-size", "2"]),
                                              (2, ["--tensor-model-parallel-size", "2"]), (2, [])])
def test_nan_loss_stops_every_rank_at_once_and_is_not_saved(tmp_path, world_size, extra):
    ckpt = str(tmp_path / "ckpt")
    results = run_distributed(world_size, _diverging, ckpt, extra)
    assert len({r for r in results}) == 1, results  # the same iteration and message on every rank
    iteration, message = results[0]
    assert iteration >= 2 and message.startswith(f"training diverged at iteration {iteration}: ")
    assert "\n" not in message and f"the last checkpoint is iteration {iteration - 1} in {ckpt}" in message
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as f:
        assert int(f.read()) == iteration - 1
    assert not os.path.exists(os.path.join(ckpt, f"iter_{iteration:07d}"))


@pytest.mark.slow
def test_cli_exits_non_zero_with_the_message(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    out = _cli(BASE + ["--train-iters", "6", "--lr", "1e20", "--save", ckpt])
    assert out.returncode == 1
    found = re.search(r"training diverged at iteration (\d+): lm loss is nan; the diverged model is not saved "
                      r"\(nothing was saved\); try a lower --lr", out.stderr)
    assert found, out.stderr
    assert not os.path.exists(ckpt) or not os.listdir(ckpt)
    lines = iteration_lines(out.stdout)
    assert len(lines) == int(found.group(1)) and " lm loss: " in lines[0]
    assert " lm loss: " not in lines[-1] and "number of nan iterations:   1 |" in lines[-1]


@pytest.mark.slow
def test_fp16_overflows_are_skipped_and_the_loss_omitted():
    out = _cli(BASE + ["--train-iters", "8", "--fp16", "--initial-loss-scale", "16777216", "--hysteresis", "1",
                       "--log-interval", "1"])
    assert out.returncode == 0, out.stderr
    lines = iteration_lines(out.stdout)
    skipped = [ln for ln in lines if "number of skipped iterations:   1 |" in ln]
    assert skipped and all(" lm loss: " not in ln and " grad norm: " not in ln for ln in skipped)
    assert " lm loss: " in lines[-1] and "number of skipped iterations:   0 |" in lines[-1]


@pytest.mark.slow
def test_fp16_persistent_nan_stops_at_the_minimum_scale():
    out = _cli(BASE + ["--train-iters", "20", "--fp16", "--init-method-std", "1e20", "--initial-loss-scale", "8",
                       "--hysteresis", "1", "--log-interval", "1"])
    assert out.returncode == 1
    assert "training diverged at iteration 4: lm loss is nan even at the minimum loss scale 1" in out.stderr
    assert [" loss scale: 4.0 |" in ln for ln in iteration_lines(out.stdout)][:1] == [True]


def test_weights_made_non_finite_by_a_step_stop_the_run_in_every_mode():
    broken = StepResult(True, 1.0, 1.0, weights_finite=False)
    for cfg in (OptimizerConfig(lr=1.0), OptimizerConfig(lr=1.0, fp16=True, min_loss_scale=2.0)):
        assert "made weights inf or nan" in divergence(2.0, broken, 4.0, cfg)


def _fp16_overflow(rank, world_size, ckpt):
    import torch

    from megatron_bmw.training.checkpointing import load_checkpoint, read_tracker

    trainer = build_trainer(BASE + ["--train-iters", "20", "--fp16", "--lr", "1e6", "--save", ckpt,
                                    "--save-interval", "1"])
    with pytest.raises(TrainingDiverged) as err:
        trainer.train()
    saved = read_tracker(ckpt)
    def tensors(x):
        if torch.is_tensor(x):
            yield x
        elif isinstance(x, dict):
            for v in x.values():
                yield from tensors(v)

    weights = load_checkpoint(ckpt, trainer.state)["model"] if saved is not None else {}
    finite = all(bool(torch.isfinite(t.float()).all()) for t in tensors(weights))
    return trainer.iteration, str(err.value), saved, finite


@pytest.mark.slow
def test_fp16_never_saves_a_model_a_step_made_non_finite(tmp_path):
    """--fp16 --lr 1e6: the gradients pass the overflow check, the update overflows the fp16 weights."""
    ckpt = str(tmp_path / "ckpt")
    (iteration, message, saved, finite), = run_distributed(1, _fp16_overflow, ckpt)
    assert "made weights inf or nan" in message and f"the last checkpoint is iteration {iteration - 1}" in message
    assert saved in (None, iteration - 1) and finite
