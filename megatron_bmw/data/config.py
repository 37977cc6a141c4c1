"""Data configuration for pretraining: where the data lives, how it is split and tokenized."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from megatron_bmw.errors import UsageError


@dataclass
class DataConfig:
    """Everything the data layer needs; field names follow Megatron-LM's flags (`--data-path` -> data_path)."""

    data_path: list[str] = field(default_factory=list)
    split: str = "969,30,1"
    data_cache_path: str | None = None
    tokenizer_type: str | None = None
    tokenizer_model: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    vocab_size: int | None = None
    mock_data: bool = False


def _as_float(token: str) -> float | None:
    try:
        return float(token)
    except ValueError:
        return None


def parse_data_path(data_path: list[str]) -> list[tuple[float, str]]:
    """Parse Megatron's `--data-path` into `[(weight, prefix), ...]` with weights summing to 1.

    Accepted forms: `[prefix]`, `[prefix1, prefix2, ...]` (equal weights) and
    `[w1, prefix1, w2, prefix2, ...]`. The weighted form is recognised by a number as first token.
    """
    if not data_path:
        raise UsageError("--data-path: no data prefix given")
    if len(data_path) == 1:
        return [(1.0, data_path[0])]
    if _as_float(data_path[0]) is None:
        numeric = [t for t in data_path if _as_float(t) is not None]
        if numeric:
            raise UsageError(
                f"--data-path: mixes prefixes and weights ({numeric[0]!r}); use 'w1 prefix1 w2 prefix2 ...'"
            )
        return [(1.0 / len(data_path), p) for p in data_path]
    if len(data_path) % 2:
        raise UsageError(f"--data-path: weighted form needs weight/prefix pairs, got {len(data_path)} tokens")
    pairs: list[tuple[float, str]] = []
    for raw_weight, prefix in zip(data_path[0::2], data_path[1::2]):
        weight = _as_float(raw_weight)
        if weight is None or not math.isfinite(weight) or weight < 0:
            raise UsageError(f"--data-path: weight {raw_weight!r} is not a non-negative number")
        pairs.append((weight, prefix))
    total = sum(w for w, _ in pairs)
    if total <= 0:
        raise UsageError("--data-path: weights sum to zero")
    return [(w / total, p) for w, p in pairs]
