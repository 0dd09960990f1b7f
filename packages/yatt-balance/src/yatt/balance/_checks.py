"""Validation of user input shared by the public functions.

Every check raises ValueError naming the argument, the bad value and what would work, so a
trainer fails at the call that received bad data instead of producing a silently wrong plan.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np


def as_nonnegative_array(values: Any, name: str) -> np.ndarray:
    """`values` as a 1-D float64 array of finite, non-negative numbers."""
    try:
        arr = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"{name} must be a 1-D sequence of numbers; got {type(values).__name__}: {exc}"
        ) from exc
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D (one number per item); got shape {arr.shape}")
    finite = np.isfinite(arr)
    if not finite.all():
        i = int(np.argmin(finite))
        raise ValueError(
            f"{name}[{i}] is {arr[i]}: every value must be finite; drop or clip that item"
        )
    if arr.size and arr.min() < 0:
        i = int(np.argmin(arr))
        raise ValueError(f"{name}[{i}] is {arr[i]}: every value must be >= 0")
    return arr


def as_int(value: Any, name: str, *, minimum: int) -> int:
    """`value` as an int >= minimum (bools and floats are refused: they hide mistakes)."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an int >= {minimum}; got the bool {value}")
    try:
        number = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int >= {minimum}; got {value!r}") from None
    if number < minimum:
        raise ValueError(f"{name} must be >= {minimum}; got {number}")
    return number


def as_positive_number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise ValueError(f"{name} must be a positive number; got {value!r}")
    number = float(value)
    if not np.isfinite(number) or number <= 0:
        raise ValueError(f"{name} must be a finite number > 0; got {value!r}")
    return number


def as_group_ids(groups: Any, num_items: int) -> tuple[np.ndarray, int]:
    """Map arbitrary group labels to dense ids 0..g-1 (in sorted label order, so every rank
    derives the same ids from the same labels). Returns (id per item, number of groups)."""
    try:
        labels = np.asarray(groups)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"groups must be a 1-D sequence of group labels; got {exc}") from exc
    if labels.ndim != 1 or labels.shape[0] != num_items:
        raise ValueError(
            f"groups must hold one label per item ({num_items} items); got shape {labels.shape}"
        )
    if num_items == 0:
        return np.zeros(0, dtype=np.int64), 0
    try:
        uniques, inverse = np.unique(labels, return_inverse=True)
    except TypeError as exc:
        raise ValueError(
            f"groups labels must be mutually comparable (e.g. all ints); {exc}"
        ) from exc
    return inverse.reshape(-1).astype(np.int64), int(uniques.shape[0])


def describe_equal_size_fix(num_items: int, k: int, what: str) -> str:
    """The message for equal_size=True when num_items is not divisible by k."""
    divisors = [d for d in range(1, num_items + 1) if num_items % d == 0]
    near = [d for d in divisors if d <= max(1, 4 * k)][-6:]
    down = num_items - num_items % k
    up = down + k
    return (
        f"equal_size=True needs the number of {what} ({num_items}) to be divisible by k={k}; "
        f"use k in {near} (divisors of {num_items}), or pass {down} or {up} {what} "
        f"(drop {num_items - down} or pad {up - num_items}), or set equal_size=False"
    )
