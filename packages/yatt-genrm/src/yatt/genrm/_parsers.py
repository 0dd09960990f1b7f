"""Verdict text -> reward, read from one declared place.

A judge is told the format of its verdict (the judge templates state it) and the parser reads
that format only, at that place only: the LAST non-empty line of the judge's output, after any
reasoning. Everything else is unparsable (the GenRM applies its default reward and counts the
miss; parsing never raises on model output).

    text --last non-empty line--> "Verdict: Yes"  NFKC-normalized, it must match the
                                                   declared grammar whole, with no invisible
                                                   format character (zero-width, bidi)
         --an earlier line that matches with another value?--> unparsable (a reversal)
         --> the label's reward / the score

The grammar of a YesNoParser line (case-insensitive, spaces and tabs around its parts):

    [PREFIX] LABEL [.]            "Verdict: Yes", "Yes", "verdict: no."
    [PREFIX] \\boxed{LABEL} [.]    with is_boxed=True ("$\\boxed{No}$" too)

and of a ScoreParser line: `PREFIX N [/ HIGH] [.]` ("Score: 7", "Score: 7/10"), N in [low, high].
Markdown emphasis or code marks around the prefix, the label or the whole line are part of the
grammar ("Verdict: **No**", "**Yes**", "`Yes`"), so a reversal written in markdown is one too.
Lines are split at "\n" only (not at U+2028, \x85 and the other breaks str.splitlines knows).
Nothing else reads as a verdict: no negation ("not correct" is not a label), no quotes, no
verdict words in the middle of a sentence, no text after the verdict line. A
policy whose response talks the judge into writing "Yes" somewhere, or "not incorrect", or
"Verdict: Yes" followed by anything, gains nothing.

`find_boxed` and `strip_markup` stay here for the rule verifiers, which extract answers (not
verdicts) from responses.
"""

from __future__ import annotations

import math
import re
import unicodedata
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

Occurrence = Literal["first", "last"]

_MARKDOWN = re.compile(r"[*_`#>~|]")
_TEXT_WRAPPER_OR_BRACE = re.compile(r"\\(?:text|textbf|mathrm|mathbf)\s*\{|[{}]")
_BOXED_OR_BRACE = re.compile(r"\\(?:boxed|fbox)\s*\{|[{}]")

# Unicode format characters (category Cf: zero-width spaces and joiners, bidi controls, soft
# hyphen, tags...), as of Unicode 15. They are invisible: "Ye\u200bs" shows as "Yes". Dropped
# before matching; a test checks this class against unicodedata.
_FORMAT_CHARS = re.compile(
    "[\u00ad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u180e\u200b-\u200f"
    "\u202a-\u202e\u2060-\u2064\u2066-\u206f\ufeff\ufff9-\ufffb\U000110bd\U000110cd"
    "\U00013430-\U0001343f\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0001"
    "\U000e0020-\U000e007f]"
)
_SPACE = r"[ \t]*"
# Markdown emphasis and code marks a judge wraps a label in; the longest first.
_MARKS = r"\*\*|__|\*|_|`"
_NUMBER = r"[+-]?\d{1,12}(?:\.\d{1,12})?"


@runtime_checkable
class VerdictParser(Protocol):
    """Maps one judge generation to a reward, or None when no verdict is found."""

    def parse(self, text: str) -> float | None: ...


def normalize_verdict_text(text: str) -> str:
    """`text` without format characters, NFKC-normalized (full-width "Ｙｅｓ" -> "Yes")."""
    return unicodedata.normalize("NFKC", _FORMAT_CHARS.sub("", text))


def split_lines(text: str) -> list[str]:
    """`text`'s lines, split at "\n" only (a "\r" before it dropped). str.splitlines() also
    breaks at \v, \f, \x1c-\x1e, \x85, U+2028 and U+2029: a policy that gets one of those
    into the judge's last line ("Verdict: No\u2028Yes") must not make "Yes" a line of its own."""
    return [line[:-1] if line.endswith("\r") else line for line in text.split("\n")]


