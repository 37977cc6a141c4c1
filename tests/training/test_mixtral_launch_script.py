"""Megatron-LM's Mixtral launch script through pretrain_gpt.py: examples/mixtral/train_mixtral_8x7b_distributed.sh
(NVIDIA/Megatron-LM at d98e8a64dd), its MODEL_ARGS, MOE_ARGS, DATA_ARGS, TRAINING_ARGS, MODEL_PARALLEL_ARGS and
LOGGING_ARGS in its order, with sizes shrunk (layers, hidden, FFN, heads, query groups, experts, sequence, batch,
iterations and their LR schedule; the pipeline and expert parallel sizes with the world: 1 and 1 on one process, 2
and 2 on four ranks), a SentencePiece model trained here for its Llama2Tokenizer, a dataset tokenized with it, and
the paths made temporary. Nothing else is changed (CHANGED would list a flag the script cannot pass as it is, and
why): its --save without --ckpt-format takes Megatron's default, torch_dist, where experts split over ranks."""

import os
import sys

import pytest

from megatron_bmw.arguments import IGNORED_KERNEL_FLAGS, configs_from_args, parse_args
from tests.data.conftest import load_tool, make_lines, write_jsonl
from tests.dist_harness import run_distributed
from tests.training.test_pretrain import _cli, iteration_lines

SCRIPT = """
--use-mcore-models
--disable-bias-linear
--seq-length 32
--max-position-embeddings 256
--num-layers 4
--hidden-size 64
--ffn-hidden-size 112
--num-attention-heads 4
--init-method-std 0.01
--attention-dropout 0.0
--hidden-dropout 0.0
--normalization RMSNorm
--position-embedding-type rope
--swiglu
--untie-embeddings-and-output-weights
--group-query-attention
--num-query-groups 2
--no-masked-softmax-fusion
--no-position-embedding
--rotary-base 1000000
--num-experts 4
--moe-router-topk 2
--moe-router-load-balancing-type aux_loss
--moe-aux-loss-coeff 1e-2
--moe-grouped-gemm
--moe-token-dispatcher-type alltoall
--overlap-param-gather
--overlap-grad-reduce
--tokenizer-type Llama2Tokenizer
--tokenizer-model {tokenizer}
--data-path {data}
--split 99990,8,2
--micro-batch-size 1
--global-batch-size 8
--lr 1e-4
--train-iters 4
--lr-decay-iters 3
--lr-decay-style cosine
--min-lr 1.0e-5
--weight-decay 0.1
--lr-warmup-iters 1
--clip-grad 1.0
--bf16
--tensor-model-parallel-size 1
--pipeline-model-parallel-size {pp}
--expert-model-parallel-size {ep}
--use-distributed-optimizer
--sequence-parallel
--log-interval 1
--save-interval 10000
--eval-interval 1000
--eval-iters 10
--save {ckpt}
--load {ckpt}
--tensorboard-dir {ckpt}/tensorboard
--no-load-optim
--no-load-rng
"""
CHANGED: dict[str, tuple[str, str]] = {}  # flag -> (its line here, why): none
IGNORED = ["--use-mcore-models", "--no-masked-softmax-fusion"]
VOCAB = 320


def script_argv(tmp, pp=1, ep=1, ckpt="ckpt") -> list[str]:
    paths = dict(tokenizer=os.path.join(str(tmp), "tok.model"), data=os.path.join(str(tmp), "corpus_text_document"),
                 ckpt=os.path.join(str(tmp), ckpt), pp=pp, ep=ep)
    return SCRIPT.format(**paths).split()


def test_script_flags_parse(tmp_path):
    """Every flag is taken: the model and MoE ones reach the configs, kernel choices are reported as ignored."""
    args = parse_args(script_argv(tmp_path, 2, 2))
    assert args.ignored_kernel_flags == IGNORED and set(IGNORED) <= set(IGNORED_KERNEL_FLAGS)
    run = configs_from_args(args, 4, vocab_size=VOCAB)
    m, moe = run.model, run.model.moe
    assert (m.position_embedding_type, m.swiglu, m.num_query_groups, m.normalization, m.add_bias_linear) == \
        ("rope", True, 2, "RMSNorm", False)
    assert (moe.num_experts, moe.router_topk, moe.load_balancing_type, moe.aux_loss_coeff) == (4, 2, "aux_loss", 1e-2)
    assert (moe.token_dispatcher_type, moe.grouped_gemm, m.moe_ffn_hidden_size) == ("alltoall", True, 112)
    assert (run.parallel.expert_model_parallel_size, run.parallel.pipeline_model_parallel_size) == (2, 2)
    assert run.optimizer.use_distributed_optimizer and run.optimizer.overlap_param_gather
    assert run.train.ckpt_format == "torch_dist" and args.notes and "torch_dist" in args.notes[0]
    assert (run.train.load_optim, run.train.load_rng) == (False, False)
    assert configs_from_args(parse_args(script_argv(tmp_path)), 1, vocab_size=VOCAB).train.ckpt_format == "torch"


def _make_data(tmp) -> None:
    """A SentencePiece model (the script's TOKENIZER_MODEL) and a dataset preprocess_data.py tokenized with it."""
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(sentence_iterator=iter(make_lines(300)), model_prefix=str(tmp / "tok"),
                                   vocab_size=VOCAB, model_type="bpe", byte_fallback=True, minloglevel=2)
    src = write_jsonl(tmp / "corpus.jsonl", make_lines(400, seed=3))
    preprocess = sys.modules.get("preprocess_data") or load_tool("preprocess_data")
    assert preprocess.main(["--input", str(src), "--output-prefix", str(tmp / "corpus"), "--tokenizer-type",
                            "Llama2Tokenizer", "--tokenizer-model", str(tmp / "tok.model"), "--append-eod"]) == 0


def _script_case(rank, world_size, argv):
    from megatron_bmw.training.pretrain import pretrain

    trainer = pretrain(argv)
    return [h[1] for h in trainer.history], trainer.aux_history, trainer.consumed_train


@pytest.mark.slow
def test_script_trains_through_pretrain_gpt(tmp_path):
    """The shrunk script as pretrain_gpt.py's command line on one process: one line of ignored flags, four logged
    iterations with lm and load-balancing losses, a checkpoint; then pp 2 x ep 2 (dp 2) on four ranks from the same
    flags: the single process's losses (bf16), and a torch_dist checkpoint."""
    _make_data(tmp_path)
    out = _cli(script_argv(tmp_path), timeout=300)
    assert out.returncode == 0, out.stderr
    ignored = [ln for ln in out.stdout.splitlines() if ln.startswith("> ignored Megatron flags (kernel")]
    assert ignored == ["> ignored Megatron flags (kernel or implementation choice): " + " ".join(IGNORED)]
    lines = iteration_lines(out.stdout)
    assert len(lines) == 4 and all("load_balancing_loss: " in ln for ln in lines)
    losses = [float(ln.split("lm loss: ")[1].split()[0]) for ln in lines]
    assert all(0 < x < 20 for x in losses)
    assert "iter_0000004" in os.listdir(tmp_path / "ckpt")
    history, aux, consumed = run_distributed(4, _script_case, script_argv(tmp_path, 2, 2, "ckpt2"))[-1]
    assert consumed == 32 and history == pytest.approx(losses, rel=2e-2)
    balancing = [float(ln.split("load_balancing_loss: ")[1].split()[0]) for ln in lines]
    assert [a["load_balancing_loss"] for a in aux] == pytest.approx(balancing, rel=2e-2)
    assert os.path.isfile(tmp_path / "ckpt2" / "iter_0000004" / ".metadata")
