"""Megatron-LM flags real launch scripts use, and flag values refused with one line naming the flag."""

import os
import subprocess
import sys

import pytest

from megatron_bmw.arguments import IGNORED_KERNEL_FLAGS, IGNORED_LOGGING_FLAGS, configs_from_args, parse_args
from megatron_bmw.data.gpt_dataset import parse_split
from megatron_bmw.errors import UsageError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ["--mock-data", "--vocab-size", "100", "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "1", "--make-vocab-size-divisible-by", "4"]


def _run(extra, world=1):
    return configs_from_args(parse_args(BASE + extra), world)


def _refused(extra, needle, world=1):
    with pytest.raises(UsageError) as err:
        _run(extra, world)
    message = str(err.value)
    assert needle in message and "\n" not in message, message
    return message


# ---- refused values (exit 2 through the entry point) -------------------------------------------------------------
@pytest.mark.parametrize("extra,needle", [
    (["--global-batch-size", "0"], "--global-batch-size must be >= 1"),
    (["--save-interval", "0"], "--save-interval must be >= 1"),
    (["--save-interval", "-3"], "--save-interval must be >= 1"),
    (["--eval-iters", "-1"], "--eval-iters must be >= 0"),
    (["--ffn-hidden-size", "0"], "--ffn-hidden-size must be >= 1"),
    (["--hidden-dropout", "1.0"], "--hidden-dropout must be in [0, 1)"),
    (["--hidden-dropout", "-0.1"], "--hidden-dropout must be in [0, 1)"),
    (["--attention-dropout", "1.5"], "--attention-dropout must be in [0, 1)"),
    (["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes must be > 0"),
    (["--distributed-timeout-minutes", "-5"], "--distributed-timeout-minutes must be > 0"),
    (["--recompute-granularity", "full", "--recompute-method", "block"], "--recompute-num-layers is missing"),
    (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "5"],
     "between 1 and 4"),
    (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "0"],
     "--recompute-num-layers must be >= 1"),
    (["--position-embedding-type", "relative"], "--position-embedding-type relative: not supported"),
    (["--decoupled-min-lr", "4.5e-5"], "--decoupled-min-lr needs --decoupled-lr"),
    (["--calculate-per-token-loss", "--eod-mask-loss"], "--calculate-per-token-loss: not supported with --eod"),
    (["--kv-channels", "16"], "--kv-channels 16: only hidden size / heads (8) is supported"),
    (["--group-query-attention", "--num-query-groups", "3"], "--num-query-groups 3 must divide"),
    (["--rotary-percent", "0"], "--rotary-percent must be in (0, 1]"),
    (["--ckpt-format", "fsdp_dtensor"], "--ckpt-format fsdp_dtensor: not supported"),
    (["--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"], "are mutually exclusive"),
    (["--ckpt-convert-format", "torch_dist", "--load", "x"],
     "--ckpt-convert-format torch_dist needs --ckpt-convert-save"),
    (["--ckpt-convert-format", "torch", "--ckpt-convert-save", "y"], "--ckpt-convert-format torch needs --load"),
    (["--ckpt-convert-save", "y"], "--ckpt-convert-save is only used with --ckpt-convert-format"),
    (["--ckpt-format", "zarr"], "--ckpt-format zarr: not supported"),
    (["--ckpt-format", "nope"], "--ckpt-format nope: unknown"),
    (["--train-iters", "5", "--train-samples", "40"], "give --train-iters or --train-samples, not both"),
    (["--train-samples", "0"], "--train-samples must be >= 1"),
    (["--global-batch-size", "8", "--train-samples", "7"], "--train-samples 7 is less than the first global "
                                                            "batch (8)"),
    (["--train-iters", "0"], "--train-iters must be >= 1"),
    # the adversarial probe's (#28): each reached torch, numpy or the loop, or was accepted
    (["--lr", "nan"], "--lr must be a finite number"),
    (["--lr", "1e39"], "--lr must be a finite number within fp32's range"),
    (["--min-lr", "inf"], "--min-lr must be a finite number"),
    (["--rotary-base", "1" + "0" * 20], "--rotary-base must fit a 64-bit integer"),
    (["--train-iters", "1" + "0" * 23], "--train-iters must fit a 64-bit integer"),
    (["--clip-grad", "nan"], "--clip-grad must be a finite number"),
    (["--seed", "-1"], "--seed must be in [0, 2**32)"),
    (["--seed", str(2**32)], "--seed must be in [0, 2**32)"),
    (["--init-method-std", "-1"], "--init-method-std must be > 0"),
    (["--layernorm-epsilon", "-1"], "--layernorm-epsilon must be > 0"),
    (["--exit-interval", "-1"], "--exit-interval must be >= 1"),
    (["--exit-duration-in-mins", "-1"], "--exit-duration-in-mins must be > 0"),
    (["--gpus-per-node", "0"], "--gpus-per-node must be >= 1"),
    (["--vocab-size", "1"], "--vocab-size must be >= 2"),
    (["--split", "-1,2,3"], "--split: weights in '-1,2,3' must be non-negative"),
    (["--split", "1e400,1,1"], "--split: weights in '1e400,1,1' must be finite numbers"),
    (["--lr", "-1e-3"], "--lr must be >= 0"),
    (["--unit-strategies", ""], "--unit-strategies is empty"),
    (["--unit-strategies", " "], "--unit-strategies is empty"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "0"],
     "--recompute-num-layers must be >= 1, got 0"),
    (["--num-layers-per-virtual-pipeline-stage", "0"], "--num-layers-per-virtual-pipeline-stage must be >= 1"),
    # the runtime probe's (session 12): Megatron refuses these; here they ran as something else
    (["--recompute-granularity", "selective", "--recompute-method", "block", "--recompute-num-layers", "1"],
     "--recompute-method and --recompute-num-layers choose the layers of --recompute-granularity full"),
    (["--recompute-activations", "--recompute-method", "uniform"], "--recompute-method chooses the layers"),
    (["--use-flash-attn", "--attention-backend", "local"], "--use-flash-attn (Megatron's older flag for "
                                                            "--attention-backend flash) contradicts"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "3"],
     "--recompute-num-layers 3 with --recompute-method uniform: Megatron's groups of 3 layers"),
])
def test_refused(extra, needle):
    _refused(extra, needle)


