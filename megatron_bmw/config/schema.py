"""Each config field declares its Megatron flag once, as field metadata (`flag`): its names, help, the flag's
default, and the range a value must lie in. The argument parser is generated from these declarations
(`add_flags`), the ranges are checked from them (`check_ranges`), and a config is built from parsed flags by
field name (`from_flags`). No torch, no argparse namespace beyond the entry point."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import MISSING, dataclass, field
from typing import Any, Callable

from ..errors import UsageError

KEY = "megatron_flag"


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET = _Unset()  # a Flag's default that is the field's own


@dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]  # Megatron's spelling first, then aliases
    group: str
    help: str | None = None
    default: Any = UNSET  # the flag's default where it differs from the field's
    type: Callable | None = None  # None: the field's (int, float, str); booleans are switches
    choices: tuple | None = None
    action: str | None = None  # store_true | store_false (a switch), or None for a value
    nargs: str | int | None = None
    metavar: Any = None
    dest: str | None = None  # where the parsed value lands (default: the field's name)
    minimum: float | None = None  # value >= minimum
    maximum: float | None = None  # value <= maximum
    below: float | None = None  # value < below
    above: float | None = None  # value > above
    domain: tuple | None = None  # the values the field holds, where they differ from the flag's choices

    @property
    def name(self) -> str | None:
        """Megatron's spelling (None: a field with rules but no flag)."""
        return self.names[0] if self.names else None

    def admits(self, value) -> bool:
        return ((self.minimum is None or value >= self.minimum) and (self.above is None or value > self.above)
                and (self.maximum is None or value <= self.maximum) and (self.below is None or value < self.below))

    def bounds(self) -> str:
        """The declared range in words: '>= 1', 'in [0, 1)', or ''."""
        low = next(((b, c) for b, c in ((self.minimum, "["), (self.above, "(")) if b is not None), None)
        high = next(((b, c) for b, c in ((self.maximum, "]"), (self.below, ")")) if b is not None), None)
        if low and high:
            return f"in {low[1]}{_num(low[0])}, {_num(high[0])}{high[1]}"
        if low or high:
            bound, c = low or high
            return f"{ {'[': '>=', '(': '>', ']': '<=', ')': '<'}[c]} {_num(bound)}"
        return ""


def flag(*names: str, group: str = "", default: Any = MISSING, default_factory: Any = MISSING, cli_default: Any = UNSET,
         **spec: Any) -> Any:
    """A dataclass field that declares its command-line flag (`Flag`'s fields as keywords; `cli_default`: the
    flag's default where Megatron's differs from the field's). Without names: a field with rules and no flag."""
    meta = {KEY: Flag(tuple(names), group, default=cli_default, **spec)}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


def declared(cls) -> list[tuple[dataclasses.Field, Flag]]:
    """(field, flag) of every field of `cls` that declares one, in declaration order."""
    return [(f, f.metadata[KEY]) for f in dataclasses.fields(cls) if KEY in f.metadata]


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return None


def annotation_kinds(f: dataclasses.Field) -> list[str]:
    """The kinds a field's annotation names, first the main one: 'int | None' -> ['int', 'None']."""
    return [k.strip() for k in str(f.type).split("|")]


def _value_type(f: dataclasses.Field) -> Callable:
    return {"int": int, "float": float}.get(annotation_kinds(f)[0], str)


def add_flags(parser, groups: dict[str, Any], classes, wanted: Callable[[str], bool] = lambda group: True,
              fields: tuple[str, ...] | None = None) -> None:
    """Add the flags `classes` declare in the `wanted` groups (and, given `fields`, on those fields only) to
    `parser`, each into its argument group (created on first use, kept in `groups`)."""
    for cls in classes:
        for f, fl in declared(cls):
            if not fl.names or not wanted(fl.group) or (fields is not None and f.name not in fields):
                continue
            group = groups.get(fl.group)
            if group is None:
                group = groups[fl.group] = parser.add_argument_group(fl.group)
            kwargs: dict[str, Any] = {"dest": fl.dest or f.name}
            default = fl.default if fl.default is not UNSET else _field_default(f)
            if fl.action in ("store_true", "store_false"):
                kwargs["action"] = fl.action
                if default is not None and fl.action == "store_true" and default is not False:
                    kwargs["default"] = default
            elif fl.action is not None:  # append
                kwargs.update(action=fl.action, default=default)
            else:
                kwargs["default"] = default
                kwargs["type"] = fl.type or _value_type(f)
                for key in ("choices", "nargs", "metavar"):
                    if getattr(fl, key) is not None:
                        kwargs[key] = list(fl.choices) if key == "choices" else getattr(fl, key)
            if fl.help is not None:
                kwargs["help"] = fl.help
            group.add_argument(*fl.names, **kwargs)


def check_ranges(obj) -> None:
    """Every declared range of `obj`'s fields; one line naming the flag when a value lies outside."""
    for f, fl in declared(type(obj)):
        _check(fl, getattr(obj, f.name), fl.name or f.name)


def check_flag_values(values, classes) -> None:
    """The declared ranges of parsed flag values (by dest), before any config is built from them."""
    for cls in classes:
        for f, fl in declared(cls):
            if fl.names:
                _check(fl, getattr(values, fl.dest or f.name, None), fl.name)


def _check(fl: Flag, value, name: str) -> None:
    if value is None or isinstance(value, (list, tuple, str, bool)) or fl.admits(value):
        return
    raise UsageError(f"{name} must be {fl.bounds()}, got {value}")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 2**53 else repr(x)


def from_flags(cls, values, **given: Any):
    """`cls` built from parsed flag values (anything with attributes named by the flags' dests) and `given`,
    which take precedence. A field whose flag was not parsed keeps its default."""
    kwargs = {}
    for f, fl in declared(cls):
        if f.name in given:
            continue
        dest = fl.dest or f.name
        if hasattr(values, dest):
            kwargs[f.name] = getattr(values, dest)
    return cls(**kwargs, **given)


def positive_int(flag_name: str) -> Callable[[str], int]:
    """An argparse type: an integer >= 1, refused at parse time naming the flag."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag_name} expects an integer, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{flag_name} must be >= 1, got {value}")
        return value

    return parse


def int_list(flag_name: str) -> Callable[[str], tuple[int, ...]]:
    """An argparse type: comma-separated positive integers, refused at parse time naming the flag."""
    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(x) for x in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag_name} expects comma-separated integers, got {text!r}") from None
        if not values or min(values) < 1:
            raise argparse.ArgumentTypeError(f"{flag_name} expects positive integers, got {text!r}")
        return values

    return parse
