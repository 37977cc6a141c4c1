"""Megatron-LM's Llama launch script through pretrain_gpt.py: examples/llama/train_llama3_8b_h100_fp8.sh
(NVIDIA/Megatron-LM at d98e8a64dd), its MODEL_ARGS, TRAINING_ARGS, DTYPE_ARGS (fp8), MODEL_PARALLEL_ARGS,
DDP_ARGS, the mock-data DATA_ARGS_LIST and EVAL_AND_LOGGING_ARGS in its order, with sizes shrunk (layers, hidden,
heads, sequence, vocabulary, batch, samples) and the paths made temporary. Nothing else is changed (CHANGED would
list a flag the script cannot pass as it is, and why)."""

import os
import shlex

import pytest

from megatron_bmw.arguments import IGNORED_KERNEL_FLAGS, IGNORED_LOGGING_FLAGS, configs_from_args, parse_args
from megatron_bmw.errors import UsageError
from tests.dist_harness import run_distributed
from tests.training.test_pretrain import _cli, iteration_lines

# The script's arrays, one flag (with its values) a line; TP_SIZE=1, CP_SIZE=1, DTYPE=fp8 as it sets them
SCRIPT = """
--use-mcore-models
--num-layers 2
--hidden-size 64
--ffn-hidden-size 96
--num-attention-heads 4
--group-query-attention
--num-query-groups 2
--kv-channels 16
--seq-length 32
--max-position-embeddings 32
--position-embedding-type rope
--rotary-base 1000000
--rotary-percent 1.0
--attention-dropout 0.0
--hidden-dropout 0.0
--swiglu
--normalization RMSNorm
--init-method-std 0.0134
--attention-backend fused
--apply-layernorm-1p
--untie-embeddings-and-output-weights
--disable-bias-linear
--micro-batch-size 1
--global-batch-size 4
--train-samples 16
--lr-decay-samples 12
--lr-warmup-samples 4
--lr 0.00015
--min-lr 0.00001
--decoupled-lr 5.0e-4
--decoupled-min-lr 4.5e-5
--lr-decay-style cosine
--clip-grad 1.0
--weight-decay 0.1
--adam-beta1 0.9
--adam-beta2 0.95
--bf16
--grad-reduce-in-bf16
--cross-entropy-loss-fusion
--calculate-per-token-loss
--manual-gc
--empty-unused-memory-level 1
--exit-duration-in-mins 235
--use-distributed-optimizer
--overlap-grad-reduce
--overlap-param-gather
--fp8-format hybrid
--fp8-amax-history-len 1024
--fp8-amax-compute-algo max
--fp8-param-gather
--tensor-model-parallel-size 1
--context-parallel-size 1
--sequence-parallel
--mock-data
--tokenizer-type NullTokenizer
--vocab-size 1000
--data-cache-path {cache}
--tiktoken-pattern v2
--split '99,1,0'
--no-create-attention-mask-in-dataloader
--no-mmap-bin-files
--num-workers 1
--log-interval 1
--eval-iters 32
--eval-interval 100
--save-interval 1000
--log-throughput
--profile
--profile-step-start 4
--profile-step-end 6
--ckpt-format torch_dist
--distributed-timeout-minutes 60
--save {ckpt}
--load {ckpt}
--tensorboard-dir {tb}
"""
# flag -> (its line here, why): what the script cannot pass unchanged
CHANGED: dict[str, tuple[str, str]] = {}  # none since --ckpt-format torch_dist is written here
# --calculate-per-token-loss is taken as is: every micro-batch holds micro-batch x seq-length loss tokens (no
# --eod-mask-loss), so the mean over the batch's tokens is the mean of the micro-batch means computed here
IGNORED = ["--use-mcore-models", "--grad-reduce-in-bf16", "--cross-entropy-loss-fusion",
           "--empty-unused-memory-level", "--fp8-format", "--fp8-amax-history-len",
           "--fp8-amax-compute-algo", "--fp8-param-gather",
           "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files", "--num-workers"]
PROFILER = ["--profile", "--profile-step-start", "--profile-step-end"]


def script_argv(tmp, changed=CHANGED) -> list[str]:
    """The script's command line (bash word splitting keeps --split's quotes, as Megatron receives them)."""
    paths = {k: os.path.join(str(tmp), k) for k in ("cache", "ckpt", "tb")}
    argv = []
    for line in SCRIPT.format(**paths).strip().splitlines():
        flag = line.split()[0]
        argv += (changed[flag][0] if flag in changed else line).split()
    return argv


def test_script_flags_parse(tmp_path):
    """Every flag is taken: the model ones reach ModelConfig, kernel and profiler choices are reported as ignored,
    and each changed flag is still refused as the script gives it."""
    args = parse_args(script_argv(tmp_path))
    assert args.ignored_kernel_flags == IGNORED and args.ignored_logging_flags == PROFILER
    assert set(IGNORED) <= set(IGNORED_KERNEL_FLAGS) and set(PROFILER) <= set(IGNORED_LOGGING_FLAGS)
    run = configs_from_args(args, 1)
    m = run.model
    assert (m.position_embedding_type, m.rotary_base, m.swiglu, m.num_query_groups, m.normalization) == \
        ("rope", 1000000, True, 2, "RMSNorm")
    assert m.apply_layernorm_1p and not m.add_bias_linear and m.untie_embeddings_and_output_weights
    assert (m.attention_backend, m.params_dtype, m.head_dim) == ("flash", "bf16", 16)
    assert run.optimizer.use_distributed_optimizer and run.optimizer.overlap_param_gather
    assert run.lr.lr_decay_style == "cosine"
    assert (run.lr.decoupled_lr, run.lr.decoupled_floor) == (5.0e-4, 4.5e-5)
    for flag in CHANGED:
        with pytest.raises(UsageError, match=flag):
            configs_from_args(parse_args(script_argv(tmp_path, {})), 1)
    shlex.split(SCRIPT)  # the text is one bash command line's worth of words


def _script_case(rank, world_size, argv):
    from megatron_bmw.training.pretrain import pretrain

    trainer = pretrain(argv)
    return [h[1] for h in trainer.history], trainer.consumed_train


@pytest.mark.slow
def test_script_trains_through_pretrain_gpt(tmp_path):
    """The shrunk script as pretrain_gpt.py's command line: one line of ignored flags at start-up, four logged
    iterations with finite losses, a checkpoint; then at tp 2 (the script's comment: sequence parallelism with
    TP_SIZE=2) on two ranks from the same flags, the losses of the single-process run."""
    argv = script_argv(tmp_path)
    out = _cli(argv)
    assert out.returncode == 0, out.stderr
    ignored = [ln for ln in out.stdout.splitlines() if ln.startswith("> ignored Megatron flags (kernel")]
    assert ignored == ["> ignored Megatron flags (kernel or implementation choice): " + " ".join(IGNORED)]
    lines = iteration_lines(out.stdout)
    losses = [float(ln.split("lm loss: ")[1].split()[0]) for ln in lines]
    assert len(lines) == 4 and all(0 < x < 20 for x in losses)
    assert "iter_0000004" in os.listdir(tmp_path / "ckpt")
    tp2 = [a if a != "1" or b != "--tensor-model-parallel-size" else "2" for b, a in zip([""] + argv, argv)]
    tp2 = [a.replace(str(tmp_path / "ckpt"), str(tmp_path / "ckpt2")) for a in tp2]
    history, consumed = run_distributed(2, _script_case, tp2)[-1]
    assert consumed == 16 and history == pytest.approx(losses, rel=2e-2)  # bf16
