"""Reading tool calls out of a model's text: the Hermes/Qwen format and a registry for others.

A parser gets the assistant's decoded text (special tokens kept) and returns its message
content and its calls. A malformed call is data, not an error: it comes back as a ToolCall
with `error` set, and the driver answers it with an error observation the model reads.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(kw_only=True)
class ToolCall:
    """One call as the model wrote it. `error` set: it could not be read (then `name` may be
    "" and `arguments` empty), and the observation says why."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    def as_message_call(self) -> dict[str, Any]:
        """The OpenAI / Hugging Face chat form: {"type": "function", "function": {...}}."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(kw_only=True)
class ParsedTurn:
    content: str  # the text outside the calls
    calls: list[ToolCall]


@runtime_checkable
class ToolParser(Protocol):
    def parse(self, text: str) -> ParsedTurn: ...


class HermesToolParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number per turn: the format
    of the Hermes, Qwen2.5 and Qwen3 chat templates (their system prompt asks for it)."""

    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str) -> ParsedTurn:
        calls = [_read_call(body) for body in self._CALL.findall(text)]
        content = self._CALL.sub("", text)
        tail = content.find("<tool_call>")
        if tail >= 0:  # opened, never closed: the turn was cut or the model forgot
            calls.append(ToolCall(name="", error="a <tool_call> was not closed by </tool_call>"))
            content = content[:tail]
        return ParsedTurn(content=content.strip(), calls=calls)


def _read_call(body: str) -> ToolCall:
    try:
        value = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall(name="", error=f"the tool call is not valid JSON ({e.msg} at {e.pos})")
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return ToolCall(name="", error='the tool call needs {"name": ..., "arguments": {...}}')
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        with contextlib.suppress(json.JSONDecodeError):
            arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        return ToolCall(name=value["name"], error="the tool call's arguments must be an object")
    return ToolCall(name=value["name"], arguments=arguments)


# Name -> parser class; register_tool_parser adds one.
TOOL_PARSERS: dict[str, type] = {"hermes": HermesToolParser, "qwen": HermesToolParser}


def register_tool_parser(name: str, parser_cls: type) -> None:
    """Make `parser_cls` (a class with parse(text) -> ParsedTurn) selectable by `name`."""
    if not callable(getattr(parser_cls, "parse", None)):
        raise ValueError(f"tool parser {name!r}: {parser_cls!r} has no parse(text) method")
    TOOL_PARSERS[name] = parser_cls


def load_tool_parser(spec: str) -> ToolParser:
    """The parser named `spec` in TOOL_PARSERS, or the class at a "file.py:Class" spec."""
    if spec in TOOL_PARSERS:
        return TOOL_PARSERS[spec]()
    if ":" in spec:
        from yatt.rollout.env._specs import load_object

        cls = load_object(spec, field_name="tool_parser")
        parser = cls() if isinstance(cls, type) else cls
        if not callable(getattr(parser, "parse", None)):
            raise ValueError(f"EnvConfig.tool_parser={spec!r} has no parse(text) method")
        return parser
    raise ValueError(
        f"EnvConfig.tool_parser={spec!r} is unknown; use one of {sorted(TOOL_PARSERS)} or a "
        "'file.py:Class' spec"
    )
