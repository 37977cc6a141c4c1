"""Config dataclasses <-> JSON data (the plan file's sections). A value read back is checked against its field's
annotation and the rules its flag declares (range, choices), and a wrong one is named by its path in the file,
never by a flag the file's reader did not give."""

from __future__ import annotations

import dataclasses
import math

from ..errors import UsageError
from .schema import KEY, annotation_kinds


def to_data(obj, exclude: tuple[str, ...] = ()) -> dict:
    """A config dataclass as JSON data: tuples become lists, nested dataclasses mappings."""
    return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.name not in exclude}


def _plain(value):
    if dataclasses.is_dataclass(value):
        return to_data(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_section(cls, data, where: str, path: str, exclude: tuple[str, ...] = (), extra: tuple[str, ...] = ()) -> dict:
    """The mapping `data` as the fields of `cls` (and the `extra` keys another part reads): unknown keys, and every
    field's type, range and choices, each refused in one line naming `where` and the field's path. Returns the
    values given, with defaults for those left out (fields without a default must be given)."""
    if not isinstance(data, dict):
        raise UsageError(f"{where}: field {path} must be a mapping, got {shown(data)}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name not in exclude and f.init}
    unknown = sorted(set(data) - set(fields) - set(extra))
    if unknown:
        raise UsageError(f"{where}: unknown {path} key {unknown[0]!r}")
    out = {}
    for name, f in fields.items():
        if name in data:
            out[name] = check_value(f, data[name], f"{where}: field {path}.{name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise UsageError(f"{where}: missing field '{path}.{name}'")
    return out


def check_value(f: dataclasses.Field, value, where: str):
    """One field's value from a file, against its annotation and declared rules."""
    rules = f.metadata.get(KEY)
    kinds = annotation_kinds(f)
    if value is None:
        if "None" in kinds:
            return None
        raise UsageError(f"{where} must not be null")
    main = kinds[0]
    if main.startswith(("tuple", "list")):
        if not isinstance(value, list):
            raise UsageError(f"{where} must be a list, got {shown(value)}")
        return value
    if main == "bool":
        if not isinstance(value, bool):
            raise UsageError(f"{where} must be true or false, got {shown(value)}")
        return value
    if main == "int" and not ("str" in kinds and isinstance(value, str)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise UsageError(f"{where} must be an integer{_bounds(rules)}, got {shown(value)}")
    elif main == "float":
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise UsageError(f"{where} must be a number{_bounds(rules)}, got {shown(value)}")
    elif main == "str" and not isinstance(value, str):
        raise UsageError(f"{where} must be a string, got {shown(value)}")
    if rules is not None:
        domain = rules.domain if rules.domain is not None else rules.choices
        if domain is not None and isinstance(value, str) and value not in domain:
            raise UsageError(f"{where} must be one of {', '.join(domain)}, got {shown(value)}")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not rules.admits(value):
            kind = "an integer" if main == "int" else "a number"
            raise UsageError(f"{where} must be {kind}{_bounds(rules)}, got {shown(value)}")
    return value


def _bounds(rules) -> str:
    text = rules.bounds() if rules is not None else ""
    return f" {text}" if text else ""