def test_recompute_block_counts_layers_per_pipeline_stage():
    pp2 = ["--pipeline-model-parallel-size", "2", "--recompute-granularity", "full", "--recompute-method", "block"]
    _refused(pp2 + ["--recompute-num-layers", "3"], "between 1 and 2 (layers per stage)", world=2)
    run = _run(pp2 + ["--recompute-num-layers", "2"], world=2)
    assert run.pipeline.recompute.count("full") == 8  # every layer's two units
    assert _run(pp2 + ["--recompute-num-layers", "1"], world=2).pipeline.recompute.count("full") == 4


def test_zero_bubble_schedule_flag():
    pp2 = ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4", "--pipeline-schedule", "zb-h1"]
    assert _run(pp2, world=2).pipeline.schedule == "zb-h1"
    _refused(pp2 + ["--num-layers-per-virtual-pipeline-stage", "1"], "--pipeline-schedule zb-h1 cannot interleave",
             world=2)
    _refused(pp2 + ["--bpipe"], "--pipeline-schedule zb-h1 does not combine with --bpipe", world=2)
    full = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
    assert _run(pp2 + full + ["--hidden-dropout", "0.1"], world=2).pipeline.recompute  # with dropout too
    _refused([*pp2, "--micro-batch-size", "2", "--microbatch-slicing", "1"], "zb-h1 does not combine with --microbatch-slicing", world=2)
    _refused(pp2 + ["--unit-strategies", ",".join(["dp2"] * 10)], "zb-h1 does not combine with --unit-strategies",
             world=4)