def _last_line(lines: list[str]) -> int | None:
    """Index of the last line holding more than whitespace."""
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].strip():
            return i
    return None


def _wrapped(name: str, inner: str) -> str:
    """`inner`, optionally wrapped in one markdown emphasis or code mark (**, *, __, _, `),
    the same mark on both sides (a regex conditional on the group `name`)."""
    return rf"(?P<{name}>{_MARKS})?{inner}(?({name})(?P={name}))"


def _declared_line(
    prefix: str, value: str, *, is_prefix_required: bool, is_boxed: bool, after_value: str = ""
) -> str:
    """The regex of a whole verdict line; group `value` holds the label or number, and
    `after_value` (outside a box) may follow it ("/10"). Markdown is part of the grammar: the
    prefix, the label and the whole line may each be wrapped in one emphasis or code mark
    ("**Verdict:** Yes", "Verdict: **No**", "`Yes`", "**Verdict: Yes**")."""
    words = prefix.split()
    head = r"\s+".join(re.escape(w) for w in words)
    head = rf"{_wrapped('prefix_mark', head)}{_SPACE}" if words else ""
    if head and not is_prefix_required:
        head = f"(?:{head})?"
    body = rf"(?P<value>{value})"
    if is_boxed:
        body = rf"(?P<dollar>\$?)\\boxed\{{{_SPACE}{body}{_SPACE}\}}(?P=dollar)"
    else:
        # A period may sit inside a mark ("**Yes.**"), never twice ("Yes..").
        body = rf"(?P<value_mark>{_MARKS})?{body}{after_value}(?(value_mark)\.?(?P=value_mark))"
    # One optional period, then spaces; a closing line mark, then spaces again. Never two
    # space runs side by side (the second comes only after a mark), so no backtracking.
    line_mark = rf"(?P<line_mark>{_MARKS})?"
    tail = rf"{_SPACE}(?:\.{_SPACE})?(?(line_mark)(?P=line_mark){_SPACE})"
    return rf"{_SPACE}{line_mark}{head}{body}{tail}"


def _read_line(pattern: re.Pattern[str], text: str) -> tuple[re.Match[str], int] | None:
    """The declared line's match and the line's index; None when the last line does not match
    or another line matches with a different value (the judge wrote two verdicts).

    The last line may hold no format character at all: an invisible character in a verdict is
    a trick ("1\u200b0" shows as 10), never a judge's plain answer. Earlier lines are read
    without them, so a hidden earlier verdict still counts as a reversal."""
    lines = split_lines(text)
    last = _last_line(lines)
    if last is None or _FORMAT_CHARS.search(lines[last]) is not None:
        return None
    match = pattern.fullmatch(unicodedata.normalize("NFKC", lines[last]))
    if match is None:
        return None
    value = match.group("value").lower()
    for line in lines[:last]:
        other = pattern.fullmatch(normalize_verdict_text(line))
        if other is not None and other.group("value").lower() != value:
            return None
    return match, last


def _check_prefix(owner: str, prefix: str, is_prefix_required: bool) -> None:
    if not isinstance(prefix, str):
        raise ValueError(f"{owner}.prefix={prefix!r}: must be a str ('' for none)")
    if is_prefix_required and not prefix.strip():
        raise ValueError(f"{owner}.is_prefix_required=True needs a non-empty prefix")


def _check_occurrence(owner: str, occurrence: str) -> None:
    if occurrence != "last":
        raise ValueError(
            f"{owner}.occurrence={occurrence!r}: the verdict is read from the judge's last "
            "line only; leave occurrence='last'"
        )


