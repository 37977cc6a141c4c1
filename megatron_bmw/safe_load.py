"""Checkpoint files read as data, never as code. `load_file` is torch.load with weights_only=True and an explicit
allow-list of the globals our and Megatron-LM's checkpoints hold; any other global is refused in one line naming
the file and the global, before anything in the file runs. `load_pickle` reads a plain pickle (a
torch.distributed.checkpoint `.metadata`, a CUDA memory snapshot) under an allow-list of its own, and `dcp_reader`
is a torch.distributed.checkpoint reader whose `.metadata` is read so."""

from __future__ import annotations

import argparse
import collections
import io
import os
import pickle
import re
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from .errors import UsageError

# What a checkpoint may name beyond tensors and plain containers (torch allows those itself): Megatron's saved
# arguments (argparse.Namespace), NumPy's RNG state (an array, its dtype; numpy >= 1.25 names the dtype's class) and
# Transformer Engine's `_extra_state` in Megatron-LM's model state (a serialized buffer, io.BytesIO, before TE 1.x
# saved a tensor)
_NUMPY_DTYPES = tuple(getattr(np.dtypes, n) for n in ("UInt32DType", "Float64DType", "Int64DType", "BoolDType")
                      if hasattr(getattr(np, "dtypes", None), n))
_RECONSTRUCT = getattr(np, "_core", np.core).multiarray._reconstruct  # numpy 2 moved it; pickles name either
ALLOWED = (argparse.Namespace, np.ndarray, np.dtype, _RECONSTRUCT, io.BytesIO, *_NUMPY_DTYPES)
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
    """torch.load of `path` as data; `where` (the flag or tool that named it) starts every error line. `mmap`: map
    the file's tensors instead of reading them (zip-format files; a file of torch's legacy format is read)."""
    if not os.path.isfile(path):
        raise UsageError(f"{where}: missing {path}")
    extra = _foreign_globals(path, where)
    try:
        with torch.serialization.safe_globals([*ALLOWED, *_ALIASES, *extra]):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap and _zip_format(path))
    except UsageError:
        raise
    except Exception as exc:  # noqa: BLE001 - a truncated, foreign or refused file is one line
        raise UsageError(f"{where}: cannot read {path} ({_reason(exc)})") from None


def _zip_format(path: str) -> bool:
    """torch.save's zip format (torch >= 1.6), which mmap needs, rather than the legacy one."""
    with open(path, "rb") as f:
        return f.read(4) == b"PK\x03\x04"


def _reason(exc: Exception) -> str:
    text = str(exc)
    named = re.search(r"(?:Unsupported global: GLOBAL|unsupported GLOBAL) ([\w.]+)", text)
    if named:  # weights_only's refusal (a legacy-format file's globals are not listed ahead of time)
        return f"it names the global {named.group(1)}, which a checkpoint never needs; refused, nothing in it was run"
    if "Weights only load failed" in text:  # a construct weights_only refuses, or bytes that are no pickle at all
        detail = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", text)
        why = detail.group(1).strip() if detail else "a construct a checkpoint never needs"
        return f"truncated or not a checkpoint: the unpickler refused it ({why}); nothing in it was run"
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return f"truncated or not a checkpoint: {type(exc).__name__}: {lines[0] if lines else ''}"


# ----------------------------------------------------------------------------------------------------------------
# Plain pickles: torch.distributed.checkpoint's `.metadata`, CUDA memory snapshots


class Refused(pickle.UnpicklingError):
    """A pickle named a global outside its allow-list; nothing was called."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


class _DataUnpickler(pickle.Unpickler):
    """Resolves only the globals of `allowed` (full name -> object), and Megatron's as inert stand-ins when
    `foreign`; any other global raises Refused before anything is called."""

    def __init__(self, f: Any, allowed: Mapping[str, Any], foreign: bool) -> None:
        super().__init__(f)
        self.allowed, self.foreign = allowed, foreign

    def find_class(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        if full in self.allowed:
            return self.allowed[full]
        if self.foreign and full.startswith(MEGATRON_PREFIX):
            return _stand_in(full)[0]
        raise Refused(full)


def unpickle(f: Any, allowed: Mapping[str, Any] | None = None, foreign: bool = False) -> Any:
    """pickle.load of an open binary file that may name only the globals of `allowed` (full name -> object; none:
    plain data only) and, when `foreign`, Megatron's classes as inert stand-ins; any other raises Refused."""
    return _DataUnpickler(f, allowed or {}, foreign).load()


def load_pickle(path: str, where: str, allowed: Mapping[str, Any] | None = None, foreign: bool = False) -> Any:
    """`unpickle` of the file at `path`, its errors one line as load_file's."""
    if not os.path.isfile(path):
        raise UsageError(f"{where}: missing {path}")
    try:
        with open(path, "rb") as f:
            return unpickle(f, allowed, foreign)
    except Refused as exc:
        raise UsageError(f"{where}: {path} names the global {exc.name}, which this file never needs; refused "
                         "(nothing in the file was run)") from None
    except Exception as exc:  # noqa: BLE001 - a truncated or foreign file is one line
        raise UsageError(f"{where}: cannot read {path} ({_reason(exc)})") from None


def dcp_metadata_globals() -> dict[str, Any]:
    """What a torch.distributed.checkpoint `.metadata` pickle names (torch 2.x, ours and megatron-core's): its
    metadata dataclasses, the storage info, torch.Size, dtypes, layouts and memory formats, the checkpoint's path."""
    import pathlib

    from torch.distributed.checkpoint import filesystem, metadata

    out: dict[str, Any] = {"torch.Size": torch.Size, "torch.serialization._get_layout": torch.serialization._get_layout,
                           "collections.OrderedDict": collections.OrderedDict}
    for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                 "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"):
        if hasattr(metadata, name):
            out[f"torch.distributed.checkpoint.metadata.{name}"] = getattr(metadata, name)
    out["torch.distributed.checkpoint.filesystem._StorageInfo"] = filesystem._StorageInfo
    for cls in (pathlib.PosixPath, pathlib.PurePosixPath, pathlib.WindowsPath, pathlib.PureWindowsPath,
                pathlib.Path):
        out[f"pathlib.{cls.__name__}"] = cls
    for name, value in vars(torch).items():
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            out[f"torch.{name}"] = value
    return out


def dcp_reader(path: str, where: str) -> Any:
    """A torch.distributed.checkpoint FileSystemReader of `path` whose `.metadata` (a plain pickle, which torch reads
    with pickle.load) is read as data (`dcp_metadata_globals`), here and now: a refusal is this call's one line, not
    an exception dcp.load would log and replace. The tensors dcp.load reads with weights_only already."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _Reader(FileSystemReader):
        def __init__(self, checkpoint: str) -> None:
            super().__init__(checkpoint)
            self.metadata = self._read(None)

        def _read(self, rank: int | None) -> Any:
            meta_path = os.fspath(self._get_metadata_path(rank))
            meta = load_pickle(meta_path, where, dcp_metadata_globals(), foreign=True)
            if not hasattr(meta, "state_dict_metadata"):
                raise UsageError(f"{where}: {meta_path} is not torch.distributed.checkpoint metadata")
            return meta

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            meta = self.metadata if kwargs.get("rank") is None else self._read(kwargs["rank"])
            if getattr(meta, "storage_meta", None) is None:
                meta.storage_meta = StorageMeta()
            meta.storage_meta.load_id = self.load_id
            return meta

    return _Reader(path)
