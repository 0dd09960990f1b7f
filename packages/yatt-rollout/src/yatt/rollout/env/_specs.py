"""Loading user code named by a spec: "path/to/file.py:Name" or "package.module:Name"."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any


def load_object(spec: str, *, field_name: str) -> Any:
    """The object a spec names; ValueError naming `field_name` for anything that fails."""
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise ValueError(
            f"EnvConfig.{field_name}={spec!r}: write 'path/to/file.py:Name' or 'module:Name'"
        )
    try:
        module = _import(where)
    except (Exception, SystemExit) as e:  # user code: report whatever it raised
        raise ValueError(
            f"EnvConfig.{field_name}={spec!r}: {where!r} does not import "
            f"({type(e).__name__}: {e}); fix the module or the path"
        ) from e
    value: Any = module
    for part in attr.split("."):
        if not hasattr(value, part):
            raise ValueError(f"EnvConfig.{field_name}={spec!r}: {where!r} has no {attr!r}")
        value = getattr(value, part)
    return value


def _import(where: str) -> Any:
    if where.endswith(".py"):
        path = Path(where).resolve()
        if not path.is_file():
            raise FileNotFoundError(f"no file {path}")
        # One module per file (a name from its path), loaded once per process.
        name = "yatt_env_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
        if name in sys.modules:
            return sys.modules[name]
        module_spec = importlib.util.spec_from_file_location(name, path)
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
            module_spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        return module
    return importlib.import_module(where)
