"""Tokenize a JSON-lines corpus into Megatron-LM `.bin/.idx` datasets, one per JSON key.

Each input line is one JSON document; for every `--json-keys` key the text becomes one sequence
(and one document) in `{output_prefix}_{key}_document.bin/.idx`. With `--split-sentences` (BERT data) each
sentence becomes its own sequence, the document's sentences one document, in `{output_prefix}_{key}_sentence.*`
(sentences by megatron_bmw/data/sentences.py; `--keep-newlines` keeps the newlines after them).

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --append-eod --workers 8

(`--tokenizer-type TikTokenizer --tokenizer-model tokenizer.json --tiktoken-pattern v2` for Megatron's tiktoken
vocabulary; its flags are DataConfig's.)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator

import numpy as np

try:
    import megatron_bmw  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_bmw.config import DataConfig
from megatron_bmw.config.schema import add_flags
from megatron_bmw.data.indexed_dataset import IndexedDatasetBuilder, optimal_dtype
from megatron_bmw.data.sentences import split_sentences
from megatron_bmw.data.tokenizers import TOKENIZER_TYPES, Tokenizer, build_tokenizer
from megatron_bmw.errors import RunError, OneLineParser, UsageError, exit_on_usage_error


TIKTOKEN_FIELDS = ("tiktoken_pattern", "tiktoken_num_special_tokens", "special_tokens")  # TikTokenizer's flags


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", required=True, help="JSON-lines file, one document per line")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="keys to tokenize (default: text)")
    p.add_argument("--output-prefix", required=True, help="writes {prefix}_{key}_document.bin/.idx")
    p.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    p.add_argument("--tokenizer-model", help="SentencePiece .model file, Hugging Face tokenizer directory or "
                                             "TikTokenizer vocabulary (.json)")
    p.add_argument("--vocab-file", help="GPT-2 BPE vocab.json, or a BERT WordPiece vocab.txt")
    p.add_argument("--merge-file", help="GPT-2 BPE merges.txt")
    p.add_argument("--vocab-size", type=int, help="NullTokenizer vocabulary size (TikTokenizer: its cut, as Megatron)")
    add_flags(p, {}, [DataConfig], fields=TIKTOKEN_FIELDS)
    p.add_argument("--append-eod", action="store_true", help="append the end-of-document token to every document")
    p.add_argument("--split-sentences", action="store_true", help="one sequence per sentence (BERT's input)")
    p.add_argument("--keep-newlines", action="store_true",
                   help="with --split-sentences: keep the newlines that follow each sentence")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes (default 1)")
    p.add_argument("--log-interval", type=int, default=1000, help="progress line every N documents")
    return p


# Worker-process state, set once per process by _init_worker.
_tokenizer: Tokenizer | None = None
_keys: list[str] = []
_append_eod = False
_input = ""
_sentences: tuple[bool, bool] = (False, False)  # (split, keep newlines)


def _init_worker(cfg: DataConfig, keys: list[str], append_eod: bool, input_path: str,
                 sentences: tuple[bool, bool] = (False, False)) -> None:
    global _tokenizer, _keys, _append_eod, _input, _sentences
    _tokenizer = build_tokenizer(cfg)
    _keys, _append_eod, _input, _sentences = keys, append_eod, input_path, sentences


def _sequences(text: str) -> list[np.ndarray]:
    """The token ids of a document's sequences: the whole text, or its non-empty sentences."""
    if not _sentences[0]:
        pieces = [_tokenizer.tokenize(text)]
    else:
        pieces = [ids for ids in (_tokenizer.tokenize(s) for s in split_sentences(text, _sentences[1])) if ids]
    if _append_eod and pieces and pieces[-1]:  # as Megatron-LM: an empty text stays empty, without eod
        pieces[-1] = pieces[-1] + [_tokenizer.eod]
    return [np.asarray(ids, dtype=np.int64) for ids in pieces]


def _encode(item: tuple[int, str]) -> tuple[dict[str, list[np.ndarray]] | None, int]:
    """One JSON line -> the token ids of its sequences per key (None for a blank line), and the line's size in
    bytes."""
    lineno, line = item
    size = len(line.encode("utf-8"))
    if not line.strip():
        return None, size
    try:
        doc = json.loads(line)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--input: {_input} line {lineno} is not JSON ({exc.msg})") from None
    if not isinstance(doc, dict):
        raise UsageError(f"--input: {_input} line {lineno} is not a JSON object")
    out: dict[str, list[np.ndarray]] = {}
    for key in _keys:
        text = doc.get(key)
        if not isinstance(text, str):
            what = "missing" if text is None else "not a string"
            raise UsageError(f"--json-keys: key {key!r} is {what} in {_input} line {lineno}")
        try:
            out[key] = _sequences(text)
        except UsageError as exc:  # a token the tokenizer refuses: name where it is
            raise UsageError(f"--input: {_input} line {lineno}, key {key!r}: {exc}") from None
    return out, size