def test_zb_h2_and_zbv_flags():
    pp2 = ["--pipeline-model-parallel-size", "2", "--global-batch-size", "3"]
    assert _run(pp2 + ["--pipeline-schedule", "zb-h2"], world=2).pipeline.schedule == "zb-h2"
    zbv = pp2 + ["--pipeline-schedule", "zbv"]
    pl = _run(zbv, world=2).pipeline  # two chunks per rank, any number of micro-batches
    assert (pl.virtual_stages, pl.placement, pl.num_microbatches, len(pl.partition)) == (2, "v", 3, 4)
    assert _run(zbv + ["--num-layers-per-virtual-pipeline-stage", "1"], world=2).pipeline.virtual_stages == 2
    assert _run(zbv + ["--virtual-pipeline-model-parallel-size", "2"], world=2).pipeline.virtual_stages == 2
    _refused(zbv + ["--num-layers-per-virtual-pipeline-stage", "2"],
             "--num-layers-per-virtual-pipeline-stage 2: --pipeline-schedule zbv has 2 x", world=2)
    _refused(zbv + ["--virtual-pipeline-model-parallel-size", "3"], "zbv holds 2 model chunks per rank", world=2)
    for name in ("zb-h2", "zbv"):
        flags = pp2[:2] + ["--global-batch-size", "4", "--pipeline-schedule", name]
        _refused(flags + ["--bpipe"], f"--pipeline-schedule {name} does not combine with --bpipe", world=2)
        _refused([*flags, "--micro-batch-size", "2", "--microbatch-slicing", "1"],
                 f"{name} does not combine with --microbatch-slicing", world=2)
        _refused(flags + ["--unit-strategies", ",".join(["dp2"] * 10)],
                 f"{name} does not combine with --unit-strategies", world=4)


def test_interleaved_count_names_flags_that_exist():
    msg = _refused(["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2",
                    "--global-batch-size", "3"], "--global-batch-size 3 gives 3 micro-batches", world=2)
    assert "--num-microbatches" not in msg


# ---- batch ramp-up and step schedules ----------------------------------------------------------------------------
def test_rampup_and_train_samples():
    run = _run(["--global-batch-size", "32", "--rampup-batch-size", "8", "8", "100", "--train-samples", "1000"], 2)
    tr = run.train
    assert tr.train_iters == 36 and tr.train_samples == 1000 and tr.global_batch_size == 32
    assert tr.batch_schedule.sizes() == [8, 16, 24, 32] and run.pipeline.num_microbatches == 16
    assert run.lr.decay_steps == 1000
    # Megatron refuses a ramp with --train-iters (its own 175B example script trips on it); here it runs, the
    # LR schedule measured in iterations of the full batch
    it = _run(["--global-batch-size", "32", "--rampup-batch-size", "8", "8", "100", "--train-iters", "50"], 2)
    assert it.train.train_iters == 50 and it.lr.decay_steps == 50 * 32


def test_step_schedule_sets_the_batch():
    run = _run(["--step-batch-size-schedule", "0:4 160:8", "--train-samples", "100"])  # 160 tokens = 10 samples
    assert run.train.global_batch_size == 8 and run.train.batch_schedule.steps == ((0, 4), (10, 8))
    assert run.train.train_iters == 3 + 11  # 3 x 4 to 12 samples, then 11 x 8
    _refused(["--step-batch-size-schedule", "0:4 160:8", "--global-batch-size", "4"], "differs from the last batch 8")
    assert _run(["--step-batch-size-schedule", "0:4 160:8", "--global-batch-size", "8"]).train.global_batch_size == 8
    _refused(["--step-batch-size-schedule", "0:4", "--rampup-batch-size", "2", "2", "10"], "mutually exclusive")


@pytest.mark.parametrize("extra,needle,world", [
    (["--global-batch-size", "8", "--rampup-batch-size", "3", "5", "100"], "global batch 3 is not divisible", 2),
    (["--rampup-batch-size", "2", "2", "100"], "--rampup-batch-size needs --global-batch-size", 1),
    (["--global-batch-size", "8", "--rampup-batch-size", "2", "2", "10", "--microbatch-slicing", "auto",
      "--micro-batch-size", "2"], "--microbatch-slicing auto", 1),
    (["--global-batch-size", "16", "--rampup-batch-size", "4", "4", "10", "--microbatch-slicing", "4",
      "--micro-batch-size", "2"], "fewer than --microbatch-slicing 4", 1),
    (["--global-batch-size", "8", "--rampup-batch-size", "2", "2", "10", "--plan", "p.json"], "--plan p.json", 1),
    (["--global-batch-size", "8", "--rampup-batch-size", "2", "1", "10", "--pipeline-model-parallel-size", "2",
      "--virtual-pipeline-model-parallel-size", "2"], "global batch 3 gives 3 micro-batches, not a multiple", 2),
    (["--global-batch-size", "8", "--step-batch-size-schedule", "0:3 16:8"], "global batch 3 is not divisible", 2),
])
def test_varying_batch_refusals(extra, needle, world):
    _refused(extra, needle, world)


