"""BERT's WordPiece tokenizer (Megatron's BertWordPieceLowerCase / BertWordPieceCase), without dependencies.

Two stages, as in Google's original BERT and Megatron's FullBertTokenizer:
- basic tokenization: drop control characters, map whitespace to spaces, put spaces around CJK ideographs,
  split on whitespace; lower case and strip accents (NFD, marks removed) for the lower-case variant; split every
  punctuation character off as its own token;
- WordPiece: each token becomes the longest vocabulary pieces from its start, later pieces prefixed `##`; a token
  with no such split (or longer than 100 characters) becomes `[UNK]`.
The vocabulary file has one piece per line (id = line number) and needs [CLS], [SEP], [MASK], [PAD] and [UNK].
As Megatron, [BOS] and [EOS] are appended when missing (so the vocabulary is the file's plus up to two), and
the end-of-document id is [EOS].
"""

from __future__ import annotations

import heapq
import os
import unicodedata

from megatron_bmw.errors import UsageError

SPECIAL = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
MAX_WORD_CHARS = 100


def _is_whitespace(ch: str) -> bool:
    return ch in " \t\n\r" or unicodedata.category(ch) == "Zs"


def _is_control(ch: str) -> bool:
    return ch not in "\t\n\r" and unicodedata.category(ch) in ("Cc", "Cf")


def _is_punctuation(ch: str) -> bool:
    cp = ord(ch)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True  # ASCII symbols count as punctuation, as in BERT
    return unicodedata.category(ch).startswith("P")


def _is_cjk(cp: int) -> bool:
    return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF or 0x2A700 <= cp <= 0x2B73F
            or 0x2B740 <= cp <= 0x2B81F or 0x2B820 <= cp <= 0x2CEAF or 0xF900 <= cp <= 0xFAFF
            or 0x2F800 <= cp <= 0x2FA1F)


def basic_tokenize(text: str, lower_case: bool) -> list[str]:
    """BERT's basic tokenization: words and single punctuation characters."""
    chars = []
    for ch in text:
        cp = ord(ch)
        if cp == 0 or cp == 0xFFFD or _is_control(ch):
            continue
        if _is_whitespace(ch):
            chars.append(" ")
        elif _is_cjk(cp):
            chars.append(f" {ch} ")
        else:
            chars.append(ch)
    out: list[str] = []
    for word in "".join(chars).split():
        if lower_case:
            word = "".join(c for c in unicodedata.normalize("NFD", word.lower()) if unicodedata.category(c) != "Mn")
        start = 0
        for i, ch in enumerate(word):
            if _is_punctuation(ch):
                if i > start:
                    out.append(word[start:i])
                out.append(ch)
                start = i + 1
        if start < len(word):
            out.append(word[start:])
    return out


def read_vocab(path: str | None, flag: str = "--vocab-file") -> list[str]:
    if not path:
        raise UsageError(f"{flag}: required for the BERT WordPiece tokenizers (one piece per line)")
    if not os.path.isfile(path):
        raise UsageError(f"{flag}: no such file {path!r}")
    try:
        with open(path, encoding="utf-8") as f:
            pieces = [line.rstrip("\n").rstrip("\r") for line in f]
    except UnicodeDecodeError as exc:
        raise UsageError(f"{flag}: {path!r} is not UTF-8 text ({exc.reason})") from None
    while pieces and pieces[-1] == "":
        pieces.pop()
    missing = [t for t in SPECIAL if t not in pieces]
    if missing:
        raise UsageError(f"{flag}: {path!r} is not a BERT WordPiece vocabulary (missing {', '.join(missing)})")
    return pieces


