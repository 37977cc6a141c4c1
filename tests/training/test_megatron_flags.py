"""Megatron-LM's training flags end to end: batch ramp-up, sample-based training, the logged statistics,
validation position across a resume, and flag sets shaped like Megatron-LM's example scripts."""

import math
import os
import re

import pytest

from megatron_bmw.config import BatchSchedule, ModelConfig
from megatron_bmw.training.logging import gpt_train_flops, num_zeros_in_grad, params_norm
from megatron_bmw.training.loop import build_trainer, count_parameters
from tests.dist_harness import run_distributed
from tests.training.test_pretrain import _cli, iteration_lines

MODEL = ["--mock-data", "--vocab-size", "100", "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads",
         "4", "--seq-length", "16", "--make-vocab-size-divisible-by", "4", "--attention-backend", "unfused",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "1e-3", "--eval-iters", "0"]
RAMP = MODEL + ["--micro-batch-size", "1", "--global-batch-size", "8", "--rampup-batch-size", "2", "2", "16",
                "--train-samples", "60", "--log-interval", "100"]
FIELD = r"{}: +([\d.E+-]+) \|"


def _field(line, name):
    m = re.search(FIELD.format(re.escape(name)), line)
    return None if m is None else float(m.group(1))


def _ramp_case(rank, world_size, extra):
    trainer = build_trainer(RAMP + extra)
    trainer.train()
    return trainer.history, trainer.consumed_train, sorted(trainer.pipelines)


