"""Train a SentencePiece tokenizer on the text of a JSONL file (for --tokenizer-type SentencePieceTokenizer).

    python tools/train_sentencepiece.py --input corpus.jsonl --model-prefix spm --vocab-size 4000 --model-type bpe
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_bmw.errors import OneLineParser, UsageError, exit_on_usage_error  # noqa: E402

MIN_VOCAB = 3 + 256  # unk, bos, eos and the 256 byte-fallback pieces


@exit_on_usage_error
def main(argv: list[str] | None = None) -> None:
    p = OneLineParser(description=__doc__)
    p.add_argument("--input", required=True, help="JSONL file")
    p.add_argument("--json-key", default="text")
    p.add_argument("--model-prefix", required=True)
    p.add_argument("--vocab-size", type=int, default=4000)
    p.add_argument("--model-type", choices=["bpe", "unigram", "char", "word"], default="bpe")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    if not os.path.isfile(args.input):
        raise UsageError(f"--input {args.input}: no such file")
    if args.vocab_size < MIN_VOCAB:
        raise UsageError(f"--vocab-size must be >= {MIN_VOCAB} (the special and byte-fallback pieces), "
                         f"got {args.vocab_size}")
    if args.threads < 1:
        raise UsageError(f"--threads must be >= 1, got {args.threads}")
    folder = os.path.dirname(os.path.abspath(args.model_prefix))
    if not os.path.isdir(folder):
        raise UsageError(f"--model-prefix {args.model_prefix}: folder {folder} does not exist")
    import sentencepiece as spm

    bad: list[UsageError] = []  # raised inside the iterator, SentencePiece rewraps it as a RuntimeError

    def sentences():
        try:
            yield from _sentences()
        except UsageError as exc:
            bad.append(exc)
            raise

    def _sentences():
        with open(args.input, encoding="utf-8", errors="replace") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)[args.json_key]
                except json.JSONDecodeError:
                    raise UsageError(f"--input {args.input}: line {n} is not JSON") from None
                except (KeyError, TypeError):
                    raise UsageError(f"--json-key: key {args.json_key!r} is missing in {args.input} line {n}") from None
                if not isinstance(text, str):
                    raise UsageError(f"--json-key: {args.json_key!r} is not a string in {args.input} line {n}")
                for piece in text.split("\n"):
                    if piece.strip():
                        yield piece

    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=sentences(), model_prefix=args.model_prefix, vocab_size=args.vocab_size,
            model_type=args.model_type, character_coverage=1.0, num_threads=args.threads, byte_fallback=True,
            eos_id=2, bos_id=1, pad_id=-1, unk_id=0, minloglevel=2)
    except (RuntimeError, UsageError) as exc:  # SentencePiece's own refusals, e.g. a vocabulary too large
        if bad:
            raise bad[0] from None
        message = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"--input {args.input}: SentencePiece cannot train on it ({message})") from None
    print(f"wrote {args.model_prefix}.model ({args.vocab_size} pieces)")


if __name__ == "__main__":
    main()
