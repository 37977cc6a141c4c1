"""Flag values argparse lets through: numbers that are not finite or too large, and values that start with '-'.

Ranges live with the settings they bound (config.py); this module catches what comes before them: `--lr nan`
or `--lr 1e39` (beyond fp32) passed every `< 0` test and reached torch as a traceback, as did an integer beyond
int64 (`--rotary-base 1e20` spelt out, `--train-iters` of 24 digits); and `--split -1,2,3` was taken by argparse for
a flag ("expected one argument")."""

from __future__ import annotations

import argparse
import math
import struct

from .errors import UsageError

FP32_MAX = struct.unpack("f", b"\xff\xff\x7f\x7f")[0]
INT64_MAX = 2**63 - 1


def _actions(parser: argparse.ArgumentParser):
    """The parser's actions and its subcommands' (autoconfig.py search, ...)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                yield from _actions(sub)
        else:
            yield action


def _single_value_flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in _actions(parser) if a.option_strings and a.nargs is None
            for s in a.option_strings if s.startswith("--")}


def check_finite(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Every float-valued flag is a finite number an fp32 tensor can hold; every integer-valued one fits int64."""
    for action in _actions(parser):
        if action.type not in (float, int) or not action.option_strings:
            continue
        values = getattr(args, action.dest, None)
        for value in values if isinstance(values, list) else [values]:
            if value is None:
                continue
            if action.type is int and abs(value) > INT64_MAX:
                raise UsageError(f"{action.option_strings[0]} must fit a 64-bit integer (at most {INT64_MAX}), "
                                 f"got {value}")
            if action.type is float and not (math.isfinite(value) and abs(value) <= FP32_MAX):
                raise UsageError(f"{action.option_strings[0]} must be a finite number within fp32's range, got {value}")


def join_negative_values(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """`--split -1,2,3` as `--split=-1,2,3`, so the value reaches the flag's own check."""
    flags = _single_value_flags(parser)
    out, i = [], 0
    while i < len(argv):
        nxt = argv[i + 1] if i + 1 < len(argv) else ""
        if argv[i] in flags and nxt.startswith("-") and not nxt.startswith("--") and len(nxt) > 1:
            out.append(f"{argv[i]}={nxt}")
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return out
