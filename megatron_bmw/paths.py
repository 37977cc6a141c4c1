"""Output paths checked at start-up, so a bad one costs one `error:` line now instead of a traceback after training."""

from __future__ import annotations

import os

from .errors import UsageError


def _probe(flag: str, path: str, folder: str) -> None:
    """Write and remove a small file in `folder`: the only test that also catches read-only mounts."""
    probe = os.path.join(folder, f".write-test-{os.getpid()}")
    try:
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot write in {folder} ({exc.strerror})") from None


def check_output_dir(flag: str, path: str | None) -> None:
    """`path` is, or can be made, a writable directory (created if missing)."""
    if path is None:
        return
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"{flag} {path}: exists and is not a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot create the directory ({exc.strerror})") from None
    _probe(flag, path, path)


def check_output_file(flag: str, path: str | None) -> None:
    """`path` names a file that can be written: not a directory, in an existing writable folder."""
    if path is None:
        return
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path}: is a directory, expected a file name")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"{flag} {path}: folder {folder} does not exist")
    _probe(flag, path, folder)
