"""Per-file checksums of a checkpoint: a `checksums.json` in each folder of an iteration that holds files records
the size and digest of each of them, and --load compares the files a rank reads with it before reading them.

    {"version": 1, "files": {"model_optim_rng.pt": {"bytes": 1234, "sha256": "9f86..."}, ...}}

The digest is xxHash's xxh3_128 where the xxhash package is installed, else SHA-256; files are streamed, never held
whole. Each entry names its algorithm, so a checkpoint verifies wherever it is loaded; a digest this machine cannot
compute (xxh3 without xxhash) is skipped and the size still compared.
"""

from __future__ import annotations

import hashlib
import json
import os

try:
    import xxhash
except ImportError:  # optional: SHA-256 then
    xxhash = None

FILE = "checksums.json"
VERSION = 1
_CHUNK = 1 << 22


def algorithm() -> str:
    """The digest this machine writes."""
    return "xxh3_128" if xxhash is not None else "sha256"


def _hasher(name: str):
    if name == "xxh3_128":
        return xxhash.xxh3_128() if xxhash is not None else None
    return hashlib.new(name) if name == "sha256" else None


def digest(path: str, name: str | None = None) -> dict:
    """{"bytes": size, <algorithm>: hex digest} of the file at `path`."""
    name = name or algorithm()
    h = _hasher(name)
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    size = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
            size += n
    return {"bytes": size, name: h.hexdigest()}


def record(folder: str, entries: dict[str, dict]) -> None:
    """Write the folder's checksums.json (fsynced) for `entries`: file name -> digest()."""
    with open(os.path.join(folder, FILE), "w") as f:
        json.dump({"version": VERSION, "files": dict(sorted(entries.items()))}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def recorded(folder: str) -> dict[str, dict] | None:
    """The entries of the folder's checksums.json; None without one. A file that is not one raises ValueError."""
    path = os.path.join(folder, FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"not a checksum file: {type(exc).__name__}") from None
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, dict) or not all(isinstance(e, dict) and isinstance(e.get("bytes"), int)
                                              for e in files.values()):
        raise ValueError("not a checksum file: no 'files' of sizes and digests")
    return files


def differs(path: str, entry: dict) -> str | None:
    """Why the file at `path` is not the one `entry` recorded, or None when it is."""
    if not os.path.isfile(path):
        return "missing"
    size = os.path.getsize(path)
    if size != entry["bytes"]:
        return f"{size} bytes, {entry['bytes']} were saved"
    name = next((k for k in ("xxh3_128", "sha256") if k in entry and _hasher(k) is not None), None)
    if name is not None and digest(path, name)[name] != entry[name]:
        return f"{name} checksum differs"
    return None