@pytest.mark.slow
def test_rampup_runs_every_layout_alike():
    """The batch grows 2, 4, 6, 8 (one schedule per micro-batch count); every layout gives the serial losses."""
    serial, consumed, counts = run_distributed(1, _ramp_case, [])[0]
    assert len(serial) == BatchSchedule(8, rampup=(2, 2, 16)).iterations(60) == 11 and consumed == 60
    assert counts == [2, 4, 6, 8]
    layouts = {
        "dp2": (2, []),
        "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
        "interleaved": (2, ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2"]),
        "pp4-bpipe": (4, ["--pipeline-model-parallel-size", "4", "--bpipe"]),
        "pp2-sliced": (2, ["--pipeline-model-parallel-size", "2", "--micro-batch-size", "2", "--microbatch-slicing",
                           "1"]),
    }
    for name, (world, extra) in layouts.items():
        history, consumed, _ = run_distributed(world, _ramp_case, extra)[-1]
        assert consumed == 60, name
        assert [h[1] for h in history] == pytest.approx([h[1] for h in serial], rel=1e-5), name


def _steps_case(rank, world_size, extra):
    trainer = build_trainer(MODEL + ["--micro-batch-size", "1", "--step-batch-size-schedule", "0:2 64:4",
                                     "--train-samples", "20", "--log-interval", "100"] + extra)
    trainer.train()
    return [h[1] for h in trainer.history], trainer.consumed_train, trainer.run.train.train_iters


@pytest.mark.slow
def test_step_batch_size_schedule_runs():
    """64 tokens = 4 samples at --seq-length 16: batches 2, 2, then 4 until 20 samples."""
    losses, consumed, iters = run_distributed(1, _steps_case, [])[0]
    assert (len(losses), consumed, iters) == (6, 20, 6)
    pp2 = run_distributed(2, _steps_case, ["--pipeline-model-parallel-size", "2"])[-1]
    assert pp2[0] == pytest.approx(losses, rel=1e-5) and pp2[1:] == (20, 6)


@pytest.mark.slow
def test_rampup_log_lines_and_consumed_samples():
    out = _cli(RAMP + ["--log-interval", "1", "--log-throughput"])
    assert out.returncode == 0, out.stderr
    lines = iteration_lines(out.stdout)
    batches = [int(_field(ln, "global batch size")) for ln in lines]
    consumed = [int(_field(ln, "consumed samples")) for ln in lines]
    # Megatron: +2 every 16/3 samples consumed: 2 x 3 (to 6), 4 (to 10), 4 (14), 6 (20), then 8 (ramp over)
    assert batches == [2, 2, 2, 4, 4, 6, 8, 8, 8, 8, 8]
    assert consumed == [sum(batches[:i + 1]) for i in range(len(batches))]
    assert all(_field(ln, "throughput per GPU (TFLOP/s/GPU)") is not None for ln in lines)
    assert lines[0].startswith(" iteration        1/      11 |")


def _resume_ramp(rank, world_size, ckpt, extra):
    full = build_trainer(RAMP + extra)
    full.train()
    first = build_trainer(RAMP + extra + ["--save", ckpt, "--exit-interval", "4"])
    first.train()
    second = build_trainer(RAMP + extra + ["--save", ckpt, "--load", ckpt])
    second.train()
    return full.history, first.history + second.history, second.consumed_train, second.scheduler.num_steps


@pytest.mark.slow
@pytest.mark.parametrize("world_size,extra", [(1, []), (2, ["--pipeline-model-parallel-size", "2"])])
def test_resume_inside_the_ramp_is_exact(tmp_path, world_size, extra):
    full, resumed, consumed, lr_steps = run_distributed(world_size, _resume_ramp, str(tmp_path / "c"), extra)[-1]
    assert [h[0] for h in resumed] == list(range(1, 12))
    assert [h[1] for h in resumed] == [h[1] for h in full]
    assert consumed == lr_steps == 60  # the LR schedule counted every consumed sample


def _validation_lines(stdout):
    return [ln.strip() for ln in stdout.splitlines() if ln.strip().startswith("validation loss at iteration")
            and "test set" not in ln]


@pytest.mark.slow
def test_validation_after_resume_equals_the_uninterrupted_run(tmp_path):
    """consumed_valid_samples is in the checkpoint: validation continues where it was, as in Megatron."""
    ckpt = str(tmp_path / "ckpt")
    flags = MODEL + ["--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "6", "--eval-interval",
                     "2", "--eval-iters", "2", "--log-interval", "1", "--hidden-dropout", "0.1"]
    full = _cli(flags)
    first = _cli(flags + ["--save", ckpt, "--exit-interval", "3"])
    second = _cli(flags + ["--save", ckpt, "--load", ckpt])
    assert full.returncode == first.returncode == second.returncode == 0, second.stderr
    expected = _validation_lines(full.stdout)
    assert len(expected) == 4 and len(set(expected)) == 4  # at 2, 4, 6 and after training (Megatron's)
    assert expected[-1].startswith("validation loss at iteration 6 on validation set |")
    assert _validation_lines(first.stdout) + _validation_lines(second.stdout) == expected


def _norms_case(rank, world_size, extra):
    trainer = build_trainer(MODEL + ["--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "2",
                                     "--vocab-size", "128"] + extra)
    trainer.train()
    trainer.grad_sync.zero()
    trainer.train_step()  # leaves this step's gradients in place
    norm = params_norm(trainer.named_params, trainer.state)
    zeros = num_zeros_in_grad(trainer.named_params, trainer.state)
    trainer.grad_sync.zero()
    return norm, zeros, num_zeros_in_grad(trainer.named_params, trainer.state), count_parameters(trainer)


@pytest.mark.slow
@pytest.mark.parametrize("untie", [False, True])
def test_params_norm_and_num_zeros_count_each_parameter_once(untie):
    """Summed over tensor- and pipeline-parallel ranks, each shared or replicated parameter once: all-zero gradients
    count every parameter of the serial model; the norm is the serial one."""
    extra = ["--untie-embeddings-and-output-weights"] if untie else []
    norm, zeros, all_zero, total = run_distributed(1, _norms_case, extra)[0]
    assert all_zero == total
    if untie:
        assert zeros >= 32  # word-embedding rows of tokens the batch does not hold
    for world, layout in ((2, ["--tensor-model-parallel-size", "2"]), (2, ["--pipeline-model-parallel-size", "2"]),
                          (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"])):
        for n, z, az, _ in run_distributed(world, _norms_case, extra + layout):  # every rank holds the global values
            assert n == pytest.approx(norm, rel=1e-6) and az == total, (layout, n, az)
            # the key bias's gradient is zero only in exact arithmetic (softmax ignores a shift of every key), so
            # which of its 4 x 32 entries round to exactly 0 depends on the layout
            assert abs(z - zeros) <= 4 * 32, (layout, z, zeros)


@pytest.mark.slow
def test_log_line_fields_in_megatrons_order():
    out = _cli(MODEL + ["--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "2",
                        "--log-interval", "1", "--log-throughput", "--log-params-norm", "--log-num-zeros-in-grad"])
    assert out.returncode == 0, out.stderr
    line = iteration_lines(out.stdout)[-1]
    names = ["consumed samples", "elapsed time per iteration (ms)", "throughput per GPU (TFLOP/s/GPU)",
             "learning rate", "global batch size", "lm loss", "loss scale", "grad norm", "num zeros", "params norm",
             "number of skipped iterations", "number of nan iterations"]
    positions = [line.index(f" {n}: ") for n in names]
    assert positions == sorted(positions), line
    raw = [ln for ln in out.stdout.splitlines() if "] iteration" in ln][-1]
    assert re.match(r"^ \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] iteration +2/ +2 \|", raw), raw


def test_gpt_flops_formula():
    """Megatron's GPT count equals 3x the forward multiply-adds: QKV, causal QK^T and AV, projection, MLP, logits."""
    m = ModelConfig(num_layers=96, hidden_size=12288, num_attention_heads=96, vocab_size=51200, seq_length=2048)
    b, s, h, L, f, v = 1536, 2048, 12288, 96, 4 * 12288, 51200
    forward = L * (2 * b * s * 3 * h * h + 2 * b * s * s * h / 2 * 2 + 2 * b * s * h * h + 4 * b * s * h * f) \
        + 2 * b * s * h * v
    assert gpt_train_flops(m, b) == pytest.approx(3 * forward, rel=1e-12)
    assert math.isclose(gpt_train_flops(m, 1) * 1536, gpt_train_flops(m, 1536))


# ---- flag sets shaped like Megatron-LM's example scripts (sizes and paths shrunk, --mock-data) ---------------------
def _script_case(rank, world_size, argv):
    from megatron_bmw.training.pretrain import pretrain

    trainer = pretrain(argv)
    return trainer.iteration, trainer.consumed_train, len(trainer.history)


@pytest.mark.slow
def test_gpt3_175b_example_flags_run(tmp_path):
    """examples/gpt3/train_gpt3_175b_distributed.sh: TP x PP, fp16 (its first steps skipped by the loss scaler,
    which must not stop the run), a batch ramp-up with --train-iters, --save and --load the same directory."""
    ckpt, tb = str(tmp_path / "ckpt"), str(tmp_path / "tb")
    argv = [
        "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--attention-backend", "auto",
        "--micro-batch-size", "1", "--global-batch-size", "8", "--rampup-batch-size", "2", "2", "16",
        "--train-iters", "6", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
        "--init-method-std", "0.006", "--clip-grad", "1.0", "--fp16", "--lr", "6.0e-5", "--lr-decay-style", "cosine",
        "--min-lr", "6.0e-6", "--lr-warmup-fraction", ".001", "--lr-decay-iters", "5",
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--mock-data", "--vocab-size", "100", "--split", "949,50,1",
        "--log-interval", "1", "--save-interval", "3", "--eval-interval", "3", "--save", ckpt, "--load", ckpt,
        "--eval-iters", "1", "--tensorboard-dir", tb,
    ]
    iteration, consumed, steps = run_distributed(4, _script_case, argv)[-1]
    assert (iteration, steps) == (6, 6) and consumed == 2 + 2 + 2 + 4 + 4 + 6
    assert sorted(os.listdir(ckpt)) == ["iter_0000003", "iter_0000006", "latest_checkpointed_iteration.txt"]
    iteration, consumed, steps = run_distributed(4, _script_case, [a if a != "6" else "8" for a in argv])[-1]
    assert (iteration, steps) == (8, 2) and consumed == 20 + 8 + 8  # resumed at 6, the ramp over


@pytest.mark.slow
def test_pretrain_gpt_example_flags_run(tmp_path):
    """examples/pretrain_gpt.sh (345M): --data-impl mmap, warm-up fraction, cosine decay, fp16."""
    ckpt = str(tmp_path / "ckpt")
    argv = [
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--micro-batch-size", "4", "--global-batch-size", "8",
        "--lr", "0.00015", "--train-iters", "4", "--lr-decay-iters", "3", "--lr-decay-style", "cosine",
        "--min-lr", "1.0e-5", "--weight-decay", "1e-2", "--lr-warmup-fraction", ".01", "--clip-grad", "1.0",
        "--fp16", "--mock-data", "--vocab-size", "100", "--data-impl", "mmap", "--split", "949,50,1",
        "--log-interval", "1", "--save-interval", "2", "--eval-interval", "2", "--eval-iters", "1",
        "--save", ckpt, "--load", ckpt,
    ]
    assert run_distributed(2, _script_case, argv)[-1] == (4, 32, 4)
    assert os.path.isdir(os.path.join(ckpt, "iter_0000004"))


def test_llama_flops_formula():
    """With query groups and SwiGLU: the K and V projections shrink to g/n of Q's, the MLP has three matrices."""
    m = ModelConfig(num_layers=32, hidden_size=4096, num_attention_heads=32, vocab_size=128256, seq_length=8192,
                    ffn_hidden_size=14336, num_query_groups=8, swiglu=True, position_embedding_type="rope")
    b, s, h, L, f, v, g, n = 1, 8192, 4096, 32, 14336, 128256, 8, 32
    forward = L * (2 * b * s * (h + 2 * h * g / n) * h + 2 * b * s * s * h / 2 * 2 + 2 * b * s * h * h
                   + 2 * b * s * h * 3 * f) + 2 * b * s * h * v
    assert gpt_train_flops(m, b) == pytest.approx(3 * forward, rel=1e-12)
