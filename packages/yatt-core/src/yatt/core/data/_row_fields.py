"""A row's field by name, where a name may be dotted for a nested field.

    get_field({"reward_model": {"ground_truth": "7"}}, "reward_model.ground_truth") -> "7"

verl's parquet files keep the answer nested (row["reward_model"]["ground_truth"]); a dotted
name reads it wherever a field is named (the prompt, the answer, the images, a judge
template's field). A key that is itself a column name wins over the nested reading (a column
literally named "a.b"), so a flat dataset reads as it always did.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

_MISSING = object()


def get_field(row: Mapping[str, Any], key: str, default: Any = None) -> Any:
    """row[key], or for a dotted key the nested field it names; `default` when absent."""
    value = _lookup(row, key)
    return default if value is _MISSING else value


def has_field(row: Mapping[str, Any], key: str) -> bool:
    """Whether the row holds the field `key` names (a None value counts as held)."""
    return _lookup(row, key) is not _MISSING


def field_names(row: Mapping[str, Any], *, max_depth: int = 3) -> Iterator[str]:
    """The row's field names, nested ones dotted (to `max_depth` levels), for error messages
    that list what a row has."""
    for key, value in row.items():
        yield str(key)
        if max_depth > 1 and isinstance(value, Mapping):
            for inner in field_names(value, max_depth=max_depth - 1):
                yield f"{key}.{inner}"


def top_level_key(row_keys: Any, key: str) -> str:
    """The column that holds field `key`: itself when a column has that name, else the part
    before the first dot (a Parquet reader reads whole top-level columns)."""
    if key in row_keys or "." not in key:
        return key
    return key.split(".", 1)[0]


def _lookup(row: Mapping[str, Any], key: str) -> Any:
    if key in row:
        return row[key]
    if "." not in key:
        return _MISSING
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return _MISSING
        value = value[part]
    return value


def with_field(row: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    """A copy of `row` with field `key` set to `value`; the dicts on a dotted key's path are
    copied, so the caller's nested fields are never changed."""
    if key in row or "." not in key:
        return {**row, key: value}
    head, rest = key.split(".", 1)
    return {**row, head: with_field(dict(row[head]), rest, value)}
