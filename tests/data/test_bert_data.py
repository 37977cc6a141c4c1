"""BERT data: the WordPiece tokenizers against transformers' BertTokenizer, the WordPiece trainer, the sentence
splitter and preprocess --split-sentences, and BERT sample building (Megatron's rules, seeded per sample)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron_bmw.config import DataConfig
from megatron_bmw.data.bert_dataset import (BertDataset, BertSampleConfig, BertVocab, MockBertDataset,
                                            build_sample_index)
from megatron_bmw.data.builder import build_bert_datasets
from megatron_bmw.data.indexed_dataset import IndexedDataset
from megatron_bmw.data.sentences import split_sentences
from megatron_bmw.data.tokenizers import BertWordPieceTokenizer, build_tokenizer
from megatron_bmw.data.wordpiece import basic_tokenize, train_vocab
from megatron_bmw.errors import UsageError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEXTS = [
    "To be, or not to be: that is the question. Whether 'tis nobler in the mind to suffer!",
    "Héllo, Wörld! Café naïve — “quoted” it's 3.14 and 東京 tab\tend\x00.  ÀÉÎ resumé?",
    "The slings and arrows of outrageous fortune; or to take arms against a sea of troubles.",
    "Unbelievably, the uncharacteristically long antidisestablishmentarianism word appears.",
]


@pytest.fixture(scope="module")
def vocab_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("wp") / "vocab.txt"
    vocab = train_vocab(TEXTS * 3, 180, lower_case=True, min_frequency=1)
    path.write_text("\n".join(vocab) + "\n", encoding="utf-8")
    return str(path)


def test_train_vocab_starts_with_specials_and_covers_the_corpus(vocab_file):
    vocab = open(vocab_file, encoding="utf-8").read().split("\n")[:-1]
    assert vocab[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] and len(vocab) == 180
    assert len(set(vocab)) == len(vocab)
    tok = BertWordPieceTokenizer(vocab_file, lower_case=True)
    for text in TEXTS:
        assert tok.vocab["[UNK]"] not in tok.tokenize(text)  # every character is in the vocabulary
    assert train_vocab(TEXTS * 3, 180, min_frequency=1) == vocab  # deterministic
    with pytest.raises(UsageError, match="--vocab-size 10"):
        train_vocab(TEXTS, 10)


@pytest.mark.parametrize("lower", [True, False])
def test_wordpiece_matches_transformers(vocab_file, tmp_path, lower):
    transformers = pytest.importorskip("transformers")
    if not lower:  # a cased vocabulary
        cased = train_vocab(TEXTS * 3, 200, lower_case=False, min_frequency=1)
        (tmp_path / "vocab.txt").write_text("\n".join(cased) + "\n", encoding="utf-8")
    else:
        (tmp_path / "vocab.txt").write_text(open(vocab_file, encoding="utf-8").read(), encoding="utf-8")
    hf = transformers.BertTokenizer.from_pretrained(str(tmp_path), do_lower_case=lower)
    ours = build_tokenizer(DataConfig(tokenizer_type="BertWordPieceLowerCase" if lower else "BertWordPieceCase",
                                      vocab_file=str(tmp_path / "vocab.txt")))
    for text in TEXTS + ["Unseen words: zyzzyva QUIXOTIC", "x" * 120]:
        assert ours.tokenize(text) == hf.convert_tokens_to_ids(hf.tokenize(text)), text
    assert ours.vocab_size == len(hf.get_vocab()) + 2  # [BOS] and [EOS] appended, as Megatron does
    assert ours.eod == ours.vocab["[EOS]"] and ours.cls == hf.cls_token_id and ours.mask == hf.mask_token_id


def test_basic_tokenization_and_detokenize(vocab_file):
    assert basic_tokenize("Héllo, WORLD!", True) == ["hello", ",", "world", "!"]
    assert basic_tokenize("Héllo, WORLD!", False) == ["Héllo", ",", "WORLD", "!"]
    assert basic_tokenize("a東京b", True) == ["a", "東", "京", "b"]
    tok = BertWordPieceTokenizer(vocab_file, lower_case=True)
    assert tok.detokenize(tok.tokenize("To be, or not to be")) == "to be , or not to be"


def test_vocab_file_errors(tmp_path):
    bad = tmp_path / "v.txt"
    bad.write_text("a\nb\n")
    with pytest.raises(UsageError, match="missing \\[PAD\\], \\[UNK\\]"):
        BertWordPieceTokenizer(str(bad), True)
    with pytest.raises(UsageError, match="--vocab-file: no such file"):
        BertWordPieceTokenizer(str(tmp_path / "none.txt"), True)


def test_sentence_splitter():
    text = ('Mr. Smith went to Washington. He said "Hello!" Then he left... Dr. J. R. Tolkien wrote it. '
            'Is it 3.14? Yes.\n\nNew para here\nwith a line.  (Paren.) end')
    assert split_sentences(text) == [
        "Mr. Smith went to Washington.", 'He said "Hello!"', "Then he left...", "Dr. J. R. Tolkien wrote it.",
        "Is it 3.14?", "Yes.", "New para here\nwith a line.", "(Paren.) end"]
    kept = split_sentences(text, keep_newlines=True)
    assert kept[5] == "Yes.\n\n" and kept[6] == "New para here\nwith a line."
    assert split_sentences("   ") == [] and split_sentences("no end") == ["no end"]


@pytest.mark.slow
def test_preprocess_split_sentences(vocab_file, tmp_path):
    docs = [" ".join(TEXTS[:2]), "", TEXTS[2] + " " + TEXTS[3]]
    with open(tmp_path / "c.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    args = [sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", str(tmp_path / "c.jsonl"),
            "--output-prefix", str(tmp_path / "out"), "--tokenizer-type", "BertWordPieceLowerCase",
            "--vocab-file", vocab_file, "--split-sentences"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    ds = IndexedDataset(str(tmp_path / "out_text_sentence"))
    tok = BertWordPieceTokenizer(vocab_file, True)
    expected = [[tok.tokenize(s) for s in split_sentences(d)] for d in docs]
    assert list(np.diff(ds.document_indices)) == [len(e) for e in expected]
    assert [ds[i].tolist() for i in range(len(ds))] == [s for e in expected for s in e]
    bad = subprocess.run([*args[:-1], "--keep-newlines"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--keep-newlines: applies to --split-sentences only" in bad.stderr


def _vocab(size=50):
    cont = np.zeros(size, dtype=bool)
    cont[30:40] = True  # ids 30..39 are ## pieces
    return BertVocab(size, cls=1, sep=2, pad=0, mask=3, continuation=cont)


def test_sample_index_follows_megatron_rules():
    # documents of 1, 3 and 5 sentences of 10 tokens; the one-sentence document is skipped with the binary head
    bounds = np.array([0, 1, 4, 9])
    lengths = np.full(9, 10)
    index = build_sample_index(bounds, lengths, 10, 25, 0.0, 7, 2)
    assert len(index) >= 10 and len(index) % 3 == 0  # whole epochs of 3 samples
    assert {tuple(r) for r in index.tolist()} == {(1, 4, 25), (4, 7, 25), (7, 9, 25)}
    short = build_sample_index(bounds, lengths, 200, 25, 1.0, 7, 1)
    assert short[:, 2].min() >= 2 and short[:, 2].max() <= 25 and len(set(short[:, 2].tolist())) > 5
    assert (short[:, 1] - short[:, 0] >= 1).all()
    with pytest.raises(UsageError, match="no document has 2 sentence"):
        build_sample_index(np.array([0, 1, 2]), np.full(2, 5), 4, 25, 0.0, 1, 2)


def test_samples_masking_and_sentence_order():
    cfg = BertSampleConfig(seq_length=64, mask_prob=0.15, short_seq_prob=0.0, seed=3)
    vocab = _vocab()
    mock = MockBertDataset(vocab, 400, cfg)
    swapped = masked = real = replaced_by_mask = 0
    for i in range(400):
        s = mock[i]
        n = int(s["padding_mask"].sum())
        toks = s["text"]
        assert toks[0] == vocab.cls and toks[n - 1] == vocab.sep and (toks[n:] == vocab.pad).all()
        assert ((s["labels"] >= 0) == (s["loss_mask"] == 1)).all() and s["loss_mask"][n:].sum() == 0
        original = np.where(s["labels"] >= 0, s["labels"], toks)  # a random replacement may be any id
        seps = np.flatnonzero(original[:n] == vocab.sep)
        assert len(seps) == 2 and (s["types"][:seps[0] + 1] == 0).all() and (s["types"][seps[0] + 1:n] == 1).all()
        assert 1 <= s["loss_mask"].sum() <= max(1, round(0.15 * n))
        assert not s["loss_mask"][[0, *seps]].any()  # [CLS] and [SEP] are never predicted
        swapped += s["is_random"]
        masked += int(s["loss_mask"].sum())
        real += n
        replaced_by_mask += int((toks[s["loss_mask"] == 1] == vocab.mask).sum())
        assert mock[i]["text"].tolist() == toks.tolist()  # seeded by the sample index alone
    assert 0.4 < swapped / 400 < 0.6
    assert 0.12 < masked / real < 0.16
    assert 0.74 < replaced_by_mask / masked < 0.86  # 80% [MASK]


def test_whole_word_masking_keeps_words_together():
    cfg = BertSampleConfig(seq_length=40, short_seq_prob=0.0, binary_head=False, max_ngram=1, seed=0)
    vocab = _vocab()
    sentence = np.array([10, 30, 31, 11, 32, 12, 13, 33, 34, 35] * 3)  # words with ## continuations
    from megatron_bmw.data.bert_dataset import build_sample
    for i in range(50):
        s = build_sample([sentence], 37, cfg, vocab, np.random.RandomState(i))
        chosen = set(np.flatnonzero(s["loss_mask"]).tolist())
        words, word = [], []
        for pos in range(1, 31):
            if not vocab.continuation[sentence[(pos - 1) % 10]] and word:
                words.append(word)
                word = []
            word.append(pos)
        words.append(word)
        for w in words:
            assert set(w) <= chosen or not set(w) & chosen, (w, chosen)


def test_bert_datasets_over_preprocessed_data_and_blends(vocab_file, tmp_path):
    from megatron_bmw.data.indexed_dataset import IndexedDatasetBuilder

    tok = BertWordPieceTokenizer(vocab_file, True)
    prefixes = []
    for name, seed in (("a", 0), ("b", 1)):
        rng = np.random.default_rng(seed)
        with IndexedDatasetBuilder(str(tmp_path / f"{name}.bin"), np.int32) as b:
            for _ in range(40):
                for _ in range(int(rng.integers(2, 6))):
                    b.add_item(rng.integers(5, tok.vocab_size, size=int(rng.integers(3, 15))))
                b.end_document()
            b.finalize(str(tmp_path / f"{name}.idx"))
        prefixes.append(str(tmp_path / name))
    sample = BertSampleConfig(seq_length=32, seed=5)
    one = build_bert_datasets(DataConfig(data_path=[prefixes[0]], split="80,20,0"), sample, (50, 10, 0), tok)
    assert isinstance(one[0], BertDataset) and len(one[0]) >= 50 and one[2] is None
    assert one[0][3]["text"].tolist() == build_bert_datasets(DataConfig(data_path=[prefixes[0]], split="80,20,0"),
                                                             sample, (50, 10, 0), tok)[0][3]["text"].tolist()
    blend = build_bert_datasets(DataConfig(data_path=["0.3", prefixes[0], "0.7", prefixes[1]]), sample, (40, 4, 0),
                                tok)
    assert len(blend[0]) == 40 and {blend[0][i]["dataset_id"] for i in range(40)} == {0, 1}
    with pytest.raises(UsageError, match="BERT needs a WordPiece tokenizer"):
        BertVocab.of(build_tokenizer(DataConfig(tokenizer_type="NullTokenizer", vocab_size=10)))


def test_a_masking_budget_under_one_token_is_refused():
    """Megatron's budget min(mask_prob x target, ...) masks nothing below one token: no loss would train."""
    BertSampleConfig(seq_length=10, mask_prob=0.15)  # 7 tokens: 1.05, one token per sample
    with pytest.raises(UsageError, match="--seq-length 9 with --mask-prob 0.15: the longest sample"):
        BertSampleConfig(seq_length=9, mask_prob=0.15)
    with pytest.raises(UsageError, match="--seq-length 64 with --mask-prob 0.01"):
        BertSampleConfig(seq_length=64, mask_prob=0.01)