class WordPiece:
    """Greedy longest-match-first WordPiece over a vocabulary."""

    def __init__(self, vocab: dict[str, int], unk: str = "[UNK]") -> None:
        self.vocab, self.unk = vocab, unk
        self._cache: dict[str, list[str]] = {}

    def split(self, word: str) -> list[str]:
        got = self._cache.get(word)
        if got is None:
            got = self._split(word)
            if len(self._cache) < 200_000:
                self._cache[word] = got
        return got

    def _split(self, word: str) -> list[str]:
        if len(word) > MAX_WORD_CHARS:
            return [self.unk]
        pieces, start = [], 0
        while start < len(word):
            end = len(word)
            while end > start:
                piece = word[start:end] if start == 0 else "##" + word[start:end]
                if piece in self.vocab:
                    break
                end -= 1
            if end == start:  # no piece fits: the whole word is unknown
                return [self.unk]
            pieces.append(piece)
            start = end
        return pieces


def detokenize_pieces(pieces: list[str]) -> str:
    return " ".join(pieces).replace(" ##", "").replace("##", "")


def train_vocab(texts, vocab_size: int, lower_case: bool = True, min_frequency: int = 2) -> list[str]:
    """A WordPiece vocabulary learned from `texts` (an iterable of strings): the special tokens, every character
    seen (alone and as a `##` continuation), then pieces merged from the most frequent adjacent pairs of the
    words' pieces (the BPE-style training WordPiece vocabularies are usually built with), until `vocab_size`
    pieces or no pair occurs `min_frequency` times. Deterministic: ties go to the first pair in sorted order."""
    counts: dict[str, int] = {}
    for text in texts:
        for word in basic_tokenize(text, lower_case):
            counts[word] = counts.get(word, 0) + 1
    alphabet = sorted({ch for word in counts for ch in word})
    vocab = list(SPECIAL) + alphabet + ["##" + ch for ch in alphabet]
    if vocab_size < len(vocab):
        raise UsageError(f"--vocab-size {vocab_size}: the special tokens and the corpus's {len(alphabet)} characters "
                         f"(with their ## forms) already need {len(vocab)}")
    known = set(vocab)
    words = [[w[0]] + ["##" + c for c in w[1:]] for w in sorted(counts)]
    freq = [counts[w] for w in sorted(counts)]
    pair_count: dict[tuple[str, str], int] = {}
    where: dict[tuple[str, str], set[int]] = {}
    for i, syms in enumerate(words):
        for pair in zip(syms, syms[1:]):
            pair_count[pair] = pair_count.get(pair, 0) + freq[i]
            where.setdefault(pair, set()).add(i)
    changed: set[tuple[str, str]] = set()
    heap = [(-n, pair) for pair, n in pair_count.items()]
    heapq.heapify(heap)
    while len(vocab) < vocab_size and heap:
        n, best = heapq.heappop(heap)
        if pair_count.get(best) != -n:  # stale: the pair's count changed (its current entry is also queued)
            continue
        if -n < min_frequency:
            break
        merged = best[0] + best[1][2:]
        for i in sorted(where.pop(best, ())):
            syms = words[i]
            for pair in zip(syms, syms[1:]):  # forget this word's pairs, then count its new ones
                changed.add(pair)
                pair_count[pair] -= freq[i]
                if pair_count[pair] <= 0:
                    del pair_count[pair]
                if pair != best and pair in where:
                    where[pair].discard(i)
            out, j = [], 0
            while j < len(syms):
                if j + 1 < len(syms) and (syms[j], syms[j + 1]) == best:
                    out.append(merged)
                    j += 2
                else:
                    out.append(syms[j])
                    j += 1
            words[i] = out
            for pair in zip(out, out[1:]):
                pair_count[pair] = pair_count.get(pair, 0) + freq[i]
                where.setdefault(pair, set()).add(i)
                changed.add(pair)
        pair_count.pop(best, None)
        for pair in changed:
            if pair in pair_count:
                heapq.heappush(heap, (-pair_count[pair], pair))
        changed.clear()
        if merged not in known:
            known.add(merged)
            vocab.append(merged)
    return vocab
