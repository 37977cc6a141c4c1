"""The padded vocabulary rows across a Hugging Face export and re-import.

Our vocabulary is padded to a multiple of make_vocab_size_divisible_by x tp, and the padded rows of the word
embedding (and of an untied output layer, and BERT's output bias) are trained like the others: their logits enter
every token's softmax. A Hugging Face model has no such rows, so an export drops them, and a re-import that pads
with zeros changes the loss. The export therefore writes them beside the HF weights (PADDING_FILE, which
from_pretrained ignores), and an import at the same padded size puts them back: export then import is exact.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from ..errors import UsageError

PADDING_FILE = "megatron_vocab_padding.safetensors"
VOCAB_TENSORS = ("units.embedding.word_embeddings.weight", "units.head.output_weight", "units.head.lm_bias")


def padded_rows(full: Mapping[str, torch.Tensor], orig_vocab_size: int | None) -> dict[str, torch.Tensor]:
    """Rows beyond `orig_vocab_size` of every vocabulary-sized tensor in `full` (none when nothing is padded)."""
    if orig_vocab_size is None:
        return {}
    out = {}
    for name in VOCAB_TENSORS:
        t = full.get(name)
        if t is not None and t.size(0) > orig_vocab_size:
            out[name] = t[orig_vocab_size:].contiguous().clone()
    return out


def restore_rows(full: dict[str, torch.Tensor], rows: Mapping[str, torch.Tensor], orig_vocab_size: int) -> bool:
    """Put carried padded rows back into `full` when they fit its padding exactly (same tensors, same row count,
    shape and dtype); False (and `full` unchanged) otherwise."""
    names = [n for n in VOCAB_TENSORS if n in full]
    for name in names:
        t, r = full[name], rows.get(name)
        if r is None or tuple(r.shape) != (t.size(0) - orig_vocab_size,) + tuple(t.shape[1:]) or r.dtype != t.dtype:
            return False
    if set(rows) != set(names):
        return False
    for name in names:
        full[name] = torch.cat([full[name][:orig_vocab_size], rows[name]]).contiguous()
    return True


def write_rows(hf_dir: str, rows: Mapping[str, torch.Tensor]) -> None:
    if not rows:
        return
    from safetensors.torch import save_file  # installed with transformers

    try:
        save_file(dict(rows), os.path.join(hf_dir, PADDING_FILE))
    except OSError as exc:
        raise UsageError(f"--hf-dir {hf_dir}: cannot write {PADDING_FILE}: {exc}") from None


def read_rows(hf_dir: str) -> dict[str, torch.Tensor] | None:
    """The padded rows an export left in `hf_dir`, or None."""
    path = os.path.join(hf_dir, PADDING_FILE)
    if not os.path.isfile(path):
        return None
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except Exception as exc:  # noqa: BLE001 - an unreadable file is a user error
        raise UsageError(f"--hf-dir: cannot read {path}: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}")


def restore_from(hf_dir: str, full: dict[str, torch.Tensor], orig_vocab_size: int) -> str | None:
    """Restore the padded rows an export left in `hf_dir` into `full`; a note for the user, or None."""
    rows = read_rows(hf_dir)
    if rows is None:
        return None
    if restore_rows(full, rows, orig_vocab_size):
        return f"restored the padded vocabulary rows from {PADDING_FILE}"
    had = orig_vocab_size + max((int(t.size(0)) for t in rows.values()), default=0)
    now = int(full[VOCAB_TENSORS[0]].size(0))
    return (f"{PADDING_FILE} holds the padded rows of a {had}-row vocabulary, this import pads to {now} rows "
            "(--make-vocab-size-divisible-by x --tensor-model-parallel-size): the padded rows are zero")