def test_rampup_with_bpipe_interleaving_allowed_where_counts_fit():
    run = _run(["--global-batch-size", "8", "--rampup-batch-size", "4", "2", "10", "--pipeline-model-parallel-size",
                "2", "--virtual-pipeline-model-parallel-size", "2"], world=2)
    assert run.train.batch_schedule.sizes() == [4, 6, 8]
    assert _run(["--global-batch-size", "8", "--rampup-batch-size", "2", "2", "10", "--pipeline-model-parallel-size",
                 "4", "--bpipe"], world=4).pipeline.bpipe


# ---- aliases and accepted values ---------------------------------------------------------------------------------
def test_aliases_and_accepted_megatron_values():
    run = _run(["--norm-epsilon", "1e-6", "--position-embedding-type", "learned_absolute", "--ckpt-format", "torch"])
    assert run.model.layernorm_epsilon == 1e-6 and run.train.ckpt_format == "torch"
    tr = _run(["--ckpt-format", "torch_dist", "--use-checkpoint-opt_param-scheduler"]).train
    assert tr.ckpt_format == "torch_dist" and tr.use_checkpoint_opt_param_scheduler
    assert _run(["--override-opt_param-scheduler"]).train.override_opt_param_scheduler
    args = parse_args(BASE + ["--log-params-norm", "--log-num-zeros-in-grad", "--log-throughput"])
    tr = configs_from_args(args, 1).train
    assert tr.log_params_norm and tr.log_num_zeros_in_grad and tr.log_throughput
    assert "--log-params-norm" not in IGNORED_LOGGING_FLAGS and "--log-num-zeros-in-grad" not in IGNORED_KERNEL_FLAGS
    # Megatron's attention backends as ours; --context-parallel-size 1; the model flags reach ModelConfig
    assert _run(["--attention-backend", "fused"]).model.attention_backend == "fused"
    assert _run(["--attention-backend", "local"]).model.attention_backend == "unfused"
    m = _run(["--context-parallel-size", "1", "--qk-layernorm", "--apply-layernorm-1p"]).model
    assert m.qk_layernorm and m.apply_layernorm_1p
    # --cross-entropy-loss-fusion is honoured (parallel/fused_cross_entropy.py), off by default as Megatron's
    assert "--cross-entropy-loss-fusion" not in IGNORED_KERNEL_FLAGS
    assert parse_args(BASE + ["--cross-entropy-loss-fusion"]).ignored_flags == []
    assert _run(["--cross-entropy-loss-fusion"]).model.cross_entropy_loss_fusion
    assert not _run([]).model.cross_entropy_loss_fusion


def test_megatrons_older_flags_and_the_warmup_start():
    assert _run(["--use-dist-ckpt"]).train.ckpt_format == "torch_dist"  # deprecated there, still in scripts
    assert parse_args(BASE + ["--check-for-nan-in-loss-and-grad"]).ignored_flags == []  # what the loop always does
    assert _run(["--no-position-embedding"]).model.position_embedding_type == "none"
    rope = _run(["--use-rotary-position-embeddings", "--no-position-embedding"]).model  # Megatron's rope scripts
    assert rope.position_embedding_type == "rope"
    lr = _run(["--lr", "1e-3", "--lr-warmup-iters", "4", "--lr-warmup-init", "1e-4", "--global-batch-size", "1",
               "--train-iters", "10"]).lr
    assert lr.warmup_init == 1e-4
    from megatron_bmw.training.lr_scheduler import LRScheduler

    sched = LRScheduler(None, lr)
    seen = [sched.get_lr()]
    for _ in range(4):
        sched.step(1)
        seen.append(sched.get_lr())
    assert seen == pytest.approx([1e-4, 3.25e-4, 5.5e-4, 7.75e-4, 1e-3])  # Megatron's init + (max - init) n / warmup
    _refused(["--lr", "1e-3", "--lr-warmup-init", "-1"], "--lr-warmup-init must be >= 0")


@pytest.mark.parametrize("text", ["949,50,1", "'949,50,1'", '"949,50,1"', "949/50/1", "'949/50/1'", "949, 50, 1"])
def test_split_as_megatron_reads_it(text):
    split = _run(["--split", text]).data.split
    assert parse_split(split) == pytest.approx([0.949, 0.05, 0.001])


