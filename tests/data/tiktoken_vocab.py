"""A tiny Megatron tiktoken vocabulary built in the tests: the 256 bytes, then merges learned from a few texts by
byte-level BPE training (the most frequent adjacent pair of each round becomes the next rank), written as Megatron's
JSON list of {rank, token_bytes (base64), token_str}. Nothing is downloaded."""

from __future__ import annotations

import base64
import json
from collections import Counter
from pathlib import Path

from megatron_bmw.data.tiktoken_bpe import PATTERNS


def learn_ranks(texts: list[str], merges: int, pattern: str = "v2") -> list[bytes]:
    """The 256 single bytes, then up to `merges` learned tokens, in rank order."""
    import regex

    words = Counter(p.encode("utf-8") for t in texts for p in regex.findall(PATTERNS[pattern], t))
    pieces = {w: [w[i:i + 1] for i in range(len(w))] for w in words}
    ranks = [bytes([b]) for b in range(256)]
    for _ in range(merges):
        pairs: Counter = Counter()
        for w, parts in pieces.items():
            for a, b in zip(parts, parts[1:]):
                pairs[(a, b)] += words[w]
        if not pairs:
            break
        (a, b), _count = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        if a + b not in ranks:  # another order of merges may have made these bytes already
            ranks.append(a + b)
        for w, parts in pieces.items():
            i, out = 0, []
            while i < len(parts):
                if i + 1 < len(parts) and parts[i] == a and parts[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(parts[i])
                    i += 1
            pieces[w] = out
    return ranks


def write_vocab(path: Path, ranks: list[bytes]) -> str:
    entries = [{"rank": i, "token_bytes": base64.b64encode(t).decode("ascii"),
                "token_str": t.decode("utf-8", errors="replace")} for i, t in enumerate(ranks)]
    path.write_text(json.dumps(entries))
    return str(path)
