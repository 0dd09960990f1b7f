"""Reward functions for answer-checking tasks, named from a config as
`reward.functions: [examples/configs/math_rewards.py:exact_answer, ...]`.

Each is called as fn(prompt, response, reference, row) and returns a float, or None when it
cannot score the sample (counted as unparsable, never a crash).
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def exact_answer(prompt: str, response: str, reference: str | None, row: dict) -> float | None:
    """+1 when the response's last number equals the reference answer, -1 otherwise."""
    if reference is None:
        return None
    numbers = _NUMBER.findall(response)
    return 1.0 if numbers and numbers[-1] == reference.strip() else -1.0


def answer_format(prompt: str, response: str, reference: str | None, row: dict) -> float:
    """The share of the response's non-blank characters that are digits: 1.0 for a bare
    number, a small shaping reward that gives a group variance before any answer is right."""
    chars = [c for c in response if not c.isspace()]
    return sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0
