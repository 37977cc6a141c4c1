"""Tokenizers with one interface: `vocab_size`, `tokenize`, `detokenize`, `eod`.

`build_tokenizer(cfg)` picks one by `cfg.tokenizer_type` (Megatron-LM's names):
- `GPT2BPETokenizer`: byte-level BPE from `vocab.json` + `merges.txt`; eod = `<|endoftext|>`.
- `SentencePieceTokenizer` / `GPTSentencePieceTokenizer` / `Llama2Tokenizer`: a `.model` file; eod = the model's
  eos id (Megatron builds the three names as one SentencePiece tokenizer).
  A model without an eos piece gets one extra id (`piece count`) as eod, and `vocab_size` grows by one.
- `HuggingFaceTokenizer`: a local directory loaded with transformers' AutoTokenizer; eod = its eos token.
- `NullTokenizer`: text is space-separated ids below `cfg.vocab_size`; as in Megatron-LM the
  vocabulary has `vocab_size + 1` entries and eod = `cfg.vocab_size`.
- `BertWordPieceLowerCase` / `BertWordPieceCase`: BERT's WordPiece from a `vocab.txt` (data/wordpiece.py), with
  `cls`, `sep`, `pad`, `mask` ids; [BOS]/[EOS] appended when missing, as Megatron does; eod = [EOS].
- `TikTokenizer`: Megatron's tiktoken vocabulary (a JSON list of base64 tokens; data/tiktoken_bpe.py) behind
  `--tiktoken-num-special-tokens` special tokens; eod = `</s>`. tiktoken encodes when installed, else pure Python.
"""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from functools import lru_cache

from megatron_bmw.config import DataConfig
from megatron_bmw.errors import UsageError


class Tokenizer(ABC):
    """Text <-> token ids."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (before padding for tensor parallelism)."""

    @property
    @abstractmethod
    def eod(self) -> int:
        """End-of-document id appended between documents."""

    @abstractmethod
    def tokenize(self, text: str) -> list[int]: ...

    @abstractmethod
    def detokenize(self, ids: list[int]) -> str: ...


def _require_file(path: str | None, flag: str, what: str) -> str:
    if not path:
        raise UsageError(f"{flag}: required for {what}")
    if os.path.isdir(path):
        raise UsageError(f"{flag}: {path!r} is a directory; give the {what} file")
    if not os.path.isfile(path):
        raise UsageError(f"{flag}: no such file {path!r}")
    return path


