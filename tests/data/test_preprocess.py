"""tools/preprocess_data.py: JSON lines -> .bin/.idx round trips and command-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron_bmw.config import DataConfig
from megatron_bmw.data.indexed_dataset import IndexedDataset
from megatron_bmw.data.tokenizers import build_tokenizer

from .conftest import REPO, make_lines, write_jsonl


def run_and_read(preprocess, tmp_path, texts, tok_args, cfg, extra=()):
    src = write_jsonl(tmp_path / "in.jsonl", texts)
    out = tmp_path / "out" / "corpus"
    argv = ["--input", str(src), "--output-prefix", str(out), *tok_args, "--append-eod", "--workers", "2", "--log-interval", "50", *extra]
    assert preprocess.main(argv) == 0
    return IndexedDataset(f"{out}_text_document"), build_tokenizer(cfg)


def check_round_trip(ds, tok, texts):
    assert ds.dtype == np.uint16
    assert len(ds) == len(texts)
    assert ds.document_indices.tolist() == list(range(len(texts) + 1))
    for i, text in enumerate(texts):
        ids = ds[i].tolist()
        assert ids[-1] == tok.eod
        assert ids[:-1] == tok.tokenize(text)
        assert tok.detokenize(ids[:-1]) == text


def test_sentencepiece_round_trip(preprocess, tmp_path, sp_model, capsys):
    texts = make_lines(200, seed=3)
    ds, tok = run_and_read(
        preprocess, tmp_path, texts,
        ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", sp_model],
        DataConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model=sp_model),
    )
    check_round_trip(ds, tok, texts)
    err = capsys.readouterr().err
    assert "processed 50 documents" in err and "docs/s" in err and "MB/s" in err
    assert "done: 200 documents" in err


def test_gpt2_bpe_round_trip(preprocess, tmp_path, bpe_files):
    vocab, merges = bpe_files
    texts = make_lines(120, seed=4) + ["multi\nline  text ✓"]
    ds, tok = run_and_read(
        preprocess, tmp_path, texts,
        ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges],
        DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab, merge_file=merges),
    )
    check_round_trip(ds, tok, texts)


def test_several_keys_and_empty_text(preprocess, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps(d) for d in [{"a": "1 2", "b": "3"}, {"a": "", "b": "4 5 6"}]) + "\n\n")
    out = str(tmp_path / "c")
    args = ["--input", str(src), "--output-prefix", out, "--json-keys", "a", "b", "--tokenizer-type", "NullTokenizer", "--vocab-size", "10", "--append-eod"]
    assert preprocess.main(args) == 0
    a, b = IndexedDataset(out + "_a_document"), IndexedDataset(out + "_b_document")
    # As in Megatron-LM an empty text adds a document without a sequence (and without eod).
    assert [a[i].tolist() for i in range(len(a))] == [[1, 2, 10]]
    assert a.document_indices.tolist() == [0, 1, 1]
    assert [b[i].tolist() for i in range(len(b))] == [[3, 10], [4, 5, 6, 10]]


def error_line(preprocess, argv, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        preprocess.main(argv)
    assert info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    return lines[0]


def test_bad_inputs(preprocess, tmp_path, capsys):
    null = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "10"]
    out = ["--output-prefix", str(tmp_path / "o")]
    assert "--input: no such file" in error_line(preprocess, ["--input", str(tmp_path / "none.jsonl"), *out, *null], capsys)
    assert "required" in error_line(preprocess, ["--input", "x"], capsys)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "1 2"}\n{not json}\n')
    assert "line 2 is not JSON" in error_line(preprocess, ["--input", str(bad), *out, *null, "--workers", "2"], capsys)
    good = write_jsonl(tmp_path / "good.jsonl", ["1 2"])
    assert "--json-keys: key 'body' is missing" in error_line(preprocess, ["--input", str(good), *out, *null, "--json-keys", "body"], capsys)
    assert "--vocab-file: required" in error_line(preprocess, ["--input", str(good), *out, "--tokenizer-type", "GPT2BPETokenizer"], capsys)
    assert "--workers" in error_line(preprocess, ["--input", str(good), *out, *null, "--workers", "0"], capsys)
    big = write_jsonl(tmp_path / "big.jsonl", ["1 2", "3 99"])  # a token id the vocabulary does not have
    assert f"--input: {big} line 2, key 'text': NullTokenizer: id 99 outside" in error_line(
        preprocess, ["--input", str(big), *out, *null], capsys)


@pytest.mark.slow
def test_cli_missing_input_exits_2(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "preprocess_data.py"), "--input", str(tmp_path / "missing.jsonl"),
         "--output-prefix", str(tmp_path / "o"), "--tokenizer-type", "NullTokenizer", "--vocab-size", "5"],
        capture_output=True, text=True, cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"error: --input: no such file {str(tmp_path / 'missing.jsonl')!r}"]


def test_workers_do_not_change_the_output(preprocess, tmp_path, bpe_files):
    vocab, merges = bpe_files
    src = write_jsonl(tmp_path / "in.jsonl", make_lines(150, seed=9))
    tok = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges, "--append-eod"]
    for workers in ("1", "2"):
        assert preprocess.main(["--input", str(src), "--output-prefix", str(tmp_path / f"w{workers}"), *tok, "--workers", workers]) == 0
    for ext in (".bin", ".idx"):
        one = (tmp_path / f"w1_text_document{ext}").read_bytes()
        assert one == (tmp_path / f"w2_text_document{ext}").read_bytes()


@pytest.mark.slow
@pytest.mark.parametrize("text,needle", [
    ("", "has no documents (it is empty or holds only blank lines)"),
    ("\n   \n\t\n", "has no documents (it is empty or holds only blank lines)"),
    ('{"text": ""}\n{"text": ""}\n', "has 2 documents but no tokens (every text text is empty)"),
])
def test_empty_input_is_one_error_and_writes_nothing(tmp_path, text, needle):
    src = tmp_path / "empty.jsonl"
    src.write_text(text)
    (tmp_path / "out").mkdir()
    stale = tmp_path / "out" / "c_text_document.idx"
    stale.write_bytes(b"old")  # a previous run's index would no longer match its .bin
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "preprocess_data.py"), "--input", str(src), "--output-prefix",
         str(tmp_path / "out" / "c"), "--tokenizer-type", "NullTokenizer", "--vocab-size", "5", "--workers", "2"],
        capture_output=True, text=True, cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"error: --input: {src} {needle}; nothing written"]
    assert os.listdir(tmp_path / "out") == []


def test_error_mid_file_leaves_no_partial_dataset(preprocess, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "1 2"}\n' * 50 + "{not json}\n")
    argv = ["--input", str(bad), "--output-prefix", str(tmp_path / "o"), "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "10"]
    assert "line 51 is not JSON" in error_line(preprocess, argv, capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]


def test_unwritable_output_and_full_disk_are_one_line(preprocess, tmp_path, capsys, monkeypatch):
    """#28: an output that cannot be written, or a write that fails part-way, is one line and leaves nothing."""
    good = write_jsonl(tmp_path / "good.jsonl", ["1 2 3"] * 20)
    null = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "10"]
    (tmp_path / "o_text_document.bin").mkdir()  # the .bin cannot be opened for writing
    line = error_line(preprocess, ["--input", str(good), "--output-prefix", str(tmp_path / "o"), *null], capsys)
    assert line.startswith("error: --output-prefix: cannot write") and "o_text_document.bin" in line
    (tmp_path / "a_file").write_text("")
    line = error_line(preprocess, ["--input", str(good), "--output-prefix", str(tmp_path / "a_file" / "o"), *null], capsys)
    assert line.startswith("error: --output-prefix: cannot create")

    def full(self, tokens):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(preprocess.IndexedDatasetBuilder, "add_item", full)
    with pytest.raises(SystemExit) as info:
        preprocess.main(["--input", str(good), "--output-prefix", str(tmp_path / "p"), *null])
    lines = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 1 and lines == [f"error: --output-prefix: writing {tmp_path / 'p'}* failed (No space left "
                                              "on device); nothing written"], lines
    assert not any(p.name.startswith("p_") for p in tmp_path.iterdir())
