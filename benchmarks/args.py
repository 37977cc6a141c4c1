"""Command-line plumbing the benchmarks share (torch-free): a parser whose errors are one `error:` line with exit
code 2, counts that must reach a least value, output files checked before any work starts, and the benchmark's
first docstring paragraph as its --help description."""

from __future__ import annotations

import argparse

from megatron_bmw.errors import OneLineParser, UsageError, exit_on_usage_error  # noqa: F401 (re-exported)
from megatron_bmw.paths import check_output_dir, check_output_file


def parser(doc: str | None, **kwargs) -> OneLineParser:
    """A one-line-error parser described by the first paragraph of `doc` (the module docstring)."""
    first = (doc or "").strip().split("\n\n")[0]
    return OneLineParser(description=" ".join(first.split()), allow_abbrev=False, **kwargs)


def count(least: int = 1):
    """An argparse type: an integer >= `least`."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be >= {least}, got {value}")
        return value
    return parse


def output_files(**flags: str | None) -> None:
    """Refuse output files that cannot be written (a directory, a missing folder), before the work: keyword
    `json="x.json"` is checked as --json."""
    for name, path in flags.items():
        check_output_file("--" + name.replace("_", "-"), path)


def output_dirs(**flags: str | None) -> None:
    """As output_files, for folders (created when missing)."""
    for name, path in flags.items():
        check_output_dir("--" + name.replace("_", "-"), path)


def names(flag: str, given: str, known) -> list[str]:
    """A comma list of names from `known`; an unknown or empty one is a UsageError naming `flag`."""
    chosen = [x.strip() for x in given.split(",") if x.strip()]
    unknown = [x for x in chosen if x not in known]
    if unknown or not chosen:
        raise UsageError(f"{flag}: unknown {', '.join(unknown) or 'empty list'} (one of {', '.join(map(str, known))})")
    return chosen
