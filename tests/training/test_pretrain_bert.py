"""pretrain_bert end to end: Megatron-LM's BERT example flag sets on text preprocessed here (WordPiece vocabulary
trained locally, --split-sentences), the Megatron log line with lm loss and sop loss, exact resume, layouts and
ZeRO-1 agreeing with the serial run, bad input."""

import json
import os
import random
import re
import subprocess
import sys

import pytest

from megatron_bmw.training.loop import build_trainer
from tests.dist_harness import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOG_RE = re.compile(
    r" iteration\s+(\d+)/\s*(\d+) \| consumed samples:\s+(\d+) \| elapsed time per iteration \(ms\): [\d.]+ \| "
    r"learning rate: [\d.E+-]+ \| global batch size:\s+\d+ \| (?:lm loss: ([\d.E+-]+) \| )?(?:sop loss: ([\d.E+-]+) \| )?"
    r"loss scale: [\d.]+ \| (?:grad norm: [\d.]+ \| )?number of skipped iterations:\s+\d+ \| number of nan iterations:\s+\d+ \|")
MOCK = ["--mock-data", "--vocab-size", "96", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3",
        "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1", "--make-vocab-size-divisible-by", "4",
        "--attention-backend", "unfused"]

SUBJECTS = ["the king", "a servant", "the queen", "my lord", "the old man", "her brother", "the fool", "a soldier"]
VERBS = ["speaks to", "waits for", "follows", "loves", "fears", "forgives", "calls", "remembers"]
PLACES = ["in the castle", "at the gate", "by the river", "in the forest", "at night", "before dawn"]


