"""Train a SentencePiece tokenizer on the text of a JSONL file (for --tokenizer-type SentencePieceTokenizer).

    python tools/train_sentencepiece.py --input corpus.jsonl --model-prefix spm --vocab-size 4000 --model-type bpe
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_bmw.errors import UsageError, exit_on_usage_error  # noqa: E402


@exit_on_usage_error
def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--input", required=True, help="JSONL file")
    p.add_argument("--json-key", default="text")
    p.add_argument("--model-prefix", required=True)
    p.add_argument("--vocab-size", type=int, default=4000)
    p.add_argument("--model-type", choices=["bpe", "unigram", "char", "word"], default="bpe")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    if not os.path.isfile(args.input):
        raise UsageError(f"--input {args.input}: no such file")
    import sentencepiece as spm

    def sentences():
        with open(args.input, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    for piece in json.loads(line)[args.json_key].split("\n"):
                        if piece.strip():
                            yield piece

    spm.SentencePieceTrainer.train(
        sentence_iterator=sentences(), model_prefix=args.model_prefix, vocab_size=args.vocab_size,
        model_type=args.model_type, character_coverage=1.0, num_threads=args.threads, byte_fallback=True,
        eos_id=2, bos_id=1, pad_id=-1, unk_id=0, minloglevel=2)
    print(f"wrote {args.model_prefix}.model ({args.vocab_size} pieces)")


if __name__ == "__main__":
    main()
