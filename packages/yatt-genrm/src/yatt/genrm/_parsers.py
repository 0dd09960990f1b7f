"""Verdict text -> reward.

Judges write free text: "**Yes**", "\\boxed{No}", "Score: 8/10.", "I'd say 7 out of 10". A parser
finds the verdict in it and returns a float, or None when it cannot (the GenRM then applies its
default reward and counts the miss; parsing never raises on model output).

    text --strip markdown--> plain --\\boxed{} present?--> boxed content (first/last)
                                    \\--otherwise-------> keyword / number (first/last occurrence)
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

Occurrence = Literal["first", "last"]

_MARKDOWN = re.compile(r"[*_`#>~|]")
_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|mathrm|mathbf)\{([^{}]*)\}")


@runtime_checkable
class VerdictParser(Protocol):
    """Maps one judge generation to a reward, or None when no verdict is found."""

    def parse(self, text: str) -> float | None: ...


def find_boxed(text: str) -> list[str]:
    """Contents of every `\\boxed{...}` (and `\\fbox{...}`), braces matched, in order."""
    found: list[str] = []
    for match in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    found.append(text[start:i])
                    break
    return found


def strip_markup(text: str) -> str:
    """Drop markdown emphasis/heading/code marks and LaTeX text wrappers; keep the words."""
    previous = None
    while previous != text:  # \text{\textbf{Yes}} needs two passes
        previous, text = text, _TEXT_WRAPPER.sub(r"\1", text)
    return _MARKDOWN.sub(" ", text)


def _pick(items: Sequence[str], occurrence: Occurrence) -> str:
    return items[0] if occurrence == "first" else items[-1]


def _check_occurrence(occurrence: str) -> None:
    if occurrence not in ("first", "last"):
        raise ValueError(f"occurrence={occurrence!r}: use 'first' or 'last'")


@dataclass(kw_only=True, frozen=True)
class YesNoParser:
    """A binary verdict: a yes-word gives `yes_reward`, a no-word gives `no_reward`.

    Words match whole and case-insensitively ("Yesterday" and "nobody" are not verdicts). A
    `\\boxed{}` verdict wins over free text; otherwise `occurrence` picks the first or the last
    verdict word, since judges often reason first ("no doubt...") and conclude last.
    """

    yes_words: tuple[str, ...] = ("yes", "correct")
    no_words: tuple[str, ...] = ("no", "incorrect")
    yes_reward: float = 1.0
    no_reward: float = -1.0
    occurrence: Occurrence = "last"

    def __post_init__(self) -> None:
        _check_occurrence(self.occurrence)
        if not self.yes_words or not self.no_words:
            raise ValueError("YesNoParser: yes_words and no_words must both be non-empty")
        overlap = {w.lower() for w in self.yes_words} & {w.lower() for w in self.no_words}
        if overlap:
            raise ValueError(f"YesNoParser: words {sorted(overlap)} are both yes and no words")
        for name in ("yes_reward", "no_reward"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"YesNoParser.{name}={getattr(self, name)!r}: must be finite")

    def _pattern(self) -> re.Pattern[str]:
        # Longest first so "incorrect" is not read as its suffix "correct".
        words = sorted({*self.yes_words, *self.no_words}, key=len, reverse=True)
        # A word preceded by "not " flips meaning ("not correct"); match it as a unit.
        alternatives = "|".join(re.escape(w) for w in words)
        return re.compile(rf"(?<![\w-])(not\s+)?({alternatives})(?![\w-])", re.IGNORECASE)

    def _reward(self, negated: bool, word: str) -> float:
        is_yes = word.lower() in {w.lower() for w in self.yes_words}
        if negated:
            is_yes = not is_yes
        return self.yes_reward if is_yes else self.no_reward

    def _scan(self, text: str) -> float | None:
        matches = list(self._pattern().finditer(strip_markup(text)))
        if not matches:
            return None
        m = matches[0] if self.occurrence == "first" else matches[-1]
        return self._reward(m.group(1) is not None, m.group(2))

    def parse(self, text: str) -> float | None:
        boxed = find_boxed(text)
        if boxed:
            return self._scan(_pick(boxed, self.occurrence))
        return self._scan(text)


# A number, optionally followed by its scale ("8/10", "8 out of 10") so the scale is not read
# as a second score.
_NUMBER = r"[-+]?\d+(?:\.\d+)?"
_SCORE = re.compile(rf"(?<![\w.])({_NUMBER})(?:\s*(?:/|out\s+of)\s*(\d+(?:\.\d+)?))?(?![\w])")
# "1-10", "1 to 10", "between 1 and 10": the judge quoting the scale, not giving a score.
_RANGE = re.compile(r"(?<![\w.])\d+(?:\.\d+)?\s*(?:-|to|and)\s*\d+(?:\.\d+)?(?![\w.])")


@dataclass(kw_only=True, frozen=True)
class ScoreParser:
    """A pointwise score in [low, high], normalized to [0, 1]; out-of-range scores do not parse.

    "7/10" and "7 out of 10" read as 7; a stated scale other than `high` (e.g. "3/5") is rescaled
    to [low, high]. A scale the judge quotes ("on a scale of 1-10") is skipped.
    """

    low: float = 1.0
    high: float = 10.0
    occurrence: Occurrence = "last"
    should_normalize: bool = True  # False returns the raw score

    def __post_init__(self) -> None:
        _check_occurrence(self.occurrence)
        if not (math.isfinite(self.low) and math.isfinite(self.high) and self.low < self.high):
            raise ValueError(
                f"ScoreParser: low={self.low!r}, high={self.high!r}; need finite low < high"
            )

    def _scan(self, text: str) -> float | None:
        plain = _RANGE.sub(" ", strip_markup(text))
        matches = list(_SCORE.finditer(plain))
        if not matches:
            return None
        m = matches[0] if self.occurrence == "first" else matches[-1]
        value = float(m.group(1))
        if m.group(2) is not None:
            scale = float(m.group(2))
            if scale <= 0:
                return None
            if scale != self.high:
                value = self.low + value / scale * (self.high - self.low)
        if not (self.low <= value <= self.high):
            return None
        if not self.should_normalize:
            return value
        return (value - self.low) / (self.high - self.low)

    def parse(self, text: str) -> float | None:
        boxed = find_boxed(text)
        if boxed:
            return self._scan(_pick(boxed, self.occurrence))
        return self._scan(text)