@dataclass(kw_only=True, frozen=True)
class YesNoParser:
    """A binary verdict on the judge's last line: `yes_label` gives `yes_reward`, `no_label`
    gives `no_reward`, anything else is unparsable.

    The line is `[prefix] label [.]` (module docstring): "Verdict: Yes", or the bare label
    ("Yes") unless `is_prefix_required`; with `is_boxed` the label is boxed ("Verdict:
    \\boxed{No}"). Case, surrounding spaces and full-width forms do not matter; an invisible
    format character (zero-width space, bidi control) on the line makes it unparsable. Earlier lines are the judge's reasoning and never decide, except that an
    earlier line in the same grammar with the other label makes the text unparsable (a judge
    that reverses itself has no single verdict).
    """

    yes_label: str = "Yes"
    no_label: str = "No"
    yes_reward: float = 1.0
    no_reward: float = -1.0
    prefix: str = "Verdict:"  # what opens the verdict line; '' for a bare label
    is_prefix_required: bool = False  # False: a bare label line also counts
    is_boxed: bool = False  # True: the label is written \boxed{Yes}
    occurrence: Occurrence = "last"  # kept for old callers; only "last" is accepted
    _pattern: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_occurrence("YesNoParser", self.occurrence)
        _check_prefix("YesNoParser", self.prefix, self.is_prefix_required)
        for name in ("yes_label", "no_label"):
            label = getattr(self, name)
            if not isinstance(label, str) or not label.strip() or label != label.strip():
                raise ValueError(
                    f"YesNoParser.{name}={label!r}: give a non-empty label without outer spaces"
                )
        if self.yes_label.lower() == self.no_label.lower():
            raise ValueError(
                f"YesNoParser: yes_label={self.yes_label!r} and no_label={self.no_label!r} "
                "are the same word"
            )
        for name in ("yes_reward", "no_reward"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"YesNoParser.{name}={getattr(self, name)!r}: must be finite")
        labels = "|".join(re.escape(label) for label in (self.yes_label, self.no_label))
        line = _declared_line(
            self.prefix,
            labels,
            is_prefix_required=self.is_prefix_required,
            is_boxed=self.is_boxed,
        )
        object.__setattr__(self, "_pattern", re.compile(line, re.IGNORECASE))

    @property
    def format_instruction(self) -> str:
        """The sentence that tells a judge this parser's format (templates append it)."""
        yes, no = self.yes_label, self.no_label
        if self.is_boxed:
            yes, no = f"\\boxed{{{yes}}}", f"\\boxed{{{no}}}"
        head = f"{self.prefix} " if self.prefix.strip() else ""
        return (
            f"End your reply with a last line that is exactly '{head}{yes}' or '{head}{no}', "
            "and nothing after it."
        )

    def parse(self, text: str) -> float | None:
        read = _read_line(self._pattern, text)
        if read is None:
            return None
        is_yes = read[0].group("value").lower() == self.yes_label.lower()
        return self.yes_reward if is_yes else self.no_reward

    def label_start(self, text: str) -> int | None:
        """Where the label starts in `text` (a character index), for reading the judge's label
        probabilities there; None when `text` does not parse or its verdict line is not written
        verbatim (normalization changed it, so its characters and tokens cannot be matched)."""
        read = _read_line(self._pattern, text)
        if read is None:
            return None
        match, index = read
        raw_lines = text.split("\n")
        line = raw_lines[index]
        if (line[:-1] if line.endswith("\r") else line) != match.string:
            return None
        offset = sum(len(raw) + 1 for raw in raw_lines[:index])  # each with its "\n"
        return offset + match.start("value")


