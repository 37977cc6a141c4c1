"""Megatron-LM's TikTokenizer vocabulary and its byte-level BPE (data/tokenizers.py's `TikTokenizer` wraps it).

The vocabulary file (`--tokenizer-model`) is a JSON list of `{"rank", "token_bytes" (base64), "token_str"}`, entry i
of rank i, the first 256 the single bytes. The special tokens (`--tokenizer-special-tokens`, default Megatron's
`<unk> <s> </s> <mask> <pad> <cls> <sep>`, then `<SPECIAL_{i}>` fillers up to `--tiktoken-num-special-tokens`)
take ids [0, n); rank r becomes id r + n. The vocabulary holds `--vocab-size` ids when given (the file cut to its
first `vocab_size - n` ranks, as Megatron does), else the file's ranks + n, at most Megatron's 2**17.

Encoding is tiktoken's: the text is split at special-token strings (each becomes its id, as Megatron's
`encode(allowed_special="all")`), the rest by the pattern regex (`--tiktoken-pattern` v1 or v2), and each piece
that is not itself a token is merged from its bytes, always the leftmost adjacent pair of lowest rank first. The
`tiktoken` package does it when importable (built from these ranks; nothing is downloaded), otherwise `BytePairBPE`
here, with the same ids.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from megatron_bmw.errors import UsageError

PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
DEFAULT_PATTERN = "v2"  # Megatron's when --tiktoken-pattern is not given
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>")  # Megatron's, each required
DEFAULT_MAX_VOCAB = 2**17  # Megatron's vocabulary without --vocab-size
_BAD_FILE = "is not a TikTokenizer vocabulary (a JSON list of {rank, token_bytes, token_str})"


def read_ranks(path: str) -> list[bytes]:
    """The vocabulary file's tokens in rank order; one line naming the file and the entry when it is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            entries = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"--tokenizer-model: {path!r} {_BAD_FILE}: not JSON ({exc})") from None
    except OSError as exc:
        raise UsageError(f"--tokenizer-model: cannot read {path!r} ({exc.strerror})") from None
    if not isinstance(entries, list) or not entries:
        raise UsageError(f"--tokenizer-model: {path!r} {_BAD_FILE}: not a non-empty JSON list")
    tokens, seen = [], set()
    for i, entry in enumerate(entries):
        token = _entry_bytes(entry, i, path)
        if token in seen:
            raise UsageError(f"--tokenizer-model: {path!r} entry {i}: token_bytes repeat an earlier entry")
        seen.add(token)
        tokens.append(token)
    if len(tokens) < 256:
        raise UsageError(f"--tokenizer-model: {path!r} has {len(tokens)} entries; the first 256 must be the bytes")
    return tokens


def _entry_bytes(entry: Any, i: int, path: str) -> bytes:
    where = f"--tokenizer-model: {path!r} entry {i}"
    if not isinstance(entry, dict) or set(entry) != {"rank", "token_bytes", "token_str"}:
        raise UsageError(f"{where} {_BAD_FILE}")
    if entry["rank"] != i or isinstance(entry["rank"], bool):
        raise UsageError(f"{where}: rank {entry['rank']!r}, expected {i} (entries in rank order)")
    try:
        token = base64.b64decode(entry["token_bytes"], validate=True)
    except (binascii.Error, TypeError, ValueError):
        raise UsageError(f"{where}: token_bytes is not base64") from None
    if not token or (i < 256 and token != bytes([i])):
        raise UsageError(f"{where}: token_bytes must be the byte {i}" if i < 256 else f"{where}: empty token_bytes")
    return token


def special_tokens(given: list[str] | None, count: int) -> list[str]:
    """The special tokens, ids 0..count-1: `given` (or Megatron's list), then `<SPECIAL_{i}>` fillers."""
    names = list(SPECIAL_TOKENS if given is None else given)
    if len(set(names)) != len(names):
        raise UsageError(f"--tokenizer-special-tokens: a token is repeated in {names}")
    missing = [t for t in SPECIAL_TOKENS if t not in names]
    if missing:
        raise UsageError(f"--tokenizer-special-tokens: must include {' '.join(SPECIAL_TOKENS)} (missing "
                         f"{' '.join(missing)})")
    if any(not t for t in names):
        raise UsageError("--tokenizer-special-tokens: an empty token")
    if count < len(names):
        raise UsageError(f"--tiktoken-num-special-tokens: {count} is fewer than the {len(names)} special tokens")
    names += [f"<SPECIAL_{i}>" for i in range(len(names), count)]
    if len(set(names)) != count:
        raise UsageError(f"--tokenizer-special-tokens: a token is named like a filler <SPECIAL_i> in {names[:count]}")
    return names


