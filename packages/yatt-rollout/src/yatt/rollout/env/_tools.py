"""What a user's environment and tools look like to the driver: each environment kind with its
tools' JSON schemas, checked before any model loads.

An environment is a plain class, one instance per trajectory (TRL's `environment_factory`):
    reset(**row) -> str | None   the first user message (None: the row's own prompt)
    any public method            a tool; its schema comes from type hints and the docstring
    get_reward() -> float        optional: the episode's reward, read when it ends
Plain functions are tools too; they join every environment's methods. The schemas are the
ones `transformers.utils.get_json_schema` builds, the form chat templates render.
"""

from __future__ import annotations

import inspect
import sys
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from transformers.utils import get_json_schema

from yatt.rollout.env._specs import load_object

# Methods of an environment that are not tools.
NOT_TOOLS = frozenset({"reset", "get_reward", "close"})


@dataclass(kw_only=True)
class EnvKind:
    """One environment class (or none: tools only) with every tool a trajectory of it can call.

    `functions`: the plain function tools by name; the rest of `schemas` are methods of an
    instance of `factory`.
    """

    name: str
    factory: Callable[[], Any] | None
    schemas: list[dict[str, Any]]
    functions: dict[str, Callable[..., Any]] = field(default_factory=dict)
    has_reward: bool = False
    # How a worker process loads the class and each function: "file.py:Name" / "module:Name"
    # (None: only by pickling, or not at all).
    spec: str | None = None
    function_specs: dict[str, str | None] = field(default_factory=dict)

    @property
    def tool_names(self) -> list[str]:
        return [schema["function"]["name"] for schema in self.schemas]


def build_env_kinds(
    environment: Sequence[str | type], tools: Sequence[str | Callable[..., Any]]
) -> dict[str, EnvKind]:
    """Every environment kind by class name ("" when there is no environment class).

    Specs are loaded here; ValueError naming the field for one that does not import, an
    environment with no tools, a tool without type hints or docstring, or two tools of one name.
    """
    if not environment and not tools:
        raise ValueError(
            "EnvConfig.environment and EnvConfig.tools are both empty: give an environment "
            "class ('my_env.py:MathEnv') or tools (['my_tools.py:search'])"
        )
    functions: dict[str, Callable[..., Any]] = {}
    function_specs: dict[str, str | None] = {}
    function_schemas = []
    for item in tools:
        fn = load_object(item, field_name="tools") if isinstance(item, str) else item
        if not inspect.isfunction(fn) and not inspect.isbuiltin(fn) and not callable(fn):
            raise ValueError(f"EnvConfig.tools: {item!r} is not a function")
        schema = _schema_of(fn, where=f"EnvConfig.tools: {item!r}")
        name = schema["function"]["name"]
        if name in functions:
            raise ValueError(
                f"EnvConfig.tools: two tools are named {name!r}; rename one (the model calls "
                "tools by name)"
            )
        functions[name] = fn
        function_specs[name] = item if isinstance(item, str) else spec_of(fn)
        function_schemas.append(schema)
    if not environment:
        kind = EnvKind(
            name="",
            factory=None,
            schemas=function_schemas,
            functions=functions,
            function_specs=function_specs,
        )
        return {"": kind}
    kinds: dict[str, EnvKind] = {}
    for item in environment:
        cls = load_object(item, field_name="environment") if isinstance(item, str) else item
        where = f"EnvConfig.environment: {item!r}"
        if not inspect.isclass(cls):
            raise ValueError(f"{where} is not a class; point at the environment class")
        schemas = [
            _schema_of(types.MethodType(method, _UNBOUND), where=f"{where} method {name!r}")
            for name, method in _public_methods(cls)
        ]
        for schema in schemas:
            if schema["function"]["name"] in functions:
                raise ValueError(
                    f"{where}: method {schema['function']['name']!r} has the name of a tool in "
                    "EnvConfig.tools; rename one (the model calls tools by name)"
                )
        if not schemas and not functions:
            raise ValueError(
                f"{where} has no tools: give it a public method with type hints and a "
                "docstring (each is a tool), or list function tools in EnvConfig.tools"
            )
        if cls.__name__ in kinds:
            raise ValueError(f"{where}: two environments are named {cls.__name__!r}")
        kinds[cls.__name__] = EnvKind(
            name=cls.__name__,
            factory=cls,
            schemas=schemas + function_schemas,
            functions=functions,
            has_reward=callable(getattr(cls, "get_reward", None)),
            spec=item if isinstance(item, str) else spec_of(cls),
            function_specs=function_specs,
        )
    return kinds


def spec_of(obj: Any) -> str | None:
    """A spec a worker process can load `obj` from: its file for a module loaded from a path
    by a spec, else its importable module; None for a local or __main__ definition."""
    module = sys.modules.get(getattr(obj, "__module__", "") or "")
    qualname = getattr(obj, "__qualname__", "")
    if module is None or "<locals>" in qualname or module.__name__ == "__main__":
        return None
    if module.__name__.startswith("yatt_env_") and getattr(module, "__file__", None):
        return f"{module.__file__}:{qualname}"
    return f"{module.__name__}:{qualname}"


_UNBOUND = object()  # binds a method for its schema only (drops `self`)


def _public_methods(cls: type) -> list[tuple[str, Callable[..., Any]]]:
    methods = []
    for name, member in inspect.getmembers(cls, predicate=inspect.isfunction):
        if name.startswith("_") or name in NOT_TOOLS:
            continue
        if isinstance(inspect.getattr_static(cls, name), staticmethod):
            continue  # a helper, not an action on the instance
        methods.append((name, member))
    return methods


def _schema_of(fn: Callable[..., Any], *, where: str) -> dict[str, Any]:
    try:
        return get_json_schema(fn)
    except Exception as e:  # transformers raises its own exception types
        raise ValueError(
            f"{where}: no tool schema ({e}); give every parameter a type hint and the function "
            "a Google-style docstring with an 'Args:' line per parameter"
        ) from e
