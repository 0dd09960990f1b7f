"""Build (nested) config dataclasses from plain dicts, rejecting unknown keys.

A YAML file or `--a.b=1` overrides become a dict; a misspelled key must fail before training
starts, not be ignored for a whole run.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")


def config_from_dict(cls: type[T], values: Mapping[str, Any], *, path: str = "") -> T:
    """An instance of dataclass `cls` from `values`; nested dataclass fields take nested dicts.

    Unknown keys raise ValueError naming the key and the closest known one. Values are not
    coerced: validation belongs to the dataclass's own __post_init__.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"config_from_dict needs a dataclass type, got {cls!r}")
    if not isinstance(values, Mapping):
        raise ValueError(
            f"config {path or cls.__name__!r} must be a mapping, got {type(values).__name__}"
        )
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        dotted = f"{path}.{key}" if path else key
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {sorted(fields)}"
            raise ValueError(f"unknown config key {dotted!r} for {cls.__name__}{hint}")
        field_type = hints.get(key)
        if (
            isinstance(field_type, type)
            and dataclasses.is_dataclass(field_type)
            and isinstance(value, Mapping)
        ):
            value = config_from_dict(field_type, value, path=dotted)
        kwargs[key] = value
    return cls(**kwargs)
