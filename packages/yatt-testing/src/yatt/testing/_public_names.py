"""Frozen public names: each package's tests/test_public_names.py lists its public modules and
their names, so adding, renaming or removing one is a deliberate edit of that list, never a side
effect. A module's public names are its `__all__` (else every name in dir() without a leading
"_"); every public submodule (no "_" in its dotted path) must be listed too."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Collection, Mapping, Sequence


def public_names_of(module_name: str) -> list[str]:
    module = importlib.import_module(module_name)
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n in dir(module) if not n.startswith("_")]
    return sorted(names)


def check_public_names(module_name: str, frozen: Sequence[str], list_file: str) -> None:
    """Raise AssertionError naming what `module_name` added or lost against `frozen`, or an
    `__all__` entry it does not define; `list_file` is where the list lives (the fix)."""
    module = importlib.import_module(module_name)
    got = set(public_names_of(module_name))
    added, removed = sorted(got - set(frozen)), sorted(set(frozen) - got)
    if added or removed:
        raise AssertionError(
            f"{module_name}'s public names changed: new {added}, gone {removed}; if that is "
            f"deliberate, edit PUBLIC_NAMES in {list_file} to match"
        )
    missing = sorted(n for n in got if not hasattr(module, n))
    if missing:
        raise AssertionError(f"{module_name}.__all__ lists {missing}, which it does not define")


def check_public_modules(
    top_name: str,
    frozen: Mapping[str, object],
    list_file: str,
    *,
    ignored: Collection[str] = (),
) -> None:
    """Raise AssertionError unless the public modules under `top_name` (itself included) are
    exactly the keys of `frozen`; `ignored`: modules left out on purpose (a deprecated alias)."""
    top = importlib.import_module(top_name)
    found = {top_name}
    for info in pkgutil.walk_packages(top.__path__, f"{top_name}."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            found.add(info.name)
    found -= set(ignored)
    unlisted, gone = sorted(found - set(frozen)), sorted(set(frozen) - found)
    if unlisted or gone:
        raise AssertionError(
            f"public modules not in PUBLIC_NAMES: {unlisted}; listed but gone: {gone}; if that "
            f"is deliberate, edit PUBLIC_NAMES in {list_file} to match"
        )