class NullTokenizer(Tokenizer):
    """Identity tokenizer: `"3 1 4"` <-> `[3, 1, 4]`; eod is the extra id `vocab_size` (Megatron's convention)."""

    def __init__(self, vocab_size: int | None) -> None:
        if vocab_size is None or vocab_size < 1:
            raise UsageError("--vocab-size: NullTokenizer needs a positive vocab size")
        self._ids = int(vocab_size)

    @property
    def vocab_size(self) -> int:
        return self._ids + 1

    @property
    def eod(self) -> int:
        return self._ids

    def tokenize(self, text: str) -> list[int]:
        out = []
        for token in text.split():
            try:
                value = int(token)
            except ValueError:
                raise UsageError(f"NullTokenizer: {token[:20]!r} is not an integer id") from None
            if not 0 <= value < self.vocab_size:
                raise UsageError(f"NullTokenizer: id {value} outside [0, {self.vocab_size})")
            out.append(value)
        return out

    def detokenize(self, ids: list[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece `.model`; eod is its eos id (or one extra id when the model has none)."""

    def __init__(self, model_file: str | None) -> None:
        path = _require_file(model_file, "--tokenizer-model", "SentencePieceTokenizer")
        import sentencepiece

        self._sp = sentencepiece.SentencePieceProcessor()
        try:
            self._sp.Load(path)
        except (OSError, RuntimeError) as exc:
            raise UsageError(f"--tokenizer-model: {path!r} is not a SentencePiece model ({exc})") from None
        self._pieces = self._sp.GetPieceSize()
        eos = self._sp.eos_id()
        self._eod = eos if eos >= 0 else self._pieces
        self._extra = 0 if eos >= 0 else 1

    @property
    def vocab_size(self) -> int:
        return self._pieces + self._extra

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> list[int]:
        return list(self._sp.EncodeAsIds(text))

    def detokenize(self, ids: list[int]) -> str:
        return self._sp.DecodeIds([int(i) for i in ids if 0 <= int(i) < self._pieces])


@lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (printable latin-1 bytes map to themselves)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


# Pre-tokenisation of GPT-2: English contractions, letter runs, digit runs, other symbols, whitespace.
_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


class GPT2BPETokenizer(Tokenizer):
    """Byte-level BPE (GPT-2 style) from `vocab.json` and `merges.txt`; eod = `<|endoftext|>`."""

    def __init__(self, vocab_file: str | None, merge_file: str | None) -> None:
        vocab_path = _require_file(vocab_file, "--vocab-file", "GPT2BPETokenizer")
        merge_path = _require_file(merge_file, "--merge-file", "GPT2BPETokenizer")
        import regex

        try:
            with open(vocab_path, encoding="utf-8") as f:
                self._encoder: dict[str, int] = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise UsageError(f"--vocab-file: {vocab_path!r} is not JSON ({exc})") from None
        if not isinstance(self._encoder, dict):
            raise UsageError(f"--vocab-file: {vocab_path!r} is not a token -> id JSON object")
        self._decoder = {v: k for k, v in self._encoder.items()}
        self._ranks: dict[tuple[str, str], int] = {}
        with open(merge_path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                line = line.rstrip("\n")
                if not line or line.startswith("#version"):
                    continue
                parts = line.split(" ")
                if len(parts) != 2:
                    raise UsageError(f"--merge-file: {merge_path!r} line {lineno} is not 'left right'")
                self._ranks.setdefault((parts[0], parts[1]), len(self._ranks))
        if "<|endoftext|>" not in self._encoder:
            raise UsageError(f"--vocab-file: {vocab_path!r} has no '<|endoftext|>' token")
        self._eod = self._encoder["<|endoftext|>"]
        self._byte_char = byte_to_unicode()
        self._char_byte = {c: b for b, c in self._byte_char.items()}
        self._split = regex.compile(_GPT2_SPLIT)
        self._cache: dict[str, list[int]] = {}

    @property
    def vocab_size(self) -> int:
        return len(self._encoder)

    @property
    def eod(self) -> int:
        return self._eod

    def _bpe(self, word: str) -> list[str]:
        parts = list(word)
        ranks = self._ranks
        while len(parts) > 1:
            best, best_rank = -1, None
            for i in range(len(parts) - 1):
                rank = ranks.get((parts[i], parts[i + 1]))
                if rank is not None and (best_rank is None or rank < best_rank):
                    best, best_rank = i, rank
            if best < 0:
                break
            pair = (parts[best], parts[best + 1])
            merged: list[str] = []
            i = 0
            while i < len(parts):
                if i < len(parts) - 1 and (parts[i], parts[i + 1]) == pair:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        return parts

    def _encode_word(self, word: str) -> list[int]:
        ids = self._cache.get(word)
        if ids is None:
            chars = "".join(self._byte_char[b] for b in word.encode("utf-8"))
            try:
                ids = [self._encoder[p] for p in self._bpe(chars)]
            except KeyError as exc:
                raise UsageError(f"--vocab-file: BPE piece {exc.args[0]!r} missing from the vocabulary") from None
            if len(self._cache) < 100_000:
                self._cache[word] = ids
        return ids

    def tokenize(self, text: str) -> list[int]:
        out: list[int] = []
        for word in self._split.findall(text):
            out.extend(self._encode_word(word))
        return out

    def detokenize(self, ids: list[int]) -> str:
        chars = "".join(self._decoder[int(i)] for i in ids)
        return bytes(self._char_byte[c] for c in chars).decode("utf-8", errors="replace")


class HuggingFaceTokenizer(Tokenizer):
    """transformers' AutoTokenizer loaded from a local directory; eod = its eos token."""

    def __init__(self, model_dir: str | None) -> None:
        if not model_dir:
            raise UsageError("--tokenizer-model: required for HuggingFaceTokenizer (a local directory)")
        if not os.path.isdir(model_dir):
            raise UsageError(f"--tokenizer-model: no such directory {model_dir!r}")
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise UsageError("--tokenizer-type: HuggingFaceTokenizer needs the 'transformers' package") from None
        try:
            self._tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        except (OSError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UsageError(f"--tokenizer-model: cannot load a tokenizer from {model_dir!r}: {first}") from None
        if self._tok.eos_token_id is None:
            raise UsageError(f"--tokenizer-model: tokenizer in {model_dir!r} has no eos token")

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def eod(self) -> int:
        return int(self._tok.eos_token_id)

    def tokenize(self, text: str) -> list[int]:
        return list(self._tok(text).input_ids)

    def detokenize(self, ids: list[int]) -> str:
        return self._tok.decode([int(i) for i in ids])


class BertWordPieceTokenizer(Tokenizer):
    """BERT WordPiece (lower-cased and accent-stripped, or cased) from a one-piece-per-line vocabulary file."""

    def __init__(self, vocab_file: str | None, lower_case: bool) -> None:
        from .wordpiece import WordPiece, read_vocab

        self.lower_case = lower_case
        self.inv_vocab = read_vocab(vocab_file)
        self.vocab = {piece: i for i, piece in enumerate(self.inv_vocab)}
        for extra in ("[BOS]", "[EOS]"):
            if extra not in self.vocab:
                self.vocab[extra] = len(self.inv_vocab)
                self.inv_vocab.append(extra)
        self.cls, self.sep, self.pad, self.mask = (self.vocab[t] for t in ("[CLS]", "[SEP]", "[PAD]", "[MASK]"))
        self._wordpiece = WordPiece(self.vocab)

    @property
    def vocab_size(self) -> int:
        return len(self.inv_vocab)

    @property
    def eod(self) -> int:
        return self.vocab["[EOS]"]

    def pieces(self, text: str) -> list[str]:
        from .wordpiece import basic_tokenize

        return [p for word in basic_tokenize(text, self.lower_case) for p in self._wordpiece.split(word)]

    def tokenize(self, text: str) -> list[int]:
        return [self.vocab[p] for p in self.pieces(text)]

    def detokenize(self, ids: list[int]) -> str:
        from .wordpiece import detokenize_pieces

        return detokenize_pieces([self.inv_vocab[int(i)] for i in ids])


class TikTokenizer(Tokenizer):
    """Megatron-LM's TikTokenizer: special tokens take ids [0, n) (`<unk> <s> </s> <mask> <pad> <cls> <sep>` by
    default, then `<SPECIAL_i>`), the vocabulary file's rank r id r + n; eod = eos = `</s>`, bos = `<s>`."""

    def __init__(self, model_file: str | None, pattern: str | None = None, num_special_tokens: int = 1000,
                 special_tokens: list[str] | None = None, vocab_size: int | None = None,
                 use_tiktoken: bool | None = None) -> None:
        from . import tiktoken_bpe as tb

        path = _require_file(model_file, "--tokenizer-model", "TikTokenizer")
        pattern = tb.DEFAULT_PATTERN if pattern is None else pattern
        if pattern not in tb.PATTERNS:
            raise UsageError(f"--tiktoken-pattern: unknown {pattern!r} (v1 or v2)")
        self.special_tokens = tb.special_tokens(special_tokens, num_special_tokens)
        tokens = tb.read_ranks(path)
        self._vocab = tb.vocabulary_size(len(tokens), num_special_tokens, vocab_size)
        self._bytes = [s.encode("utf-8") for s in self.special_tokens] + tokens[:self._vocab - num_special_tokens]
        ranks = {t: i for i, t in enumerate(self._bytes) if i >= num_special_tokens}
        name = os.path.basename(os.path.dirname(os.path.abspath(path))) or "tiktoken"
        self._encoder = tb.build_encoder(ranks, self.special_tokens, tb.PATTERNS[pattern], name, use_tiktoken)
        ids = {t: i for i, t in enumerate(self.special_tokens)}
        self.unk, self.bos, self.eos, self.mask, self.pad, self.cls, self.sep = (ids[t] for t in tb.SPECIAL_TOKENS)

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def eod(self) -> int:
        return self.eos

    @property
    def uses_tiktoken(self) -> bool:
        return hasattr(self._encoder, "encoding")

    def tokenize(self, text: str) -> list[int]:
        return self._encoder.encode(text)

    def detokenize(self, ids: list[int]) -> str:
        """The ids' bytes joined (a special token as its text), then UTF-8 with replacement, as tiktoken decodes."""
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < self._vocab:
                raise UsageError(f"TikTokenizer: id {i} outside [0, {self._vocab})")
            out.append(self._bytes[i])
        return b"".join(out).decode("utf-8", errors="replace")


SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
TOKENIZER_TYPES = ("GPT2BPETokenizer", *SENTENCEPIECE_TYPES, "HuggingFaceTokenizer", "NullTokenizer",
                   "BertWordPieceLowerCase", "BertWordPieceCase", "TikTokenizer")


def build_tokenizer(cfg: DataConfig) -> Tokenizer:
    """Build the tokenizer named by `cfg.tokenizer_type`."""
    kind = cfg.tokenizer_type
    if kind is None:
        raise UsageError(f"--tokenizer-type: required (one of {', '.join(TOKENIZER_TYPES)})")
    if cfg.special_tokens is not None and kind != "TikTokenizer":
        raise UsageError(f"--tokenizer-special-tokens: taken by TikTokenizer only here, not {kind}")
    if kind == "GPT2BPETokenizer":
        return GPT2BPETokenizer(cfg.vocab_file, cfg.merge_file)
    if kind in SENTENCEPIECE_TYPES:
        return SentencePieceTokenizer(cfg.tokenizer_model)
    if kind == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(cfg.tokenizer_model)
    if kind == "NullTokenizer":
        return NullTokenizer(cfg.vocab_size)
    if kind in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        return BertWordPieceTokenizer(cfg.vocab_file, lower_case=kind == "BertWordPieceLowerCase")
    if kind == "TikTokenizer":
        return TikTokenizer(cfg.tokenizer_model, cfg.tiktoken_pattern, cfg.tiktoken_num_special_tokens,
                            cfg.special_tokens, cfg.vocab_size)
    raise UsageError(f"--tokenizer-type: unknown {kind!r} (one of {', '.join(TOKENIZER_TYPES)})")
