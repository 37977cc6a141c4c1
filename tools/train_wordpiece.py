"""Learn a small BERT WordPiece vocabulary (vocab.txt) from a JSONL corpus or plain-text files, no dependencies.

    python tools/train_wordpiece.py --input docs.jsonl --output vocab.txt --vocab-size 8000 [--cased]

The vocabulary starts with [PAD] [UNK] [CLS] [SEP] [MASK] and every character of the corpus; then the most frequent
merged pieces (megatron_bmw/data/wordpiece.py `train_vocab`). Use it with --tokenizer-type BertWordPieceLowerCase
(or BertWordPieceCase with --cased) and --vocab-file.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_bmw.data.wordpiece import train_vocab  # noqa: E402
from megatron_bmw.errors import OneLineParser, UsageError, exit_on_usage_error  # noqa: E402


def _texts(paths: list[str], key: str):
    for path in paths:
        if not os.path.isfile(path):
            raise UsageError(f"--input: no such file {path!r}")
        with open(path, encoding="utf-8", errors="replace") as f:
            if not path.endswith(".jsonl"):
                yield f.read()
                continue
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    doc = json.loads(line)
                except json.JSONDecodeError:
                    raise UsageError(f"--input: {path} line {lineno} is not JSON") from None
                text = doc.get(key) if isinstance(doc, dict) else None
                if not isinstance(text, str):
                    raise UsageError(f"--json-key: {path} line {lineno} has no string {key!r}")
                yield text


@exit_on_usage_error
def main(argv: list[str] | None = None) -> None:
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", nargs="+", required=True, help=".jsonl (one document per line) or plain-text files")
    p.add_argument("--json-key", default="text")
    p.add_argument("--output", required=True, help="vocab.txt to write")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--min-frequency", type=int, default=2)
    p.add_argument("--cased", action="store_true", help="keep case and accents (BertWordPieceCase)")
    args = p.parse_args(argv)
    if args.vocab_size < 1 or args.min_frequency < 1:
        raise UsageError("--vocab-size and --min-frequency must be positive")
    vocab = train_vocab(_texts(args.input, args.json_key), args.vocab_size, not args.cased, args.min_frequency)
    try:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write("\n".join(vocab) + "\n")
    except OSError as exc:
        raise UsageError(f"--output: cannot write {args.output!r}: {exc.strerror}") from None
    print(f"wrote {len(vocab)} pieces to {args.output}")


if __name__ == "__main__":
    main()
