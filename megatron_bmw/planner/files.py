"""JSON files the planner reads and writes (plans, profiles): one clear line for a file that is not right."""

from __future__ import annotations

import json
import os

from ..errors import UsageError


def read_text(path: str, flag: str, what: str) -> str:
    """The file's text, or a UsageError naming `flag` and `path`."""
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        raise UsageError(f"{flag} {path}: no such file") from None
    except IsADirectoryError:
        raise UsageError(f"{flag} {path}: is a directory, not a {what}") from None
    except UnicodeDecodeError:
        raise UsageError(f"{flag} {path}: not a text file") from None
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot read it ({exc.strerror})") from None


def read_json(path: str, flag: str, what: str):
    """The parsed file, or a UsageError naming `flag` and `path`."""
    text = read_text(path, flag, what)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{flag} {path}: not valid JSON (line {exc.lineno})") from None


def write_json(path: str, data, flag: str, what: str) -> None:
    """Write atomically (a temporary file renamed over `path`), or a UsageError naming `flag`."""
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot write the {what} ({exc.strerror})") from None
