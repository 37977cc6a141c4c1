"""TikTokenizer (Megatron-LM's tiktoken vocabulary): the pure-Python BPE on its own and against tiktoken, the special
tokens before the ranks, decoding, preprocess_data, and one-line errors. The vocabulary is learned here."""

from __future__ import annotations

import json
import random
import sys

import numpy as np
import pytest

from megatron_bmw.config import DataConfig
from megatron_bmw.data.indexed_dataset import IndexedDataset
from megatron_bmw.data.tiktoken_bpe import SPECIAL_TOKENS
from megatron_bmw.data.tokenizers import TikTokenizer, build_tokenizer
from megatron_bmw.errors import UsageError

from .conftest import make_lines, write_jsonl
from .tiktoken_vocab import learn_ranks, write_vocab

EXTRA = ["naïve café résumé 漢字 🙂 it's we'll", "CamelCase HTTPServer URLs/a//b\r\n\r\nend",
         "  two  spaces\tand\n\n\ttab"]


@pytest.fixture(scope="module")
def vocab(tmp_path_factory, corpus_lines) -> str:
    """256 bytes and 150 learned merges (v2 pieces of the corpus) as Megatron's JSON list."""
    return write_vocab(tmp_path_factory.mktemp("tiktoken") / "tokenizer.json", learn_ranks(corpus_lines + EXTRA, 150))


def random_texts(n: int, seed: int) -> list[str]:
    """Texts mixing cases, digits, punctuation, whitespace runs, combining marks, CJK, emoji and special tokens."""
    rng = random.Random(seed)
    alphabet = list("abcXYZ019 .,'!?/-_\t\n\r") + ["  ", "\n\n", "é", "e\u0301", "漢", "字", "🙂", "ß", "Ǆ", "ǅ",
                                                 "the", " data", "<s>", "</s>", "<SPECIAL_9>", "<pad", "s>"]
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30))) for _ in range(n)]


def test_fallback_merges_the_leftmost_lowest_pair(tmp_path):
    """Hand-checked ids of the pure-Python BPE: 256 bytes, then aa, ab, aab; seven special tokens."""
    path = write_vocab(tmp_path / "t.json", [bytes([b]) for b in range(256)] + [b"aa", b"ab", b"aab"])
    tok = TikTokenizer(path, "v2", num_special_tokens=7, use_tiktoken=False)
    assert not tok.uses_tiktoken and tok.vocab_size == 256 + 3 + 7
    assert tok.tokenize("aab") == [7 + 258]  # a piece that is a token is that token
    assert tok.tokenize("aaab") == [7 + 256, 7 + 257]  # aa first (lowest, leftmost), then ab; aaab is no token
    assert tok.tokenize("aaa") == [7 + 256, 7 + ord("a")]
    assert tok.tokenize("baa") == [7 + ord("b"), 7 + 256]
    assert tok.tokenize("aa ab") == [7 + 256, 7 + ord(" "), 7 + 257]  # v2 keeps the space apart from letters
    assert tok.tokenize("<s>aa</s>") == [1, 7 + 256, 2]
    assert tok.detokenize(tok.tokenize("aaab <s>x")) == "aaab <s>x"


@pytest.mark.parametrize("pattern", ["v1", "v2"])
def test_ids_equal_tiktokens(vocab, corpus_lines, pattern):
    """The pure-Python BPE and tiktoken (built from the same ranks) give the same ids, and decode alike."""
    pytest.importorskip("tiktoken")
    ours = TikTokenizer(vocab, pattern, use_tiktoken=False)
    ref = TikTokenizer(vocab, pattern, use_tiktoken=True)
    assert ref.uses_tiktoken and not ours.uses_tiktoken
    for text in corpus_lines[:100] + EXTRA + random_texts(400, seed=1) + ["", "\ud800 lone surrogate"]:
        ids = ours.tokenize(text)
        assert ids == ref.tokenize(text), repr(text)
        assert ours.detokenize(ids) == ref._encoder.encoding.decode(ids)
    split = ref.tokenize("🙂")  # one character over several byte tokens: decoded whole, partly replaced
    assert len(split) > 1 and ours.detokenize(split) == "🙂" and "\ufffd" in ours.detokenize(split[:1])


def test_special_tokens_come_first(vocab, corpus_lines):
    tok = build_tokenizer(DataConfig(tokenizer_type="TikTokenizer", tokenizer_model=vocab, tiktoken_pattern="v2"))
    ranks = len(json.load(open(vocab)))
    assert tok.vocab_size == ranks + 1000 and tok.special_tokens[:7] == list(SPECIAL_TOKENS)
    assert (tok.unk, tok.bos, tok.eos, tok.eod, tok.mask, tok.pad, tok.cls, tok.sep) == (0, 1, 2, 2, 3, 4, 5, 6)
    assert tok.special_tokens[7] == "<SPECIAL_7>" and tok.special_tokens[-1] == "<SPECIAL_999>"
    assert tok.tokenize("A") == [1000 + ord("A")] and tok.tokenize("<SPECIAL_999>") == [999]
    for text in corpus_lines[:50] + EXTRA:
        ids = tok.tokenize(text)
        assert all(1000 <= i < tok.vocab_size for i in ids) and tok.detokenize(ids) == text
    own = ["<s>", "</s>", "<unk>", "<pad>", "<mask>", "<cls>", "<sep>", "<|im_end|>"]
    cfg = DataConfig(tokenizer_type="TikTokenizer", tokenizer_model=vocab, tiktoken_num_special_tokens=10,
                     special_tokens=own)
    tok = build_tokenizer(cfg)
    assert (tok.bos, tok.eod, tok.unk, tok.pad, tok.vocab_size) == (0, 1, 2, 3, ranks + 10)
    assert tok.tokenize("x<|im_end|>") == [10 + ord("x"), 7]
    assert tok.special_tokens[8:] == ["<SPECIAL_8>", "<SPECIAL_9>"]
    cut = build_tokenizer(DataConfig(tokenizer_type="TikTokenizer", tokenizer_model=vocab, vocab_size=1300))
    assert cut.vocab_size == 1300 and all(i < 1300 for t in corpus_lines[:50] for i in cut.tokenize(t))


