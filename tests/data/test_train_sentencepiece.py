"""tools/train_sentencepiece.py: a model from JSONL text, and bad input in one line (#28)."""

from __future__ import annotations

import pytest

from .conftest import load_tool, write_jsonl


@pytest.fixture(scope="module")
def tool():
    return load_tool("train_sentencepiece")


def _error(tool, argv, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        tool.main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def test_trains_and_refuses_bad_input(tool, tmp_path, capsys, corpus_lines):
    text = write_jsonl(tmp_path / "c.jsonl", corpus_lines[:100])
    tool.main(["--input", str(text), "--model-prefix", str(tmp_path / "spm"), "--vocab-size", "400"])
    assert (tmp_path / "spm.model").stat().st_size > 0
    prefix = ["--model-prefix", str(tmp_path / "m")]
    (tmp_path / "bad.jsonl").write_text('{"text": "a b"}\n{oops\n')
    for argv, needle in [
        (["--input", str(text), *prefix, "--vocab-size", "-1"], "--vocab-size must be >= 259"),
        (["--input", str(text), *prefix, "--threads", "0"], "--threads must be >= 1"),
        (["--input", str(text), *prefix, "--json-key", "body"], "--json-key: key 'body' is missing"),
        (["--input", str(tmp_path / "bad.jsonl"), *prefix], "line 2 is not JSON"),
        (["--input", str(text), "--model-prefix", str(tmp_path / "no" / "m")], "folder"),
        (["--input", str(text), *prefix, "--vocab-size", "100000"], "SentencePiece cannot train on it"),
        (["--input", str(text), *prefix, "--vocab-size", "x"], "argument --vocab-size: invalid int value"),
    ]:
        assert needle in _error(tool, argv, capsys), argv
