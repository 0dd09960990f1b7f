"""One help line per config field: its dotted name, default and the comment beside it (--help).

The doc comes from the class's source (a config dataclass documents each field with a comment,
so `--help` and the code never disagree), else the class docstring, else a Literal's choices.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from typing import Any

_FIELD_LINE = re.compile(r"^\s+(\w+)\s*:[^#]*?(?:#\s*(.*))?$")
_COMMENT_LINE = re.compile(r"^\s*#\s?(.*)$")
_MAX_DOC_CHARS = 100


def describe_config(config: Any, *, prefix: str = "") -> list[str]:
    """One line per leaf field of a config dataclass (or instance): its dotted name, default
    value and a one-line doc (for `--help`). The doc is the comment beside the field, else the
    first sentence of the comment block right above it, else of a "name: ..." paragraph of the
    class docstring, else a Literal type's choices."""
    cls = config if isinstance(config, type) else type(config)
    comments: dict[str, str] = {}
    # A subclass's field inherits its base's doc unless it documents the field again (a
    # trainer's section extends a package's config class).
    for base in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(base):
            continue
        try:
            own = _field_comments(inspect.getsource(base))
        except (OSError, TypeError):
            own = {}
        comments |= {**_docstring_comments(base), **own}
    hints = typing.get_type_hints(cls)
    lines = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if not isinstance(config, type):
            value = getattr(config, f.name)
        elif f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            value = dataclasses.MISSING
        name = prefix + f.name
        if dataclasses.is_dataclass(value):
            lines += describe_config(value, prefix=name + ".")
            continue
        shown = "(required)" if value is dataclasses.MISSING else repr(value)
        doc = comments.get(f.name, "")
        if not doc and typing.get_origin(hints.get(f.name)) is typing.Literal:
            doc = "one of " + ", ".join(repr(choice) for choice in typing.get_args(hints[f.name]))
        lines.append(f"{name} = {shown}" + (f"  # {doc}" if doc else ""))
    return lines


def _field_comments(source: str) -> dict[str, str]:
    """{field name: one-line doc} from a class's source (see describe_config)."""
    comments: dict[str, str] = {}
    block: list[str] = []
    for line in source.splitlines():
        comment = _COMMENT_LINE.match(line)
        if comment:
            block.append(comment.group(1).strip())
            continue
        field_line = _FIELD_LINE.match(line)
        if field_line:
            name, beside = field_line.groups()
            doc = beside.strip() if beside else _first_sentence(" ".join(block))
            if doc:  # a later line (the field itself, after a docstring's "name: ...") wins
                comments[name] = doc
        block = []
    return comments


def _docstring_comments(cls: type) -> dict[str, str]:
    """{field name: one-line doc} from the paragraphs of `cls`'s docstring that start "name:"."""
    comments = {}
    names = {f.name for f in dataclasses.fields(cls)}
    for paragraph in inspect.cleandoc(cls.__doc__ or "").split("\n\n"):
        name, sep, text = paragraph.partition(":")
        if sep and name in names:
            comments[name] = _first_sentence(" ".join(text.split()))
    return comments


_SENTENCE_END = re.compile(r"\.\s+(?=[A-Z])")  # not "e.g. (" nor "0.5"


def _first_sentence(text: str) -> str:
    sentence = _SENTENCE_END.split(text, maxsplit=1)[0]
    if len(sentence) <= _MAX_DOC_CHARS:
        return sentence
    return sentence[: _MAX_DOC_CHARS - 3].rsplit(" ", 1)[0] + "..."
