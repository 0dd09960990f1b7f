"""A trainer's command line: `--config run.yaml`, then `key.sub=value` overrides, then flags.

    parser = ConfigParser(describe=lambda: "\\n".join(describe_config(MyConfig)))
    parser.add_argument("--resume", action="store_true")     # the trainer's own flags
    args = parser.parse(argv)                                 # argparse errors: exit 2
    with exit_on_config_error(should_show_traceback=args.traceback):
        raw = read_raw_config(args.config, args.overrides)   # file, then overrides in order
        cfg = config_from_dict(MyConfig, raw)                 # typed and checked

A config error (a ValueError raised before anything expensive starts) is one line on stderr,
naming the field and the fix, and exit code 2 as argparse's own errors; `--traceback` shows
where it was raised instead. `--num_steps 5` (a flag's form for a config field) is told the
form it needs: `num_steps=5`.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import yaml

from yatt.core.config._yaml import load_yaml, read_yaml_file

# The exit code of a config error: argparse's own for a bad command line.
CONFIG_ERROR_EXIT_CODE = 2


class ConfigParser(argparse.ArgumentParser):
    """argparse with a config's two inputs (--config FILE, key.sub=value overrides) and
    --traceback; --help ends with `describe()` (made only when help is shown: it reads the
    config classes' source for their comments)."""

    def __init__(self, *, describe: Callable[[], str] | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(**kwargs)
        self._describe = describe
        self.add_argument("--config", help="YAML file of config fields")
        self.add_argument(
            "--traceback",
            action="store_true",
            help="on a config error, show the traceback (default: one line, exit code 2)",
        )
        self.add_argument("overrides", nargs="*", help="key.sub=value, e.g. num_steps=5")

    def format_help(self) -> str:
        if self._describe is not None:
            self.epilog = self._describe()
        return super().format_help()

    def parse(self, argv: Sequence[str]) -> argparse.Namespace:
        """The flags and overrides (in order); an unknown --flag that names a config field's
        form (`--num_steps 5`, `--rollout.temperature=0.7`) is told `key=value`."""
        args, extras = self.parse_known_intermixed_args(list(argv))
        if extras:
            self.error(_unknown_flags_message(extras, list(argv)))
        return args


def _unknown_flags_message(extras: list[str], argv: list[str]) -> str:
    hints = []
    for extra in extras:
        if not extra.startswith("--"):
            continue
        key, sep, value = extra[2:].partition("=")
        if not sep:  # "--num_steps 5": the value is the next word, if any
            index = argv.index(extra)
            after = argv[index + 1] if index + 1 < len(argv) else ""
            value = after if after and not after.startswith("-") and "=" not in after else "..."
        hints.append(f"{key.replace('-', '_')}={value}")
    message = f"unrecognized arguments: {' '.join(extras)}"
    if hints:
        message += f"; config fields are key=value words without dashes: use {' '.join(hints)}"
    return message


def with_override(raw: Mapping[str, Any], item: str) -> dict[str, Any]:
    """`raw` with one `key.sub=value` override (`raw` is not changed). The value is read as
    YAML (1e-3, true, [a, b], {k: v}) when YAML reads the whole of it, else kept as typed:
    text YAML would cut at " #" (a comment to YAML, a character in a template or a folder
    name) or cannot read ("{prompt}{response}") stays text; the field's type then checks it."""
    dotted, sep, text = item.partition("=")
    if not sep or not dotted:
        raise ValueError(f"override {item!r} must look like key.sub=value")
    key, _, rest = dotted.partition(".")
    if not key:
        raise ValueError(f"override {item!r}: a key may not start with '.'")
    if rest:
        section = raw.get(key) or {}
        if not isinstance(section, Mapping):
            raise ValueError(f"override {item!r}: {key}={section!r} is not a section")
        return {**raw, key: with_override(section, f"{rest}={text}")}
    return {**raw, key: _override_value(text, item)}


def _override_value(text: str, item: str) -> Any:
    if _has_comment(text):
        return text  # YAML would drop what follows "#": keep what was typed
    try:
        return load_yaml(text, f"override {item!r}")
    except yaml.YAMLError:
        return text


def _has_comment(text: str) -> bool:
    """Whether YAML would read part of `text` as a comment: the last token it scans ends
    before the text does (a "#" inside quotes or a word, "a#b", is no comment)."""
    if "#" not in text:
        return False
    try:
        tokens = [token for token in yaml.scan(text) if not isinstance(token, yaml.StreamEndToken)]
    except yaml.YAMLError:
        return False  # not YAML at all: kept as text anyway
    end = tokens[-1].end_mark.index if tokens else 0
    return bool(text[end:].strip())


def read_raw_config(config_path: str | None, overrides: Sequence[str]) -> dict[str, Any]:
    """The plain values of a run: the --config file's fields (if any), then each override in
    order. ValueError naming the file and line, or the override."""
    raw: dict[str, Any] = read_yaml_file(config_path) if config_path else {}
    for item in overrides:
        raw = with_override(raw, item)
    return raw


@contextlib.contextmanager
def exit_on_config_error(*, should_show_traceback: bool = False, prog: str = "") -> Iterator[None]:
    """A ValueError raised inside becomes one line on stderr ("prog: error: ...") and
    SystemExit(2); should_show_traceback (--traceback) lets it propagate as it is."""
    try:
        yield
    except ValueError as exc:
        if should_show_traceback:
            raise
        name = prog or argparse.ArgumentParser().prog
        message = " ".join(str(exc).splitlines()) or type(exc).__name__
        print(f"{name}: error: {message} (--traceback shows where)", file=sys.stderr)
        raise SystemExit(CONFIG_ERROR_EXIT_CODE) from None
