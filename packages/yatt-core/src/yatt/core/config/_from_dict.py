"""Build (nested) config dataclasses from plain dicts, rejecting unknown keys.

A YAML file or `--a.b=1` overrides become a dict; a misspelled key must fail before training
starts, not be ignored for a whole run. So must a value of the wrong type: YAML reads `1e-3`
(no dot) as a string and `abc` for an int field stays a string, so fields typed int, float,
bool or str (or `X | None`) are coerced where that is exact ("1e-3" -> 0.001, 3.0 -> 3) and
otherwise refused with the field's dotted name.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")


def config_from_dict(
    cls: type[T], values: Mapping[str, Any], *, path: str = "", base: T | None = None
) -> T:
    """An instance of dataclass `cls` from `values`; nested dataclass fields take nested dicts.

    A nested dict is laid over the field's own default (its default_factory's instance), not
    over the nested class's defaults: `engine: {max_seq_len: 16}` keeps the other settings
    the parent chose for that engine. `base`: the instance whose values the missing keys keep.
    Unknown keys raise ValueError naming the key and the closest known one. Scalars are
    coerced to the declared type (exact conversions only); other validation belongs to the
    dataclass's own __post_init__, whose "ClassName.field" in a nested section's error becomes
    the dotted path ("loss.field").
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
        if isinstance(field_type, type) and dataclasses.is_dataclass(field_type):
            if value is None:  # "data:" with nothing under it
                raise ValueError(
                    f"config section {dotted!r} is empty; give it fields or remove the line"
                )
            if isinstance(value, Mapping):
                default = getattr(base, key) if base is not None else _default_of(fields[key])
                value = config_from_dict(field_type, value, path=dotted, base=default)
        else:
            value = coerce_value(value, field_type, dotted)
        kwargs[key] = value
    try:
        if base is not None:
            return dataclasses.replace(base, **kwargs)  # __post_init__ checks the merged values
        return cls(**kwargs)
    except ValueError as exc:
        if not path:
            raise
        # A nested section's own check names its class ("PolicyLoss.clip_low=..."): the user
        # typed the dotted path ("loss.clip_low"), so the message names that instead.
        message = re.sub(rf"\b{re.escape(cls.__name__)}\.", f"{path}.", str(exc))
        raise ValueError(message) from None


def _default_of(field: dataclasses.Field) -> Any:
    """The field's default dataclass instance, or None when it has none."""
    if field.default_factory is not dataclasses.MISSING:
        default = field.default_factory()
    else:
        default = None if field.default is dataclasses.MISSING else field.default
    return default if dataclasses.is_dataclass(default) else None


_SCALARS = (bool, int, float, str)


def coerce_value(value: Any, field_type: Any, dotted: str) -> Any:
    """`value` as the scalar type a field declares (exact conversions only); other types pass."""
    is_union = typing.get_origin(field_type) in (typing.Union, types.UnionType)
    allowed = typing.get_args(field_type) if is_union else (field_type,)
    if isinstance(value, list) and any(typing.get_origin(t) is tuple for t in allowed):
        return tuple(value)  # YAML has lists only: a tuple field (betas: [0.9, 0.999]) as typed
    scalars = [t for t in allowed if t in _SCALARS]
    if not scalars or len(scalars) != len([t for t in allowed if t is not type(None)]):
        return value  # not a plain scalar field (dicts, tuples, dataclass unions): as given
    if value is None:
        if type(None) in allowed:
            return None
        raise ValueError(f"config {dotted}: a value is required ({_names(scalars)})")
    for target in scalars:
        converted = _convert(value, target)
        if converted is not _NO:
            return converted
    raise ValueError(f"config {dotted}={value!r}: must be {_names(scalars)}")


_NO = object()


def _convert(value: Any, target: type) -> Any:
    if target is bool:
        return value if isinstance(value, bool) else _NO
    if isinstance(value, bool):
        return _NO  # True is an int in Python, never a number in a config
    if target is str:
        return value if isinstance(value, str) else _NO
    if target is int:
        if isinstance(value, int):
            return value
        number = value
        if isinstance(value, str):
            try:
                number = float(value.strip())
            except ValueError:
                return _NO
        if isinstance(number, float) and number.is_integer():
            return int(number)
        return _NO
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return _NO
    return _NO


def _names(types: list[type]) -> str:
    return " or ".join(f"an {t.__name__}" if t is int else f"a {t.__name__}" for t in types)
