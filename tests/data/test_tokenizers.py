"""Tokenizers: round trips, agreement with reference implementations, padding, and flag errors."""

from __future__ import annotations

import json
import sys

import pytest

from megatron_bmw.config import DataConfig, padded_vocab_size
from megatron_bmw.data.tokenizers import (
    GPT2BPETokenizer,
    NullTokenizer,
    build_tokenizer,
)
from megatron_bmw.errors import UsageError

from .conftest import make_lines


def test_vocab_padding():
    assert padded_vocab_size(50257, 128, 1) == 50304
    assert padded_vocab_size(50257, 128, 8) == 51200
    assert padded_vocab_size(256, 128, 2) == 256
    assert padded_vocab_size(1, 1, 1) == 1


def test_null_tokenizer_follows_megatron():
    tok = build_tokenizer(DataConfig(tokenizer_type="NullTokenizer", vocab_size=100))
    assert isinstance(tok, NullTokenizer)
    assert tok.vocab_size == 101 and tok.eod == 100
    assert tok.tokenize("3 1 4 99") == [3, 1, 4, 99]
    assert tok.detokenize([3, 1, 4]) == "3 1 4"
    with pytest.raises(UsageError, match="not an integer"):
        tok.tokenize("3 x")
    with pytest.raises(UsageError, match="--vocab-size"):
        build_tokenizer(DataConfig(tokenizer_type="NullTokenizer"))


def test_gpt2_bpe_matches_tokenizers_library(bpe_files):
    from tokenizers import ByteLevelBPETokenizer

    vocab, merges = bpe_files
    ours = build_tokenizer(DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab, merge_file=merges))
    assert isinstance(ours, GPT2BPETokenizer)
    reference = ByteLevelBPETokenizer(vocab, merges)
    assert ours.vocab_size == reference.get_vocab_size()
    assert ours.eod == reference.token_to_id("<|endoftext|>")
    texts = make_lines(40, seed=7) + ["  two  spaces\tand tab\nnew line", "unseen ✓ 漢字 emoji 🙂", "it's we've they'll", ""]
    for text in texts:
        ids = ours.tokenize(text)
        assert ids == reference.encode(text).ids, text
        assert ours.detokenize(ids) == text


def test_sentencepiece_round_trip(sp_model, corpus_lines):
    import sentencepiece

    tok = build_tokenizer(DataConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model=sp_model))
    sp = sentencepiece.SentencePieceProcessor(model_file=sp_model)
    assert tok.vocab_size == sp.get_piece_size()
    assert tok.eod == sp.eos_id() >= 0
    for text in corpus_lines[:20] + ["unseen ✓ text"]:
        ids = tok.tokenize(text)
        assert ids == sp.encode(text)
        assert tok.detokenize(ids + [tok.eod]) == text


@pytest.mark.parametrize("kind", ["GPTSentencePieceTokenizer", "Llama2Tokenizer"])
def test_sentencepiece_names_are_one_tokenizer(sp_model, kind):
    """Megatron builds its three SentencePiece names as one tokenizer (Mixtral's script names Llama2Tokenizer)."""
    tok = build_tokenizer(DataConfig(tokenizer_type=kind, tokenizer_model=sp_model))
    ref = build_tokenizer(DataConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model=sp_model))
    assert (tok.vocab_size, tok.eod, tok.tokenize("Quick brown fox.")) == \
        (ref.vocab_size, ref.eod, ref.tokenize("Quick brown fox."))


def test_huggingface_tokenizer(tmp_path, bpe_files):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    vocab, merges = bpe_files
    ByteLevelBPETokenizer(vocab, merges).save(str(tmp_path / "tok.json"))
    hf_dir = tmp_path / "hf"
    PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tok.json"), eos_token="<|endoftext|>").save_pretrained(str(hf_dir))
    tok = build_tokenizer(DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(hf_dir)))
    gpt2 = GPT2BPETokenizer(vocab, merges)
    text = "The quick brown fox."
    assert tok.tokenize(text) == gpt2.tokenize(text)
    assert tok.detokenize(tok.tokenize(text)) == text
    assert tok.eod == gpt2.eod and tok.vocab_size == gpt2.vocab_size


def one_line(cfg: DataConfig, match: str) -> None:
    with pytest.raises(UsageError, match=match) as info:
        build_tokenizer(cfg)
    assert "\n" not in str(info.value)


def test_flag_errors(tmp_path, bpe_files):
    vocab, merges = bpe_files
    one_line(DataConfig(), "--tokenizer-type: required")
    one_line(DataConfig(tokenizer_type="Nope"), "--tokenizer-type: unknown 'Nope'")
    one_line(DataConfig(tokenizer_type="SentencePieceTokenizer"), "--tokenizer-model: required")
    one_line(DataConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model=str(tmp_path / "x.model")), "--tokenizer-model: no such file")
    one_line(DataConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model=str(tmp_path)), "--tokenizer-model: .* is a directory")
    (tmp_path / "bad.model").write_bytes(b"not a model")
    one_line(DataConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model=str(tmp_path / "bad.model")), "--tokenizer-model: .* is not a SentencePiece model")
    one_line(DataConfig(tokenizer_type="GPT2BPETokenizer", merge_file=merges), "--vocab-file: required")
    one_line(DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab, merge_file=str(tmp_path / "m.txt")), "--merge-file: no such file")
    (tmp_path / "v.json").write_text(json.dumps({"a": 0}))
    one_line(DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=str(tmp_path / "v.json"), merge_file=merges), "<\\|endoftext\\|>")
    one_line(DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "nodir")), "--tokenizer-model: no such directory")
    one_line(DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path)), "--tokenizer-model: cannot load")


def test_huggingface_without_transformers(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    one_line(DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path)), "needs the 'transformers' package")