def _corpus(path, docs=80, seed=0):
    """Documents of simple English sentences (one JSON line each): learnable words and a sentence order."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(docs):
            sentences = []
            for _ in range(rng.randrange(4, 12)):
                s = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(SUBJECTS)} {rng.choice(PLACES)}"
                sentences.append(s[0].upper() + s[1:] + rng.choice([".", "!", "?"]))
            f.write(json.dumps({"text": " ".join(sentences)}) + "\n")


def _tool(name, *args):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", name), *args], capture_output=True, text=True,
                         timeout=180, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr
    return out


@pytest.fixture(scope="module")
def bert_data(tmp_path_factory):
    """(vocab.txt, sentence-level data prefix) made by tools/train_wordpiece.py and tools/preprocess_data.py."""
    d = tmp_path_factory.mktemp("bert_data")
    _corpus(d / "corpus.jsonl")
    _tool("train_wordpiece.py", "--input", str(d / "corpus.jsonl"), "--output", str(d / "vocab.txt"),
          "--vocab-size", "120")
    _tool("preprocess_data.py", "--input", str(d / "corpus.jsonl"), "--output-prefix", str(d / "corpus"),
          "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", str(d / "vocab.txt"), "--split-sentences")
    return str(d / "vocab.txt"), str(d / "corpus_text_sentence")


def _cli(args, timeout=240):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    return subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_bert.py"), *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT)


def _shrunk_pretrain_bert_sh(vocab, data, ckpt):
    """Megatron-LM's examples/pretrain_bert.sh, sizes and paths shrunk (24 -> 2 layers, 1024 -> 32 hidden, 512 ->
    64 positions, 2M -> 30 iterations, intervals); everything else as it is, --data-impl mmap and --fp16 included."""
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--micro-batch-size", "4",
            "--global-batch-size", "8", "--seq-length", "64", "--max-position-embeddings", "64", "--train-iters", "30",
            "--lr-decay-iters", "20", "--save", ckpt, "--load", ckpt, "--data-path", data, "--vocab-file", vocab,
            "--data-impl", "mmap", "--split", "949,50,1", "--lr", "0.0001", "--min-lr", "0.00001",
            "--lr-decay-style", "linear", "--lr-warmup-fraction", ".01", "--weight-decay", "1e-2", "--clip-grad", "1.0",
            "--log-interval", "10", "--save-interval", "20", "--eval-interval", "20", "--eval-iters", "2", "--fp16"]


@pytest.mark.slow
def test_megatron_pretrain_bert_sh_on_real_text(bert_data, tmp_path):
    vocab, data = bert_data
    out = _cli(_shrunk_pretrain_bert_sh(vocab, data, str(tmp_path / "ckpt")))
    assert out.returncode == 0, out.stderr
    lines = [LOG_RE.search(ln) for ln in out.stdout.splitlines() if "] iteration" in ln]
    assert len(lines) == 3 and all(lines), out.stdout[-2000:]
    # fp16 starts at a loss scale of 2^32: early intervals may be all skipped steps, which omit the losses
    last = lines[-1]
    assert 0 < float(last.group(4)) < 6 and 0 < float(last.group(5)) < 1.5, last.group(0)
    assert "validation loss at iteration 20 | lm loss value:" in out.stdout and "| sop loss value:" in out.stdout
    assert "ignored Megatron flags (kernel or implementation choice): --data-impl" in out.stdout
    assert "padded vocab (size: 122)" in out.stdout  # 120 pieces + [BOS] + [EOS], as Megatron's BERT tokenizer
    assert os.path.isfile(tmp_path / "ckpt" / "iter_0000030" / "mp_rank_00" / "model_optim_rng.pt")


def _learn_case(rank, world_size, vocab, data):
    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--micro-batch-size", "8", "--global-batch-size", "16", "--train-iters", "50", "--lr", "3e-3",
            "--lr-warmup-iters", "5", "--data-path", data, "--vocab-file", vocab, "--split", "949,50,1",
            "--log-interval", "1000", "--eval-interval", "1000", "--eval-iters", "0", "--hidden-dropout", "0",
            "--attention-dropout", "0"]
    return _train(rank, world_size, argv, vocab)


@pytest.mark.slow
def test_bert_loss_falls_on_real_text(bert_data):
    vocab, data = bert_data
    history = run_distributed(1, _learn_case, vocab, data)[0]
    losses = [h[1] for h in history]
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, losses


def _train(rank, world_size, argv, tokenizer_vocab=None):
    tokenizer = None
    if tokenizer_vocab is not None:
        from megatron_bmw.data.tokenizers import BertWordPieceTokenizer

        tokenizer = BertWordPieceTokenizer(tokenizer_vocab, lower_case=True)
    trainer = build_trainer(argv, tokenizer, model_type="bert")
    trainer.train()
    trainer.finish()
    return trainer.history


def _megatron_340m_case(rank, world_size, vocab, data, ckpt, tb):
    """examples/bert/train_bert_340m_distributed.sh shrunk: 24 -> 2 layers, tp 8 x pp 16 -> tp 2 x pp 2."""
    from megatron_bmw.training.pretrain import pretrain

    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "64",
            "--max-position-embeddings", "64", "--attention-backend", "auto", "--micro-batch-size", "2",
            "--global-batch-size", "8", "--train-iters", "6", "--weight-decay", "1e-2", "--clip-grad", "1.0", "--fp16",
            "--lr", "0.0001", "--lr-decay-iters", "6", "--lr-decay-style", "linear", "--min-lr", "1.0e-5",
            "--weight-decay", "1e-2", "--lr-warmup-fraction", ".01", "--clip-grad", "1.0",
            "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
            "--data-path", data, "--vocab-file", vocab, "--split", "949,50,1",
            "--log-interval", "2", "--save-interval", "3", "--eval-interval", "3", "--save", ckpt, "--load", ckpt,
            "--eval-iters", "1", "--tensorboard-dir", tb, "--make-vocab-size-divisible-by", "8"]
    trainer = pretrain(argv, "bert")
    return [h[1] for h in trainer.history]


@pytest.mark.slow
def test_megatron_bert_340m_flags_on_tp2_pp2(bert_data, tmp_path):
    vocab, data = bert_data
    out = run_distributed(4, _megatron_340m_case, vocab, data, str(tmp_path / "ckpt"), str(tmp_path / "tb"))
    losses = out[-1]
    assert len(losses) == 6 and all(x == x and x > 0 for x in losses)
    assert os.path.isfile(tmp_path / "ckpt" / "iter_0000006" / "mp_rank_01_001" / "model_optim_rng.pt")
    assert any(n.startswith("events.out.tfevents") for n in os.listdir(tmp_path / "tb"))


def _resume_case(rank, world_size, layout, ckpt):
    argv = MOCK + layout + ["--train-iters", "6", "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    full = _train(rank, world_size, argv)
    first = _train(rank, world_size, argv + ["--save", ckpt, "--exit-interval", "3"])
    second = _train(rank, world_size, argv + ["--save", ckpt, "--load", ckpt])
    return full, first, second


@pytest.mark.slow
@pytest.mark.parametrize("world_size,layout", [(1, []), (2, ["--pipeline-model-parallel-size", "2"])])
def test_bert_resume_is_exact(tmp_path, world_size, layout):
    full, first, second = run_distributed(world_size, _resume_case, layout, str(tmp_path / "ckpt"))[-1]
    assert [h[0] for h in first] == [1, 2, 3] and [h[0] for h in second] == [4, 5, 6]
    assert [h[1] for h in first + second] == [h[1] for h in full]


def _layouts_case(rank, world_size, extra):
    return _train(rank, world_size, MOCK + ["--train-iters", "3", "--hidden-dropout", "0", "--attention-dropout", "0",
                                            "--vocab-size", "96"] + extra)


@pytest.mark.slow
def test_bert_layouts_and_zero1_agree_with_serial():
    serial = run_distributed(1, _layouts_case, [])[0]
    runs = {
        "tp2-sp": run_distributed(2, _layouts_case, ["--tensor-model-parallel-size", "2", "--sequence-parallel"])[-1],
        "pp2-sub-layer": run_distributed(2, _layouts_case, ["--pipeline-model-parallel-size", "2",
                                                            "--pipeline-partition", "2,4"])[-1],
        "dp2-zero1": run_distributed(2, _layouts_case, ["--use-distributed-optimizer"])[-1],
    }
    for name, hist in runs.items():
        for (it, loss, norm), (_, ref_loss, ref_norm) in zip(hist, serial):
            assert loss == pytest.approx(ref_loss, rel=1e-5), (name, it)
            assert norm == pytest.approx(ref_norm, rel=1e-4), (name, it)


@pytest.mark.slow
def test_bert_cli_no_binary_head_logs_lm_loss_only():
    out = _cli(MOCK + ["--train-iters", "2", "--bert-no-binary-head"])
    assert out.returncode == 0, out.stderr
    lines = [LOG_RE.search(ln) for ln in out.stdout.splitlines() if "] iteration" in ln]
    assert len(lines) == 2 and all(m and m.group(5) is None for m in lines)


@pytest.mark.slow
def test_bert_bad_input_one_line_exit_2():
    out = _cli(MOCK + ["--train-iters", "2", "--mask-prob", "1.5"])
    assert out.returncode == 2, out.stderr
    err = out.stderr.strip().splitlines()
    assert len(err) == 1 and err == ["error: --mask-prob must be in (0, 1), got 1.5"], err


def _refused(rank, world_size, cases):
    from megatron_bmw.errors import UsageError

    for args, needle in cases:
        with pytest.raises(UsageError, match=re.escape(needle)):
            build_trainer(MOCK + ["--train-iters", "2"] + args, model_type="bert")
    return True


@pytest.mark.slow
def test_bert_bad_input_refused():
    cases = [(["--short-seq-prob", "-0.1"], "--short-seq-prob must be in [0, 1]"),
             (["--seq-length", "4", "--max-position-embeddings", "4"], "--seq-length 4: a BERT sample needs"),
             (["--vocab-size", "6"], "--vocab-size 6: BERT mock data needs at least 8"),
             (["--seq-length", "9", "--max-position-embeddings", "9"],  # 0.15 x 6 tokens: nothing to learn from
              "--seq-length 9 with --mask-prob 0.15: the longest sample (6 tokens) may mask 0.90 tokens"),
             (["--masking-max-ngram", "0"], "--masking-max-ngram must be >= 1")]
    assert run_distributed(1, _refused, cases) == [True]
