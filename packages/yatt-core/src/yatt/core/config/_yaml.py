"""Config text read as YAML, strictly: what PyYAML's safe loader lets through silently is an error
naming the file (or override) and the line.

    load_yaml(text, source)          one document; source names it in every error
    read_yaml_file(path)             a config file: UTF-8, one mapping of fields

- a key given twice in one mapping is refused (PyYAML keeps the last: a second `rollout:`
  section would drop the first's fields); YAML merge keys (`<<: *base`) may still be overridden;
- aliases that expand past MAX_EXPANDED_NODES values are refused (a "billion laughs" document
  is a few lines that every later walk, a JSON dump or a deepcopy, expands exponentially);
- "1e3", "-2E-5" are floats, as YAML 1.2 reads them (YAML 1.1, PyYAML's, needs a dot: "1.0e3";
  "1e3" stayed a string wherever no typed field converted it, inside dict-valued fields say);
- malformed YAML and bytes that are not UTF-8 are ValueErrors naming the source, line and column.
"""

from __future__ import annotations

import re
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import yaml

# Values (scalars and collections) a config may expand to through its aliases. A real config
# has a few hundred; a document past this is a typo or an attack, never a plan.
MAX_EXPANDED_NODES = 100_000


class _DuplicateKeyError(ValueError):
    """A mapping with a key given twice (not a yaml.YAMLError: never read as plain text)."""


class ConfigLoader(yaml.SafeLoader):
    """YAML's safe loader with duplicate keys refused and YAML 1.2's exponent floats."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        first_lines: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base` merges a mapping; its keys may be overridden
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if not isinstance(key, Hashable):
                continue  # the safe loader's own error names it
            if key in first_lines:
                raise _DuplicateKeyError(
                    f"line {line}: duplicate key {key!r} (first at line {first_lines[key]}); "
                    "give each key once"
                )
            first_lines[key] = line
        return super().construct_mapping(node, deep=deep)


# YAML 1.2's float without a dot ("1e3", "+2E-5"); the 1.1 forms with a dot stay PyYAML's.
# add_implicit_resolver copies the resolver table for this subclass: SafeLoader is unchanged.
ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def load_yaml(text: str, source: str) -> Any:
    """`text` as one YAML document. ValueError naming `source` (and the line) for a duplicate
    key or an alias bomb; yaml.YAMLError (a MarkedYAMLError: its line) for malformed YAML."""
    try:
        value = yaml.load(text, Loader=ConfigLoader)
    except _DuplicateKeyError as exc:
        raise ValueError(f"{source}: {exc}") from None
    if _expanded_size(value, {}) > MAX_EXPANDED_NODES:
        raise ValueError(
            f"{source}: its aliases (*name) expand to more than {MAX_EXPANDED_NODES} values; "
            "write the values out, or use fewer nested aliases"
        )
    return value


def _expanded_size(value: Any, sizes: dict[int, int]) -> int:
    """How many values `value` holds once every alias is expanded. Each shared object is
    measured once (`sizes`), so this costs the document's size, not its expansion's."""
    if not isinstance(value, dict | list):
        return 1
    known = sizes.get(id(value))
    if known is not None:
        return known
    sizes[id(value)] = MAX_EXPANDED_NODES + 1  # a self-reference ("&a [*a]") is unbounded
    children = [*value.keys(), *value.values()] if isinstance(value, dict) else value
    total = 1
    for child in children:
        total += _expanded_size(child, sizes)
        if total > MAX_EXPANDED_NODES:
            break
    sizes[id(value)] = total
    return total


def describe_yaml_error(exc: yaml.YAMLError) -> str:
    """A PyYAML error as "line L, column C: problem" (its mark is 0-based)."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    context = getattr(exc, "context", None)
    what = f"{context}, {problem}" if context else problem
    if mark is None:
        return what
    return f"line {mark.line + 1}, column {mark.column + 1}: {what}"


def read_yaml_file(path: str | Path) -> dict[str, Any]:
    """A config file's fields: UTF-8 YAML holding one mapping (an empty file: {}). Every
    problem is a ValueError naming the file, and where it has one the line."""
    source = f"--config {path}"
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{source}: cannot read it ({exc.strerror or exc})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ValueError(
            f"{source}: line {line}: byte {data[exc.start]:#04x} is not UTF-8; save the file "
            "as UTF-8"
        ) from None
    try:
        raw = load_yaml(text, source)
    except yaml.YAMLError as exc:
        raise ValueError(f"{source}: not valid YAML: {describe_yaml_error(exc)}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ValueError(
            f"{source}: must hold a mapping of fields (key: value lines), got "
            f"{type(raw).__name__} {raw!r:.80}"
        )
    return raw
