"""The data layer's settings; field names follow Megatron-LM's flags."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..errors import UsageError
from .schema import check_ranges, flag

D, B = "data", "bert"  # flag groups


def parse_split(split: str) -> list[float]:
    """`"969,30,1"` (or `"969/30/1"`) -> three normalised weights for train/valid/test."""
    parts = re.split(r"[,/]", split.strip())
    if not 1 <= len(parts) <= 3:
        raise UsageError(f"--split: expected up to 3 weights like '969,30,1', got {split!r}")
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        raise UsageError(f"--split: {split!r} is not a list of numbers") from None
    if any(not math.isfinite(w) for w in weights) or not math.isfinite(sum(weights)):
        raise UsageError(f"--split: weights in {split!r} must be finite numbers (only their ratios count)")
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise UsageError(f"--split: weights in {split!r} must be non-negative with a positive sum")
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    return [w / total for w in weights]


@dataclass
class DataConfig:
    """Everything the data layer needs; field names follow Megatron-LM's flags (`--data-path` -> data_path)."""

    data_path: list[str] = flag("--data-path", group=D, default_factory=list, cli_default=None, nargs="*")
    split: str = flag("--split", group=D, default="969,30,1")
    data_cache_path: str | None = flag("--data-cache-path", group=D, default=None)
    tokenizer_type: str | None = flag("--tokenizer-type", group=D, default=None)
    tokenizer_model: str | None = flag("--tokenizer-model", group=D, default=None)
    vocab_file: str | None = flag("--vocab-file", group=D, default=None)
    merge_file: str | None = flag("--merge-file", group=D, default=None)
    vocab_size: int | None = flag("--vocab-size", group=D, default=None)  # the tokenizer's, before padding
    # TikTokenizer (data/tiktoken_bpe.py); Megatron's --tiktoken-special-tokens is its older spelling
    tiktoken_pattern: str | None = flag("--tiktoken-pattern", group=D, default=None, choices=("v1", "v2"),
                                        help="TikTokenizer's pre-tokenisation regex (default v2)")
    tiktoken_num_special_tokens: int = flag("--tiktoken-num-special-tokens", group=D, default=1000, minimum=0,
                                            help="TikTokenizer's special-token ids, before the ranks' (default 1000)")
    special_tokens: list[str] | None = flag("--tokenizer-special-tokens", "--tiktoken-special-tokens", group=D,
                                            default=None, nargs="+",
                                            help="TikTokenizer's special tokens (default <unk> <s> </s> <mask> "
                                                 "<pad> <cls> <sep>)")
    mock_data: bool = flag("--mock-data", group=D, default=False, action="store_true")
    # BERT samples (data/bert_dataset.py)
    mask_prob: float = flag("--mask-prob", group=B, default=0.15, above=0.0, below=1.0,
                            help="fraction of tokens to predict (default 0.15)")
    short_seq_prob: float = flag("--short-seq-prob", group=B, default=0.1, minimum=0.0, maximum=1.0,
                                 help="probability of a sample shorter than --seq-length (default 0.1)")
    whole_word_masking: bool = flag("--no-whole-word-masking", group=B, default=True, action="store_false",
                                    help="mask WordPiece pieces independently instead of whole words")
    masking_max_ngram: int = flag("--masking-max-ngram", group=B, default=3, minimum=1,
                                  help="longest masked n-gram of words (default 3)")

    def __post_init__(self) -> None:
        # Megatron reads the numbers out of --split: quotes a launch script kept, or spaces, do not matter
        self.split = re.sub(r"[\s'\"]", "", str(self.split))
        parse_split(self.split)
        check_ranges(self)

