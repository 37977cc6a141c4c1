"""Checkpoint files read as data, never as code. `load_file` is torch.load with weights_only=True and an explicit
allow-list of the globals our and Megatron-LM's checkpoints hold; any other global is refused in one line naming
the file and the global, before anything in the file runs."""

from __future__ import annotations

import argparse
import os
import re
from typing import Any

import numpy as np
import torch

from .errors import UsageError

# What a checkpoint may name beyond tensors and plain containers (torch allows those itself): Megatron's saved
# arguments (argparse.Namespace) and NumPy's RNG state (an array, its dtype; numpy >= 1.25 names the dtype's class)
_NUMPY_DTYPES = tuple(getattr(np.dtypes, n) for n in ("UInt32DType", "Float64DType", "Int64DType", "BoolDType")
                      if hasattr(getattr(np, "dtypes", None), n))
_RECONSTRUCT = getattr(np, "_core", np.core).multiarray._reconstruct  # numpy 2 moved it; pickles name either
ALLOWED = (argparse.Namespace, np.ndarray, np.dtype, _RECONSTRUCT, *_NUMPY_DTYPES)
_ALIASES = [(_RECONSTRUCT, "numpy.core.multiarray._reconstruct"),
            (_RECONSTRUCT, "numpy._core.multiarray._reconstruct")]
# Megatron-LM pickles its own enums and small config classes into `args`; they are read as inert stand-ins
MEGATRON_PREFIX = "megatron."


class Foreign:
    """An object of a class from a package that is not ours (Megatron's enums): its arguments and state as data."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"{type(self).__qualname__}{self.args!r}"

    @property
    def value(self) -> Any:
        """An enum's value (its one argument)."""
        return self.args[0] if len(self.args) == 1 else self.args


def _stand_in(name: str) -> tuple[type, str]:
    return type(name.rsplit(".", 1)[-1], (Foreign,), {"__module__": "megatron_bmw.safe_load.foreign"}), name


def _foreign_globals(path: str, where: str) -> list[tuple[type, str]]:
    """Stand-ins for the file's Megatron classes; any other global outside the allow-list is refused."""
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # noqa: BLE001 - not a zip checkpoint: weights_only itself refuses what it cannot allow
        return []
    allowed = {f"{o.__module__}.{o.__qualname__}" for o in ALLOWED} | {n for _, n in _ALIASES}
    out = []
    for name in unsafe:
        if name in allowed:
            continue
        if not name.startswith(MEGATRON_PREFIX):
            raise UsageError(f"{where}: {path} names the global {name}, which a checkpoint never needs; refused "
                             "(nothing in the file was run)")
        out.append(_stand_in(name))
    return out


def load_file(path: str, where: str, map_location: str = "cpu", mmap: bool = False) -> Any:
    """torch.load of `path` as data; `where` (the flag or tool that named it) starts every error line."""
    if not os.path.isfile(path):
        raise UsageError(f"{where}: missing {path}")
    extra = _foreign_globals(path, where)
    try:
        with torch.serialization.safe_globals([*ALLOWED, *_ALIASES, *extra]):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except UsageError:
        raise
    except Exception as exc:  # noqa: BLE001 - a truncated, foreign or refused file is one line
        raise UsageError(f"{where}: cannot read {path} ({_reason(exc)})") from None


def _reason(exc: Exception) -> str:
    text = str(exc)
    named = re.search(r"(?:Unsupported global: GLOBAL|unsupported GLOBAL) ([\w.]+)", text)
    if named:  # weights_only's refusal (a legacy-format file's globals are not listed ahead of time)
        return f"it names the global {named.group(1)}, which a checkpoint never needs; refused, nothing in it was run"
    if "Weights only load failed" in text:
        return "it holds a pickle construct a checkpoint never needs; refused, nothing in it was run"
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return f"truncated or not a checkpoint: {type(exc).__name__}: {lines[0] if lines else ''}"