def test_without_the_tiktoken_package(vocab, monkeypatch, corpus_lines):
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    tok = build_tokenizer(DataConfig(tokenizer_type="TikTokenizer", tokenizer_model=vocab, tiktoken_pattern="v1"))
    assert not tok.uses_tiktoken
    assert all(tok.detokenize(tok.tokenize(t)) == t for t in corpus_lines[:50] + EXTRA)
    with pytest.raises(UsageError, match="'tiktoken' package is not installed"):
        TikTokenizer(vocab, use_tiktoken=True)


def _one_line(match: str, **kw) -> None:
    with pytest.raises(UsageError, match=match) as info:
        build_tokenizer(DataConfig(**{"tokenizer_type": "TikTokenizer", **kw}))
    assert "\n" not in str(info.value) and info.value.exit_code == 2


def test_errors_name_the_flag_or_file(vocab, tmp_path):
    _one_line("--tokenizer-model: required for TikTokenizer")
    _one_line("--tokenizer-model: no such file", tokenizer_model=str(tmp_path / "none.json"))
    bad = tmp_path / "bad.json"
    for content, match in [("{not json", "is not a TikTokenizer vocabulary .*: not JSON"),
                           ("{}", "not a non-empty JSON list"), ("[1, 2]", "entry 0 is not a TikTokenizer"),
                           (json.dumps([{"rank": 1, "token_bytes": "AA==", "token_str": ""}]), "entry 0: rank 1"),
                           (json.dumps([{"rank": 0, "token_bytes": "!!", "token_str": ""}]), "entry 0: .*not base64"),
                           (json.dumps([{"rank": 0, "token_bytes": "AQ==", "token_str": ""}]), "must be the byte 0"),
                           (json.dumps([{"rank": 0, "token_bytes": "AA==", "token_str": ""}]), "has 1 entries")]:
        bad.write_text(content)
        _one_line(f"--tokenizer-model: '{bad}'.*{match}", tokenizer_model=str(bad))
    bad.write_bytes(b"\xff\xfe[")
    _one_line("not JSON", tokenizer_model=str(bad))
    _one_line("--tiktoken-pattern: unknown 'v3'", tokenizer_model=vocab, tiktoken_pattern="v3")
    _one_line("--tiktoken-num-special-tokens: 5 is fewer than the 7", tokenizer_model=vocab,
              tiktoken_num_special_tokens=5)
    _one_line("--tokenizer-special-tokens: must include .* \\(missing <pad>\\)", tokenizer_model=vocab,
              special_tokens=["<unk>", "<s>", "</s>", "<mask>", "<cls>", "<sep>"])
    _one_line("--tokenizer-special-tokens: a token is repeated", tokenizer_model=vocab,
              special_tokens=[*SPECIAL_TOKENS, "<s>"])
    _one_line("--vocab-size: 99999 needs 98999 ranks", tokenizer_model=vocab, vocab_size=99999)
    _one_line("--vocab-size: 1000 must exceed", tokenizer_model=vocab, vocab_size=1000)
    with pytest.raises(UsageError, match="--tokenizer-special-tokens: taken by TikTokenizer only"):
        build_tokenizer(DataConfig(tokenizer_type="NullTokenizer", vocab_size=5, special_tokens=["<s>"]))
    with pytest.raises(UsageError, match="TikTokenizer: id 99999 outside"):
        build_tokenizer(DataConfig(tokenizer_type="TikTokenizer", tokenizer_model=vocab)).detokenize([99999])


def test_preprocess_data(preprocess, tmp_path, vocab, capsys):
    """tools/preprocess_data.py with Megatron's TikTokenizer flags writes a dataset the indexed reader returns."""
    texts = make_lines(60, seed=11) + EXTRA + ["text with <s> inside"]
    src = write_jsonl(tmp_path / "in.jsonl", texts)
    out = tmp_path / "out" / "corpus"
    flags = ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", vocab, "--tiktoken-pattern", "v2",
             "--tiktoken-num-special-tokens", "1000"]
    assert preprocess.main(["--input", str(src), "--output-prefix", str(out), *flags, "--append-eod",
                            "--workers", "2"]) == 0
    ds = IndexedDataset(f"{out}_text_document")
    tok = build_tokenizer(DataConfig(tokenizer_type="TikTokenizer", tokenizer_model=vocab, tiktoken_pattern="v2"))
    assert ds.dtype == np.uint16 and len(ds) == len(texts)
    for i, text in enumerate(texts):
        ids = ds[i].tolist()
        assert ids == tok.tokenize(text) + [tok.eod] and tok.detokenize(ids[:-1]) == text
    assert 1 in ds[len(texts) - 1].tolist()  # <s> in the text is the bos id, as Megatron encodes it
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        preprocess.main(["--input", str(src), "--output-prefix", str(out), *flags[:4], "--tiktoken-pattern", "v3"])
    assert info.value.code == 2 and "--tiktoken-pattern" in capsys.readouterr().err