def _validate(args: argparse.Namespace) -> None:
    if not os.path.isfile(args.input):
        raise UsageError(f"--input: no such file {args.input!r}")
    if args.workers < 1:
        raise UsageError(f"--workers: must be at least 1, got {args.workers}")
    if args.log_interval < 1:
        raise UsageError(f"--log-interval: must be at least 1, got {args.log_interval}")
    if len(set(args.json_keys)) != len(args.json_keys):
        raise UsageError(f"--json-keys: repeated key in {args.json_keys}")
    if args.keep_newlines and not args.split_sentences:
        raise UsageError("--keep-newlines: applies to --split-sentences only")


def _encoded(
    args: argparse.Namespace, cfg: DataConfig, lines: Iterator[tuple[int, str]]
) -> Iterator[tuple[dict[str, np.ndarray] | None, int]]:
    init = (cfg, args.json_keys, args.append_eod, args.input, (args.split_sentences, args.keep_newlines))
    if args.workers == 1:
        _init_worker(*init)
        yield from map(_encode, lines)
        return
    # fork: workers inherit this module even when it was loaded from a file path.
    ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
    with ctx.Pool(args.workers, initializer=_init_worker, initargs=init) as pool:
        yield from pool.imap(_encode, lines, chunksize=32)


@exit_on_usage_error
def main(argv: list[str] | None = None) -> int:
    """Tokenize `--input` and write one indexed dataset per JSON key."""
    args = build_parser().parse_args(argv)
    _validate(args)
    cfg = DataConfig(
        tokenizer_type=args.tokenizer_type,
        tokenizer_model=args.tokenizer_model,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        vocab_size=args.vocab_size,
        **{name: getattr(args, name) for name in TIKTOKEN_FIELDS},
    )
    tokenizer = build_tokenizer(cfg)
    dtype = optimal_dtype(tokenizer.vocab_size)
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--output-prefix: cannot create {out_dir!r}: {exc.strerror}") from None
    level = "sentence" if args.split_sentences else "document"
    prefixes = {key: f"{args.output_prefix}_{key}_{level}" for key in args.json_keys}
    builders = {}
    try:
        for key, prefix in prefixes.items():
            builders[key] = IndexedDatasetBuilder(prefix + ".bin", dtype)
    except OSError as exc:
        _discard(builders, prefixes)
        raise UsageError(f"--output-prefix: cannot write {exc.filename or out_dir!r}: {exc.strerror}") from None

    try:
        docs, tokens, progress = _tokenize_into(args, cfg, builders)
    except OSError as exc:  # the input is checked before: a write failed (a full disk)
        _discard(builders, prefixes)
        raise RunError(f"--output-prefix: writing {args.output_prefix}* failed ({exc.strerror}); nothing written") from None
    except BaseException:
        _discard(builders, prefixes)
        raise
    if tokens == 0:
        _discard(builders, prefixes)
        what = "no documents (it is empty or holds only blank lines)" if docs == 0 else \
            f"{docs} documents but no tokens (every {'/'.join(args.json_keys)} text is empty)"
        raise UsageError(f"--input: {args.input} has {what}; nothing written")
    try:
        for key, prefix in prefixes.items():
            builders[key].finalize(prefix + ".idx")
    except OSError as exc:
        _discard(builders, prefixes)
        raise RunError(f"--output-prefix: writing {args.output_prefix}* failed ({exc.strerror}); nothing written") from None
    progress(final=True)
    return 0


def _discard(builders: dict, prefixes: dict) -> None:
    """Delete the unfinished outputs (and a stale .idx of the same prefix): no empty or half dataset is left."""
    for key, builder in builders.items():
        builder.abort()
        if os.path.exists(prefixes[key] + ".idx"):
            os.remove(prefixes[key] + ".idx")


def _tokenize_into(args: argparse.Namespace, cfg: DataConfig, builders: dict):
    """Stream `--input` into the builders; returns (documents, tokens, progress(final) printer)."""
    start = time.monotonic()
    docs = nbytes = tokens = 0

    def progress(final: bool = False) -> None:
        elapsed = max(time.monotonic() - start, 1e-9)
        tag = "done:" if final else "processed"
        print(
            f"{tag} {docs} documents ({docs / elapsed:.1f} docs/s, {nbytes / elapsed / 1e6:.2f} MB/s)",
            file=sys.stderr,
            flush=True,
        )

    with open(args.input, encoding="utf-8", errors="strict") as f:
        try:
            for encoded, size in _encoded(args, cfg, enumerate(f, 1)):
                nbytes += size
                if encoded is None:
                    continue
                for key, sequences in encoded.items():
                    builder = builders[key]
                    for ids in sequences:
                        if ids.size:
                            builder.add_item(ids)
                            tokens += int(ids.size)
                    builder.end_document()
                docs += 1
                if docs % args.log_interval == 0:
                    progress()
        except UnicodeDecodeError as exc:
            raise UsageError(f"--input: {args.input} is not UTF-8 text ({exc.reason})") from None
    return docs, tokens, progress


if __name__ == "__main__":
    sys.exit(main())
