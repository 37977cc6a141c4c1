"""A dependency-free English sentence splitter for `tools/preprocess_data.py --split-sentences`.

Megatron-LM splits with NLTK's punkt model, which needs the nltk package and its downloaded data; this is a
small rule-based stand-in, deterministic everywhere. A sentence ends at `.`, `!` or `?` (runs of them, and closing
quotes or brackets after them) when whitespace and then a capital letter, a digit or an opening quote or bracket
follow, unless the word before the period is a common abbreviation or a single letter (an initial); a blank
line always ends a sentence. With `keep_newlines` a sentence keeps the newlines that follow it (and those
inside it), as Megatron's --keep-newlines does; otherwise surrounding whitespace is stripped (inner newlines
stay in the text; BERT's tokenizer treats them as spaces).
"""

from __future__ import annotations

import re

ABBREVIATIONS = frozenset("""mr mrs ms dr st jr sr prof rev gen col capt lt sgt hon gov sen rep mt ft no vs etc al
    inc ltd co corp dept univ jan feb mar apr jun jul aug sep sept oct nov dec e.g i.e viz cf approx""".split())
_END = re.compile(r"[.!?]+[\"'’”)\]]*(?=\s)")
_NEXT = re.compile(r"\s+([\"'‘“(\[]*[A-Z0-9])")
_BLANK = re.compile(r"\n[ \t]*\n\s*")


def _abbreviation(text: str, end: int) -> bool:
    """Does the period ending at `end` close an abbreviation or an initial?"""
    if text[end - 1] != ".":
        return False
    start = end - 1
    while start > 0 and not text[start - 1].isspace() and text[start - 1] not in "\"'(“‘[":
        start -= 1
    word = text[start:end - 1].lower()
    return (len(word) == 1 and word.isalpha()) or word in ABBREVIATIONS


def split_sentences(text: str, keep_newlines: bool = False) -> list[str]:
    """The sentences of `text`, in order; empty ones dropped."""
    cuts = set()
    for m in _END.finditer(text):
        nxt = _NEXT.match(text, m.end())
        punct_end = m.start() + len(m.group().rstrip("\"'’”)]"))
        if nxt and not _abbreviation(text, punct_end):
            cuts.add(m.end())
    for m in _BLANK.finditer(text):
        cuts.add(m.start())
    out, start = [], 0
    for cut in sorted(cuts) + [len(text)]:
        if cut <= start:
            continue
        # the whitespace after the cut belongs to this sentence (it is dropped unless newlines are kept)
        stop = cut
        while stop < len(text) and text[stop].isspace():
            stop += 1
        piece = text[start:stop]
        start = stop
        if keep_newlines:
            body = piece.strip(" \t")
            trailing = piece[len(piece.rstrip()):]
            sentence = body.rstrip() + ("\n" * trailing.count("\n") if body.strip() else "")
        else:
            sentence = piece.strip()
        if sentence.strip():
            out.append(sentence.lstrip() if keep_newlines else sentence)
    return out
