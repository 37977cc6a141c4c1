"""Megatron-LM's Llama launch script through pretrain_gpt.py: examples/llama/train_llama3_8b_h100_fp8.sh
(NVIDIA/Megatron-LM at d98e8a64dd), its MODEL_ARGS, TRAINING_ARGS, DTYPE_ARGS (fp8), MODEL_PARALLEL_ARGS,
DDP_ARGS, the mock-data DATA_ARGS_LIST and EVAL_AND_LOGGING_ARGS in its order, with sizes shrunk (layers, hidden,
heads, sequence, vocabulary, batch, samples) and the paths made temporary. Nothing else is changed (CHANGED would
list a flag the script cannot pass as it is, and why)."""

import os
import shlex
import sys

import pytest

from megatron_bmw.arguments import (IGNORED_KERNEL_FLAGS, IGNORED_LOGGING_FLAGS, configs_from_args, parse_args,
                                    run_config_from_argv)
from megatron_bmw.data.builder import build_gpt_datasets
from megatron_bmw.data.tokenizers import TikTokenizer, build_tokenizer
from megatron_bmw.errors import UsageError
from tests.data.conftest import load_tool, make_lines, write_jsonl
from tests.data.tiktoken_vocab import learn_ranks, write_vocab
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
IGNORED = ["--use-mcore-models", "--grad-reduce-in-bf16", "--empty-unused-memory-level", "--fp8-format",
           "--fp8-amax-history-len", "--fp8-amax-compute-algo", "--fp8-param-gather",
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


# The script's real-data DATA_ARGS_LIST (TOKENIZER_ARG and DATA_ARG given) in its order, with the tokenizer of
# Megatron's tiktoken launch scripts (the script itself names HuggingFaceTokenizer there) and --vocab-size shrunk
# like the mock branch's: the TikTokenizer vocabulary is cut to it, as Megatron cuts it
REAL_DATA = """
--data-path {data}
--tokenizer-type TikTokenizer
--tokenizer-model {vocab}
--tiktoken-pattern v2
--tiktoken-num-special-tokens 1000
--data-cache-path {cache}
--split '99,1,0'
--no-create-attention-mask-in-dataloader
--no-mmap-bin-files
--num-workers 1
--vocab-size 1300
"""


def real_data_argv(tmp) -> list[str]:
    """script_argv with its mock DATA_ARGS_LIST replaced by REAL_DATA: a tiktoken vocabulary learned here and a
    dataset tools/preprocess_data.py tokenized with the same tokenizer flags."""
    vocab = write_vocab(tmp / "tokenizer.json", learn_ranks(make_lines(300), 150))
    data = str(tmp / "corpus")
    real = REAL_DATA.format(data=data + "_text_document", vocab=vocab, cache=tmp / "cache").split()
    tokenizer = real[real.index("--tokenizer-type"):real.index("--data-cache-path")] + ["--vocab-size", "1300"]
    src = write_jsonl(tmp / "corpus.jsonl", make_lines(200, seed=5))
    preprocess = sys.modules.get("preprocess_data") or load_tool("preprocess_data")  # one module: workers pickle it
    assert preprocess.main(["--input", str(src), "--output-prefix", data, *tokenizer, "--append-eod"]) == 0
    argv = script_argv(tmp)
    start, end = argv.index("--mock-data"), argv.index("--num-workers") + 2
    return argv[:start] + real + argv[end:]


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
    assert m.cross_entropy_loss_fusion  # honoured: parallel/fused_cross_entropy.py
    assert (m.attention_backend, m.params_dtype, m.head_dim) == ("fused", "bf16", 16)  # fused: cuDNN first
    assert run.optimizer.use_distributed_optimizer and run.optimizer.overlap_param_gather
    assert run.lr.lr_decay_style == "cosine"
    assert (run.lr.decoupled_lr, run.lr.decoupled_floor) == (5.0e-4, 4.5e-5)
    for flag in CHANGED:
        with pytest.raises(UsageError, match=flag):
            configs_from_args(parse_args(script_argv(tmp_path, {})), 1)
    shlex.split(SCRIPT)  # the text is one bash command line's worth of words


def test_real_data_branch_builds_the_tiktokenizer(tmp_path):
    """The real-data branch's flags build Megatron's TikTokenizer (special tokens first, the vocabulary cut to
    --vocab-size, padded for the model) and its data: every id of a sample lies below the cut."""
    parsed = run_config_from_argv(real_data_argv(tmp_path), 1, tokenizer_from=build_tokenizer)
    tok, run = parsed.tokenizer, parsed.run
    assert isinstance(tok, TikTokenizer) and (tok.vocab_size, tok.eod, tok.bos) == (1300, 2, 1)
    assert run.data.tiktoken_pattern == "v2" and run.data.tiktoken_num_special_tokens == 1000
    assert (run.orig_vocab_size, run.model.vocab_size) == (1300, 1408)  # padded to a multiple of 128
    assert parsed.ignored_kernel_flags == ["--use-mcore-models", "--grad-reduce-in-bf16", "--empty-unused-memory-level",
                                           "--fp8-format", "--fp8-amax-history-len", "--fp8-amax-compute-algo",
                                           "--fp8-param-gather",
                                           "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files",
                                           "--num-workers"]
    train, _, _ = build_gpt_datasets(run.data, 32, 1234, (16, 0, 0), check_vocab_size=tok.vocab_size)
    samples = [train[i]["text"] for i in range(4)]
    assert all(len(s) == 33 and 0 <= s.min() and s.max() < 1300 for s in samples)
    assert any(tok.eod in s.tolist() for s in samples)


@pytest.mark.slow
def test_real_data_branch_trains(tmp_path):
    """The real-data branch as pretrain_gpt.py's command line: four iterations on the TikTokenizer-made data."""
    out = _cli(real_data_argv(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "> padded vocab (size: 1300) with 108 dummy tokens (new size: 1408)" in out.stdout
    losses = [float(ln.split("lm loss: ")[1].split()[0]) for ln in iteration_lines(out.stdout)]
    assert len(losses) == 4 and all(0 < x < 20 for x in losses)


def _script_case(rank, world_size, argv):
    from megatron_bmw.training.pretrain import pretrain

    trainer = pretrain(argv)
    return [h[1] for h in trainer.history], trainer.consumed_train


@pytest.mark.slow
def test_script_trains_through_pretrain_gpt(tmp_path):
    """The shrunk script as pretrain_gpt.py's command line: one line of ignored flags at start-up, four logged
    iterations with finite losses, a checkpoint; then at tp 2 (the script's comment: sequence parallelism with
    TP_SIZE=2) and at CP_SIZE=2 on two ranks from the same flags, the losses of the single-process run."""
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
    # CP_SIZE=2, as the script's context-parallel setting, on two ranks: the same losses
    cp2 = [a if a != "1" or b != "--context-parallel-size" else "2" for b, a in zip([""] + argv, argv)]
    cp2 = [a.replace(str(tmp_path / "ckpt"), str(tmp_path / "ckpt3")) for a in cp2]
    history, consumed = run_distributed(2, _script_case, cp2)[-1]
    assert consumed == 16 and history == pytest.approx(losses, rel=2e-2)
