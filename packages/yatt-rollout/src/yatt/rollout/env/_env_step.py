"""One environment step in a UserCodePool worker: reset, a method call or get_reward on an
instance rebuilt from its attributes. Standard library only: workers load this file by path
(importing yatt would pull in torch for every worker).

The instance lives in the parent as its __dict__ between calls (one trajectory, any worker):
a call that times out is killed with its worker and leaves the state as it was before it.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

_classes: dict[str, type] = {}


def _class_of(spec: str) -> type:
    if spec not in _classes:
        where, _, qualname = spec.rpartition(":")
        if where.endswith(".py"):
            path = Path(where).resolve()
            name = "yatt_env_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
            module = sys.modules.get(name)
            if module is None:
                module_spec = importlib.util.spec_from_file_location(name, path)
                module = importlib.util.module_from_spec(module_spec)
                sys.modules[name] = module
                module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
        value: Any = module
        for part in qualname.split("."):
            value = getattr(value, part)
        _classes[spec] = value
    return _classes[spec]


def _rebuilt(spec: str, state: dict[str, Any]) -> Any:
    env = object.__new__(_class_of(spec))
    env.__dict__.update(state)
    return env


def reset(spec: str, row: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    env = _class_of(spec)()
    first = env.reset(**row) if callable(getattr(env, "reset", None)) else None
    return env.__dict__, first


def call(spec: str, state: dict[str, Any], name: str, arguments: dict[str, Any]) -> tuple:
    env = _rebuilt(spec, state)
    result = getattr(env, name)(**arguments)
    return env.__dict__, result


def get_reward(spec: str, state: dict[str, Any]) -> Any:
    return _rebuilt(spec, state).get_reward()