def vocabulary_size(file_ranks: int, num_special: int, vocab_size: int | None) -> int:
    """Megatron's rule: --vocab-size when given (the file must hold its ranks), else the file, at most 2**17."""
    if vocab_size is None:
        return min(file_ranks + num_special, max(DEFAULT_MAX_VOCAB, num_special + 256))
    if vocab_size <= num_special:
        raise UsageError(f"--vocab-size: {vocab_size} must exceed --tiktoken-num-special-tokens {num_special}")
    if vocab_size - num_special < 256:
        raise UsageError(f"--vocab-size: {vocab_size} leaves {vocab_size - num_special} ranks after the "
                         f"{num_special} special tokens; the 256 bytes need 256")
    if vocab_size > file_ranks + num_special:
        raise UsageError(f"--vocab-size: {vocab_size} needs {vocab_size - num_special} ranks after the {num_special} "
                         f"special tokens; --tokenizer-model has {file_ranks}")
    return vocab_size


class BytePairBPE:
    """tiktoken's encoding in pure Python: `ranks` token bytes -> id, `specials` the special tokens (id = index)."""

    def __init__(self, ranks: dict[bytes, int], specials: list[str], pattern: str) -> None:
        import regex

        self._ranks = ranks
        self._split = regex.compile(pattern)
        # longest first: a special token that starts with another one wins (tiktoken leaves that order open)
        self._special = regex.compile("|".join(regex.escape(s) for s in sorted(specials, key=len, reverse=True)))
        self._special_ids = {s: i for i, s in enumerate(specials)}
        self._cache: dict[str, list[int]] = {}

    def encode(self, text: str) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates: replaced, as tiktoken does
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        out: list[int] = []
        start = 0
        for m in self._special.finditer(text):
            self._encode_ordinary(text[start:m.start()], out)
            out.append(self._special_ids[m.group()])
            start = m.end()
        self._encode_ordinary(text[start:], out)
        return out

    def _encode_ordinary(self, text: str, out: list[int]) -> None:
        for piece in self._split.findall(text):
            ids = self._cache.get(piece)
            if ids is None:
                data = piece.encode("utf-8")
                token = self._ranks.get(data)
                ids = [token] if token is not None else self._merge(data)
                if len(self._cache) < 100_000:
                    self._cache[piece] = ids
            out.extend(ids)

    def _merge(self, data: bytes) -> list[int]:
        """The piece's bytes merged pair by pair: the leftmost adjacent pair of lowest rank first."""
        ranks = self._ranks
        parts = [data[i:i + 1] for i in range(len(data))]
        while len(parts) > 1:
            best, best_rank = -1, None
            for i in range(len(parts) - 1):
                rank = ranks.get(parts[i] + parts[i + 1])
                if rank is not None and (best_rank is None or rank < best_rank):
                    best, best_rank = i, rank
            if best < 0:
                break
            parts[best:best + 2] = [parts[best] + parts[best + 1]]
        return [ranks[p] for p in parts]


def build_encoder(ranks: dict[bytes, int], specials: list[str], pattern: str, name: str, use_tiktoken: bool | None):
    """An object with `encode(text, allowed_special="all")`-like `encode(text)`: tiktoken's Encoding when
    `use_tiktoken` (None: when importable), else `BytePairBPE`."""
    if use_tiktoken is not False:
        try:
            import tiktoken
        except ImportError:
            if use_tiktoken:
                raise UsageError("--tokenizer-type: the 'tiktoken' package is not installed") from None
        else:
            enc = tiktoken.Encoding(name=name, pat_str=pattern, mergeable_ranks=ranks,
                                    special_tokens={s: i for i, s in enumerate(specials)})
            return _TiktokenEncoder(enc)
    return BytePairBPE(ranks, specials, pattern)


class _TiktokenEncoder:
    def __init__(self, enc) -> None:
        self.encoding = enc

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode(text, allowed_special="all")