@dataclass(kw_only=True, frozen=True)
class ScoreParser:
    """A pointwise score on the judge's last line, in [low, high], normalized to [0, 1].

    The line is `prefix N [/ high] [.]` ("Score: 7", "Score: 7/10", "score: 8.5."); with
    `is_boxed` the number is boxed ("Score: \\boxed{7}"). A score out of range, a scale other
    than `high`, a range ("7-8"), words after the number, or an earlier score line with another
    value do not parse. A "Score:" anywhere but the last line is reasoning, not the score.
    """

    low: float = 1.0
    high: float = 10.0
    should_normalize: bool = True  # False returns the raw score
    prefix: str = "Score:"
    is_prefix_required: bool = True  # False: a bare number line also counts
    is_boxed: bool = False
    occurrence: Occurrence = "last"  # kept for old callers; only "last" is accepted
    _pattern: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_occurrence("ScoreParser", self.occurrence)
        _check_prefix("ScoreParser", self.prefix, self.is_prefix_required)
        if not (math.isfinite(self.low) and math.isfinite(self.high) and self.low < self.high):
            raise ValueError(
                f"ScoreParser: low={self.low!r}, high={self.high!r}; need finite low < high"
            )
        line = _declared_line(
            self.prefix,
            _NUMBER,
            is_prefix_required=self.is_prefix_required,
            is_boxed=self.is_boxed,
            after_value=rf"(?:{_SPACE}/{_SPACE}(?P<scale>{_NUMBER}))?",
        )
        object.__setattr__(self, "_pattern", re.compile(line, re.IGNORECASE))

    @property
    def format_instruction(self) -> str:
        """The sentence that tells a judge this parser's format (templates append it)."""
        number = "\\boxed{N}" if self.is_boxed else "N"
        low, high = _plain(self.low), _plain(self.high)
        head = f"{self.prefix} " if self.prefix.strip() else ""
        return (
            f"End your reply with a last line that is exactly '{head}{number}', where N is a "
            f"number from {low} to {high}, and nothing after it."
        )

    def parse(self, text: str) -> float | None:
        read = _read_line(self._pattern, text)
        if read is None:
            return None
        match = read[0]
        scale = match.groupdict().get("scale")
        if scale is not None and float(scale) != self.high:
            return None
        value = float(match.group("value"))
        if not (self.low <= value <= self.high):
            return None
        if not self.should_normalize:
            return value
        return (value - self.low) / (self.high - self.low)


def _plain(number: float) -> str:
    """7.0 -> '7', 0.5 -> '0.5'."""
    return str(int(number)) if float(number).is_integer() else str(number)


def _boxed_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of every `\\boxed{...}` / `\\fbox{...}` content, braces matched, in order.

    One pass with a stack of open braces (None for a plain brace): an unclosed \\boxed{ costs
    nothing extra, where a scan from each opener to its closing brace is quadratic."""
    spans: list[tuple[int, int]] = []
    stack: list[int | None] = []
    for match in _BOXED_OR_BRACE.finditer(text):
        token = match.group()
        if token == "}":
            if stack:
                start = stack.pop()
                if start is not None:
                    spans.append((start, match.start()))
        elif token == "{":
            stack.append(None)
        else:
            stack.append(match.end())
    spans.sort()  # an inner box closes first; report boxes by where they open
    return spans


def find_boxed(text: str) -> list[str]:
    """Contents of every `\\boxed{...}` (and `\\fbox{...}`), braces matched, in order."""
    return [text[start:end] for start, end in _boxed_spans(text)]


def _unwrap_text_commands(text: str) -> str:
    """`\\text{Yes}`, `\\textbf{\\text{Yes}}` -> `Yes` in one pass (no rescan per nesting level)."""
    out: list[str] = []
    stack: list[int | None] = []  # per open brace: index in `out` of its wrapper command, or None
    position = 0
    for match in _TEXT_WRAPPER_OR_BRACE.finditer(text):
        out.append(text[position : match.start()])
        position = match.end()
        token = match.group()
        if token == "}":
            opener = stack.pop() if stack else None
            if opener is not None:
                out[opener] = ""  # drop the wrapper command and this, its closing brace
                continue
            out.append(token)
        elif token == "{":
            stack.append(None)
            out.append(token)
        else:
            stack.append(len(out))
            out.append(token)  # kept unless its closing brace comes
    out.append(text[position:])
    return "".join(out)


def strip_markup(text: str) -> str:
    """Drop markdown emphasis/heading/code marks and LaTeX text wrappers; keep the words."""
    return _MARKDOWN.sub(" ", _unwrap_text_commands(text))
