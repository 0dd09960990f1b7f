"""The benches' --compile-scope: the built-in engines' EngineConfig.compile_scope, one option
for every bench that builds engines, and the mark a run under a non-default scope carries."""

from __future__ import annotations

import argparse

SCOPES = ("step", "layers")  # EngineConfig.compile_scope's values; "step" is its default


def add_compile_scope_argument(parser: argparse.ArgumentParser, named: str) -> None:
    """--compile-scope; `named` says how a run under "layers" is told apart."""
    parser.add_argument(
        "--compile-scope",
        choices=SCOPES,
        default=SCOPES[0],
        help="the built-in engines' EngineConfig.compile_scope ('layers': each decoder layer "
        f"compiled once; {named})",
    )


def scope_mark(scope: str, separator: str = "_") -> str:
    """'' under the default scope, else e.g. '_clayers': what a report's or run's name gains."""
    return "" if scope == SCOPES[0] else f"{separator}c{scope}"
