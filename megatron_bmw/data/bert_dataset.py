"""BERT pretraining samples from sentence-split documents (`preprocess_data.py --split-sentences`), following
Megatron-LM's BERT dataset.

The sample index lists, per sample, a run of consecutive sentences of one document and the sample's target length:
documents are walked in order, epoch after epoch until enough samples exist; a target length is drawn (with
probability `short_seq_prob` a random one in [2, max], else the maximum, max = seq_length - 3 for [CLS] and two
[SEP]), sentences are gathered until the target is reached (keeping at least `min_sentences` for the sample and,
unless the document ends, for the next), and the samples are shuffled. Documents with fewer sentences than
needed (two with the sentence-order head) or a sentence over 512 tokens are skipped, as in Megatron.

Sample i is built with `numpy.random.RandomState(seed + i)` alone, so it is the same for every parallel layout:
- sentence order: the sentences split at a random pivot into segment A and B, swapped with probability 1/2
  (label 1 when swapped); without the binary head the whole run is segment A;
- truncation to the target: one token at a time from the longer segment, at its front or back at random;
- [CLS] A [SEP] B [SEP], token types 0 for [CLS] A [SEP] and 1 for B [SEP];
- masking: n-grams of up to `max_ngram` words (probability 1/n), whole words (a `##` piece joins the word before)
  unless `whole_word` is off, until min(mask_prob x target, max(1, round(mask_prob x tokens))) tokens; each
  chosen token becomes [MASK] (80%), a random id of the vocabulary (10%) or stays (10%);
- padding to seq_length with [PAD]; labels -1 except at masked positions.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from megatron_bmw.data.indexed_dataset import IndexedDataset
from megatron_bmw.errors import UsageError

LONG_SENTENCE = 512  # documents with a longer sentence are skipped (Megatron's LONG_SENTENCE_LEN)


@dataclass(frozen=True)
class BertVocab:
    """What sample building needs of the tokenizer."""

    size: int
    cls: int
    sep: int
    pad: int
    mask: int
    continuation: np.ndarray  # bool per id: a `##` piece (continues the word before it)

    @classmethod
    def of(cls, tokenizer) -> BertVocab:
        if not all(hasattr(tokenizer, a) for a in ("cls", "sep", "pad", "mask")):
            raise UsageError(f"--tokenizer-type: BERT needs a WordPiece tokenizer with [CLS], [SEP], [PAD] and [MASK] "
                             f"(BertWordPieceLowerCase or BertWordPieceCase), not {type(tokenizer).__name__}")
        pieces = getattr(tokenizer, "inv_vocab", [])
        cont = np.array([str(p).startswith("##") for p in pieces] + [False] * (tokenizer.vocab_size - len(pieces)))
        return cls(tokenizer.vocab_size, tokenizer.cls, tokenizer.sep, tokenizer.pad, tokenizer.mask, cont)

    @classmethod
    def synthetic(cls, size: int) -> BertVocab:
        """For mock data without a tokenizer: [PAD] 0, [CLS] 1, [SEP] 2, [MASK] 3; every other id a word."""
        if size < 8:
            raise UsageError(f"--vocab-size {size}: BERT mock data needs at least 8 ids (4 special tokens)")
        return cls(size, 1, 2, 0, 3, np.zeros(size, dtype=bool))


@dataclass(frozen=True)
class BertSampleConfig:
    seq_length: int
    mask_prob: float = 0.15
    short_seq_prob: float = 0.1
    binary_head: bool = True
    whole_word: bool = True
    max_ngram: int = 3
    seed: int = 1234

    def __post_init__(self) -> None:
        if self.seq_length < 5:
            raise UsageError(f"--seq-length {self.seq_length}: a BERT sample needs at least 5 positions")
        if not 0.0 < self.mask_prob < 1.0:
            raise UsageError(f"--mask-prob must be in (0, 1), got {self.mask_prob}")
        longest = self.seq_length - 3  # [CLS] and two [SEP]
        if self.mask_prob * longest < 1:  # the budget below: not one token would be masked in any sample
            raise UsageError(f"--seq-length {self.seq_length} with --mask-prob {self.mask_prob:g}: the longest sample "
                             f"({longest} tokens) may mask {self.mask_prob * longest:.2f} tokens, fewer than one, so "
                             "the masked-LM loss would train on nothing; give a longer --seq-length or a larger "
                             "--mask-prob")
        if not 0.0 <= self.short_seq_prob <= 1.0:
            raise UsageError(f"--short-seq-prob must be in [0, 1], got {self.short_seq_prob}")
        if self.max_ngram < 1:
            raise UsageError(f"--masking-max-ngram must be >= 1, got {self.max_ngram}")

    @property
    def min_sentences(self) -> int:
        return 2 if self.binary_head else 1


def build_sample_index(doc_bounds: np.ndarray, sentence_lengths: np.ndarray, num_samples: int, max_length: int,
                       short_seq_prob: float, seed: int, min_sentences: int) -> np.ndarray:
    """[n, 3] int64 rows (first sentence, end sentence, target length), n >= num_samples (whole epochs), shuffled.
    `doc_bounds`: sentence index bounds of the documents (documents d span doc_bounds[d]:doc_bounds[d + 1])."""
    rng = np.random.RandomState(seed % 2**32)

    def target() -> int:
        if short_seq_prob > 0 and rng.random_sample() < short_seq_prob:
            return int(rng.randint(2, max_length + 1))
        return max_length

    usable = []
    for first, end in zip(doc_bounds[:-1].tolist(), doc_bounds[1:].tolist()):
        if end - first >= min_sentences and (end - first == 1 or sentence_lengths[first:end].max() <= LONG_SENTENCE):
            usable.append((first, end))
    if not usable:
        raise UsageError(f"--data-path: no document has {min_sentences} sentence(s) of at most {LONG_SENTENCE} tokens "
                         "(preprocess BERT data with --split-sentences; --bert-no-binary-head needs one sentence)")
    rows: list[tuple[int, int, int]] = []
    while len(rows) < num_samples:
        for first, end in usable:
            start, tokens, want = first, 0, target()
            for k in range(first, end):
                tokens += int(sentence_lengths[k])
                left, taken = end - k - 1, k - start + 1
                if (tokens >= want and left >= min_sentences and taken >= min_sentences) or left == 0:
                    rows.append((start, k + 1, want))
                    start, tokens, want = k + 1, 0, target()
    index = np.asarray(rows, dtype=np.int64)
    np.random.RandomState((seed + 1) % 2**32).shuffle(index)
    return index


def build_sample(sentences: list[np.ndarray], target: int, cfg: BertSampleConfig, vocab: BertVocab,
                 rng: np.random.RandomState) -> dict[str, np.ndarray | int]:
    """One training sample from consecutive sentences (see the module doc)."""
    pivot, swapped = len(sentences), False
    if cfg.binary_head:
        if len(sentences) < 2:
            raise ValueError("the sentence-order head needs two sentences per sample")
        pivot = int(rng.randint(1, len(sentences))) if len(sentences) >= 3 else 1
        swapped = bool(rng.random_sample() < 0.5)
    a = [int(t) for s in sentences[:pivot] for t in s]
    b = [int(t) for s in sentences[pivot:] for t in s]
    if swapped:
        a, b = b, a
    truncated = len(a) + len(b) > target
    while len(a) + len(b) > target:
        longer = a if len(a) > len(b) else b
        del longer[0 if rng.random_sample() < 0.5 else -1]
    tokens = [vocab.cls, *a, vocab.sep] + ([*b, vocab.sep] if b else [])
    types = [0] * (len(a) + 2) + [1] * (len(b) + 1 if b else 0)
    tokens, positions, labels = mask_tokens(tokens, target, cfg, vocab, rng)
    n, pad = len(tokens), cfg.seq_length - len(tokens)
    out_labels = np.full(cfg.seq_length, -1, dtype=np.int64)
    out_labels[positions] = labels
    loss_mask = np.zeros(cfg.seq_length, dtype=np.int64)
    loss_mask[positions] = 1
    return {"text": np.array(tokens + [vocab.pad] * pad, dtype=np.int64),
            "types": np.array(types + [0] * pad, dtype=np.int64),
            "labels": out_labels, "is_random": int(swapped),
            "padding_mask": np.array([1] * n + [0] * pad, dtype=np.int64), "loss_mask": loss_mask,
            "truncated": int(truncated)}


def mask_tokens(tokens: list[int], target: int, cfg: BertSampleConfig, vocab: BertVocab,
                rng: np.random.RandomState) -> tuple[list[int], list[int], list[int]]:
    """(masked tokens, masked positions in order of choice, original ids there)."""
    words: list[list[int]] = []
    for i, t in enumerate(tokens):
        if t in (vocab.cls, vocab.sep):
            continue
        if cfg.whole_word and words and bool(vocab.continuation[t]) and words[-1][-1] == i - 1:
            words[-1].append(i)
        else:
            words.append([i])
    budget = min(cfg.mask_prob * target, max(1, int(round(len(tokens) * cfg.mask_prob))))
    sizes = np.arange(1, cfg.max_ngram + 1)
    probs = 1.0 / sizes
    probs /= probs.sum()
    starts = list(range(len(words)))
    rng.shuffle(starts)
    out = list(tokens)
    positions: list[int] = []
    chosen: set[int] = set()
    for w in starts:
        if len(positions) >= budget:
            break
        n = int(rng.choice(sizes, p=probs))
        while n > 0:  # back off to shorter n-grams until one fits the budget
            span = [i for word in words[w:w + n] for i in word]
            if len(positions) + len(span) <= budget:
                break
            n -= 1
        if n == 0 or any(i in chosen for i in span):
            continue
        for i in span:
            chosen.add(i)
            if rng.random_sample() < 0.8:
                out[i] = vocab.mask
            elif rng.random_sample() >= 0.5:
                out[i] = int(rng.randint(0, vocab.size))
            positions.append(i)
    return out, positions, [tokens[i] for i in positions]


class BertDataset:
    """Samples over the documents `document_ids` (a split: consecutive documents) of a sentence-level
    IndexedDataset."""

    def __init__(self, indexed: IndexedDataset, document_ids: np.ndarray, num_samples: int, cfg: BertSampleConfig,
                 vocab: BertVocab, name: str = "train") -> None:
        docs = np.asarray(document_ids, dtype=np.int64)
        if docs.size == 0:
            raise UsageError(f"--split: the {name} split of {indexed.path_prefix!r} has no documents")
        if num_samples < 1:
            raise UsageError(f"{name}: number of samples must be positive, got {num_samples}")
        if (np.diff(docs) != 1).any():
            raise ValueError("BertDataset takes a run of consecutive documents")
        self.indexed, self.cfg, self.vocab, self.name = indexed, cfg, vocab, name
        bounds = np.asarray(indexed.document_indices)[docs[0]:docs[-1] + 2]
        self.sample_index = build_sample_index(bounds, indexed.sequence_lengths, num_samples, cfg.seq_length - 3,
                                               cfg.short_seq_prob, cfg.seed, cfg.min_sentences)
        self.built_from_cache = False

    def __len__(self) -> int:
        return self.sample_index.shape[0]

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} samples in {self.name}")
        first, end, target = (int(x) for x in self.sample_index[i])
        sentences = [self.indexed.get(k) for k in range(first, end)]
        rng = np.random.RandomState((self.cfg.seed + i) % 2**32)
        return build_sample(sentences, target, self.cfg, self.vocab, rng)


class MockBertDataset:
    """Learnable synthetic BERT samples: sample i's document is a run of 2-5 sentences of 3-12 consecutive terms of
    an arithmetic progression over the word ids (start and step from (seed, split, i) only), built into a sample
    as real data is (sentence order, truncation, masking), so every layout sees the same data and the loss falls."""

    def __init__(self, vocab: BertVocab, num_samples: int, cfg: BertSampleConfig, name: str = "train") -> None:
        self.vocab, self.num_samples, self.cfg, self.name = vocab, int(num_samples), cfg, name
        self._key = zlib.crc32(name.encode())
        self.built_from_cache = False
        specials = {vocab.cls, vocab.sep, vocab.pad, vocab.mask}
        self._words = np.array([t for t in range(vocab.size) if t not in specials], dtype=np.int64)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for {self.num_samples} samples in {self.name}")
        g = np.random.default_rng([self.cfg.seed, self._key, int(i)])
        start, step = int(g.integers(0, len(self._words))), int(g.integers(1, 4))
        lengths = g.integers(3, 13, size=int(g.integers(2, 6)))
        terms = self._words[(start + step * np.arange(int(lengths.sum()))) % len(self._words)]
        sentences = np.split(terms, np.cumsum(lengths)[:-1])
        target = self.cfg.seq_length - 3
        if self.cfg.short_seq_prob > 0 and g.random() < self.cfg.short_seq_prob:
            target = int(g.integers(2, target + 1))
        rng = np.random.RandomState((self.cfg.seed + i) % 2**32)
        return build_sample(sentences, target, self.cfg, self.vocab, rng)