def test_ignored_flags_are_split_by_kind():
    args = parse_args(BASE + ["--no-masked-softmax-fusion", "--transformer-impl", "local", "--log-timers-to-tensorboard",
                              "--tensorboard-queue-size", "5", "--data-impl", "mmap"])
    assert args.ignored_kernel_flags == ["--no-masked-softmax-fusion", "--transformer-impl", "--data-impl"]
    assert args.ignored_logging_flags == ["--log-timers-to-tensorboard", "--tensorboard-queue-size"]
    assert args.ignored_flags == ["--no-masked-softmax-fusion", "--transformer-impl", "--log-timers-to-tensorboard",
                                  "--tensorboard-queue-size", "--data-impl"]
    assert not set(IGNORED_KERNEL_FLAGS) & set(IGNORED_LOGGING_FLAGS)
    # flags of Megatron-LM's Llama example scripts: FP8 recipes, W&B (--no-rope-fusion is honoured: below)
    args = parse_args(BASE + ["--no-rope-fusion", "--fp8-format", "hybrid", "--num-layers-at-start-in-bf16", "1",
                              "--wandb-project", "p", "--wandb-exp-name=x"])
    assert args.ignored_kernel_flags == ["--fp8-format", "--num-layers-at-start-in-bf16"]
    assert args.ignored_logging_flags == ["--wandb-project", "--wandb-exp-name"]
    # how torch_dist checkpoints are written, fp16 attention scaling, p2p and embedding-gradient scheduling
    args = parse_args(BASE + ["--ckpt-fully-parallel-save", "--async-save", "--apply-query-key-layer-scaling",
                              "--overlap-p2p-communication", "--defer-embedding-wgrad-compute",
                              "--log-world-size-to-tensorboard"])
    assert args.ignored_kernel_flags == ["--ckpt-fully-parallel-save", "--async-save",
                                         "--apply-query-key-layer-scaling", "--overlap-p2p-communication",
                                         "--defer-embedding-wgrad-compute"]
    assert args.ignored_logging_flags == ["--log-world-size-to-tensorboard"]


def test_train_iters_defaults_to_10():
    assert _run([]).train.train_iters == 10


@pytest.mark.slow
@pytest.mark.parametrize("extra,needle", [
    (["--global-batch-size", "0"], "error: --global-batch-size must be >= 1, got 0"),
    (["--save-interval", "0"], "error: --save-interval must be >= 1, got 0"),
    (["--hidden-dropout", "1"], "error: --hidden-dropout must be in [0, 1), got 1.0"),
    (["--position-embedding-type", "relative"], "error: --position-embedding-type relative: not supported"),
    (["--rampup-batch-size", "2", "2"], "error: argument --rampup-batch-size: expected 3 arguments"),
    (["--lr", "nan"], "error: --lr must be a finite number within fp32's range, got nan"),
    (["--split", "-1,2,3"], "error: --split: weights in '-1,2,3' must be non-negative with a positive sum"),
])
def test_cli_one_line_exit_2(extra, needle):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *BASE, "--train-iters", "2", *extra],
                         capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith(needle), out.stderr


def test_swiglu_ffn_default_is_megatrons():
    """Without --ffn-hidden-size, SwiGLU's FFN is 8h/3 rounded down to a multiple of 64, as Megatron sets it."""
    assert _run(["--hidden-size", "512", "--num-attention-heads", "8", "--swiglu"]).model.ffn_hidden_size == 1344
    assert _run(["--hidden-size", "512", "--num-attention-heads", "8"]).model.ffn_hidden_size == 2048
    _refused(["--hidden-size", "16", "--swiglu"], "give --ffn-hidden-size")


def test_swiglu_and_rope_fusion_flags_are_megatrons():
    """SwiGLU and rope run fused unless --no-bias-swiglu-fusion / --no-rope-fusion (Megatron's defaults and flags)."""
    on = _run(["--swiglu", "--position-embedding-type", "rope"]).model
    assert on.bias_swiglu_fusion and on.apply_rope_fusion
    off = _run(["--swiglu", "--position-embedding-type", "rope", "--no-bias-swiglu-fusion", "--no-rope-fusion"]).model
    assert not off.bias_swiglu_fusion and not off.apply_rope_fusion
    assert parse_args(BASE + ["--no-rope-fusion", "--no-bias-swiglu-fusion"]).ignored_kernel_flags == []
