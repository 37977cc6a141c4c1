"""Shared fixtures for the data tests: a generated corpus, tiny tokenizers, small indexed datasets."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_bmw.data.indexed_dataset import IndexedDatasetBuilder

REPO = Path(__file__).resolve().parents[2]
WORDS = "the of data model token train layer river stone quick brown fox jumps over lazy dog café naïve 42 3.14".split()


def make_lines(n: int, seed: int = 0) -> list[str]:
    """Deterministic sentences with punctuation, digits and a few non-ASCII letters."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 14))]
        lines.append(" ".join(words).capitalize() + rng.choice([".", "!", "?", ", then more."]))
    return lines


@pytest.fixture(scope="session")
def corpus_lines() -> list[str]:
    return make_lines(300)


@pytest.fixture(scope="session")
def sp_model(tmp_path_factory, corpus_lines) -> str:
    """A tiny SentencePiece model that keeps text verbatim (identity normalisation, byte fallback)."""
    import sentencepiece as spm

    d = tmp_path_factory.mktemp("sp")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus_lines),
        model_prefix=str(d / "tiny"),
        vocab_size=400,
        model_type="bpe",
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        byte_fallback=True,
        minloglevel=2,
    )
    return str(d / "tiny.model")


@pytest.fixture(scope="session")
def bpe_files(tmp_path_factory, corpus_lines) -> tuple[str, str]:
    """vocab.json and merges.txt of a small byte-level BPE trained with the `tokenizers` library."""
    from tokenizers import ByteLevelBPETokenizer

    d = tmp_path_factory.mktemp("bpe")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus_lines, vocab_size=400, min_frequency=2, special_tokens=["<|endoftext|>"], show_progress=False)
    bpe.save_model(str(d))
    return str(d / "vocab.json"), str(d / "merges.txt")


@pytest.fixture(scope="session")
def preprocess():
    """The `tools/preprocess_data.py` module, imported from its path."""
    return load_tool("preprocess_data")


def load_tool(name: str):
    """The module `tools/<name>.py`, imported from its path."""
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def write_jsonl(path: Path, texts: list[str], key: str = "text") -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({key: t}) + "\n")
    return path


def write_dataset(prefix: Path, docs: list[list[int]], dtype=np.uint16) -> str:
    """An indexed dataset with one sequence per document."""
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype)
    for doc in docs:
        builder.add_item(doc)
        builder.end_document()
    builder.finalize(str(prefix) + ".idx")
    return str(prefix)


def counting_docs(lengths: list[int], start: int = 0) -> list[list[int]]:
    """Documents whose tokens are consecutive integers, so every token is unique and ordered."""
    docs, nxt = [], start
    for n in lengths:
        docs.append(list(range(nxt, nxt + n)))
        nxt += n
    return docs
