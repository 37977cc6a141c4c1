"""The run's GPT-2 BPE tokenizer beside an exported Hugging Face model: vocab.json, merges.txt,
tokenizer_config.json and special_tokens_map.json, so `transformers.AutoTokenizer.from_pretrained(dir)` loads the
tokenizer the model was trained with.

The files are the ones given to the export tool (--vocab-file, --merge-file), else the ones the checkpoint's args
record (Megatron-LM's `vocab_file` / `merge_file`, carried by convert_megatron.py). The vocabulary must be the
model's: as many tokens as its unpadded vocabulary, with Megatron's end of document `<|endoftext|>`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import UsageError

EOD = "<|endoftext|>"  # GPT2BPETokenizer's end of document; Hugging Face's GPT-2 bos, eos and unk
MERGES_HEADER = "#version: 0.2"  # what Hugging Face's readers skip as the merges file's first line
GPT2_TOKENIZER = "GPT2BPETokenizer"


@dataclass
class GPT2Files:
    """A GPT-2 BPE tokenizer's files, read and checked."""

    vocab: dict[str, int]
    merges: list[str]  # "left right" lines, no header
    origin: str  # where they were named: the flags, or the checkpoint's args

    @property
    def eod(self) -> int:
        return self.vocab[EOD]


def _given(vocab_file: str | None, merge_file: str | None, args: Mapping[str, Any]) -> tuple[str, str, str] | str:
    """(vocab file, merges file, where they were named), or the note saying why there are none."""
    if vocab_file or merge_file:
        if not (vocab_file and merge_file):
            raise UsageError("--vocab-file and --merge-file go together: the GPT-2 BPE tokenizer's vocab.json and "
                             "merges.txt")
        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not os.path.isfile(path):
                raise UsageError(f"{flag} {path}: no such file")
        return vocab_file, merge_file, "--vocab-file/--merge-file"
    kind = args.get("tokenizer_type")
    recorded = args.get("vocab_file"), args.get("merge_file")
    if kind not in (None, GPT2_TOKENIZER):
        return f"the checkpoint's tokenizer is {kind}, not the GPT-2 BPE one; no tokenizer files written"
    if not all(isinstance(p, str) and p for p in recorded):
        return ("no tokenizer files written: the checkpoint's args record no --vocab-file/--merge-file; give them "
                "to write vocab.json and merges.txt")
    missing = [p for p in recorded if not os.path.isfile(p)]
    if missing:
        return (f"no tokenizer files written: the checkpoint's args name {missing[0]}, which is not here; give "
                "--vocab-file and --merge-file")
    return recorded[0], recorded[1], "the checkpoint's args"


def read_gpt2_files(vocab_file: str | None, merge_file: str | None, args: Mapping[str, Any],
                    vocab_size: int) -> GPT2Files | str:
    """The tokenizer's files for a model of `vocab_size` (unpadded) tokens, read and checked; or the one-line note
    saying why none are known. Bad files, or a vocabulary that is not the model's, are a UsageError."""
    found = _given(vocab_file, merge_file, args)
    if isinstance(found, str):
        return found
    vocab_path, merge_path, origin = found
    try:
        with open(vocab_path, encoding="utf-8") as f:
            vocab = json.load(f)
        with open(merge_path, encoding="utf-8") as f:
            lines = [ln.rstrip("\n") for ln in f]
    except (OSError, ValueError) as exc:
        raise UsageError(f"{origin}: cannot read {vocab_path} / {merge_path}: {exc}") from None
    if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in vocab.values()):
        raise UsageError(f"{origin}: {vocab_path} is not a token -> id JSON object")
    if EOD not in vocab:
        raise UsageError(f"{origin}: {vocab_path} has no {EOD!r} token")
    if len(vocab) != vocab_size or sorted(vocab.values()) != list(range(vocab_size)):
        raise UsageError(f"{origin}: {vocab_path} holds {len(vocab)} tokens, but the model's vocabulary is "
                         f"{vocab_size} (ids 0..{vocab_size - 1}): not this model's tokenizer")
    merges = [ln for ln in lines if ln and not ln.startswith("#version")]
    bad = next((i for i, ln in enumerate(merges) if len(ln.split(" ")) != 2), None)
    if bad is not None:
        raise UsageError(f"{origin}: {merge_path}: {merges[bad]!r} is not 'left right'")
    return GPT2Files(vocab, merges, origin)


def write_gpt2_files(hf_dir: str, files: GPT2Files, model_max_length: int) -> list[str]:
    """Write the tokenizer files Hugging Face's GPT2Tokenizer reads beside config.json; returns their names."""
    special = {"bos_token": EOD, "eos_token": EOD, "unk_token": EOD}
    config = dict(special, tokenizer_class="GPT2Tokenizer", model_max_length=model_max_length,
                  add_prefix_space=False, add_bos_token=False, errors="replace")
    out = {"vocab.json": json.dumps(files.vocab, ensure_ascii=False),
           "merges.txt": "\n".join([MERGES_HEADER, *files.merges]) + "\n",
           "tokenizer_config.json": json.dumps(config, indent=2),
           "special_tokens_map.json": json.dumps(special, indent=2)}
    try:
        for name, text in out.items():
            with open(os.path.join(hf_dir, name), "w", encoding="utf-8") as f:
                f.write(text)
    except OSError as exc:
        raise UsageError(f"--hf-dir {hf_dir}: cannot write: {exc}") from None
    return list(out)
