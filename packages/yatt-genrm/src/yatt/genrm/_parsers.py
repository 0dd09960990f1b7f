"""Verdict text -> reward.

Judges write free text: "**Yes**", "\\boxed{No}", "Verdict: No", "Score: 8/10.", "Incorrect. The
correct answer is 7." A parser reads the verdict only from designated positions, never from
wherever a verdict word happens to appear last, and returns a float, or None when it finds no
verdict or an ambiguous one (the GenRM then applies its default reward and counts the miss;
parsing never raises on model output).

    text --quoted text blanked--> "...", curly quotes, 'a b', ```fences```, "> " lines drop out
         --markdown stripped----> plain
         1. a \\boxed{} whose whole content is a verdict    (`occurrence` picks among several)
         2. a marker and its value: a line "Verdict: No";   (`occurrence` picks among several)
            "Score: 7" anywhere
         3. else the text's first and last words: either one decides, both must agree
            (each parser's docstring says which words count there)

A verdict phrase reads negation ("not correct", "isn't correct") and is ambiguous when it joins
both readings ("Yes and no", "Yes or No", "7 or 8"). Text the judge quotes (usually the response
under review) never decides, except a bare quoted verdict that is the whole text or follows a
marker (`Verdict: "Yes"`). Every scan here is linear in the text's length: verdict texts come
from a model and may be huge or adversarial.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

Occurrence = Literal["first", "last"]

_MARKDOWN = re.compile(r"[*_`#>~|]")
_TEXT_WRAPPER_OR_BRACE = re.compile(r"\\(?:text|textbf|mathrm|mathbf)\s*\{|[{}]")
_BOXED_OR_BRACE = re.compile(r"\\(?:boxed|fbox)\s*\{|[{}]")

# Quoted spans, leftmost first. Each alternative stops at the next opening mark, so a text full
# of unclosed quotes is still scanned once. Single quotes count only around words ('Yes'), not
# as apostrophes ("response's"). A "> " line is a Markdown block quote.
_QUOTED = re.compile(
    r"```.*?```"
    r"|\"[^\"]*\""
    r"|\u201c[^\u201c\u201d]*\u201d"
    r"|\u2018[^\u2018\u2019\n]*\u2019"
    r"|(?<!\w)'[^'\n]*'(?!\w)"
    r"|(?P<block_quote>^[^\S\n]*>[^\n]*)",
    re.DOTALL | re.MULTILINE,
)
_QUOTE_PLACEHOLDER = ' " '
_WORD = re.compile(r"\w")
# How far before a quoted verdict its marker may start ("**Final verdict:** " fits), and how much
# of a text's end may hold its closing verdict phrase; both keep the scans linear.
_MARKER_LOOKBACK_CHARS = 64
_TAIL_CHARS = 256

# Words allowed between a negation and the verdict word: "not entirely correct", "not the
# correct answer".
_NEGATION = (
    r"(?:(?<![\w-])(?:not|never)|n't)\s+"
    r"(?:(?:entirely|fully|completely|quite|exactly|totally|really|actually|necessarily"
    r"|the|a|an)\s+){0,2}"
)
# A verdict phrase counts only where it ends a clause: at the end, before a line break or before
# punctuation. "No doubt it is right" and "No errors found" are not verdicts.
_CLAUSE_END = r"(?=[^\S\n]*(?:\Z|\n|[^\w\s]))"
# What may sit between a marker and its value on the marker's line ("Verdict:", "Verdict -",
# "The verdict is"), plus one line break for a heading ("### Verdict\nNo"). Signs are not
# separators: "Score: -3" is a negative score.
_MARKER_SEPARATOR = (
    r"[^\w\n+\-]*(?:-[^\S\n]+[^\w\n+\-]*)?(?:(?:is|was|of)\b[^\w\n+\-]*)?(?:\n[^\w\n+\-]*)?"
)
_MARKER_PREFIX = r"^[^\w\n]*(?:(?:my|the|our|overall|final|revised)\s+)*"


@runtime_checkable
class VerdictParser(Protocol):
    """Maps one judge generation to a reward, or None when no verdict is found."""

    def parse(self, text: str) -> float | None: ...


class _Ambiguous:
    """A verdict position that holds both readings; parses to None, and is not skipped."""

    def __repr__(self) -> str:
        return "AMBIGUOUS"


AMBIGUOUS = _Ambiguous()
_Reading = float | _Ambiguous | None  # None: this position holds no verdict


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


def _blank_quotes(
    text: str, is_bare_verdict: Callable[[str], bool], marker_tail: re.Pattern[str]
) -> str:
    """`text` with each quoted span replaced by a placeholder, except a bare quoted verdict that
    is the whole text (`"Yes"`) or follows a marker on its line (`Verdict: "Yes"`)."""
    first_word = _WORD.search(text)
    first = first_word.start() if first_word else len(text)
    last = _end_of_words(text)
    out: list[str] = []
    position = 0
    for match in _QUOTED.finditer(text):
        start, end = match.span()
        if match.lastgroup != "block_quote" and is_bare_verdict(text[start + 1 : end - 1]):
            is_whole = first >= start and last <= end
            # A marker sits within a short distance before its value: a bounded look back
            # keeps a line of many quoted verdicts linear.
            window = max(0, start - _MARKER_LOOKBACK_CHARS)
            if is_whole or marker_tail.search(text, window, start) is not None:
                continue
        out.append(text[position:start])
        out.append(_QUOTE_PLACEHOLDER)
        position = end
    out.append(text[position:])
    return "".join(out)


def _end_of_words(text: str) -> int:
    """The index just past the last word character of `text` (0 when there is none)."""
    end = len(text)
    while end and not (text[end - 1].isalnum() or text[end - 1] == "_"):
        end -= 1
    return end


def _pick(readings: Sequence[_Reading], occurrence: Occurrence) -> _Reading:
    found = [r for r in readings if r is not None]
    if not found:
        return None
    return found[0] if occurrence == "first" else found[-1]


def _agree(lead: _Reading, tail: _Reading) -> _Reading:
    """The text's first and last positions: one alone decides; two that differ are ambiguous."""
    if lead is AMBIGUOUS or tail is AMBIGUOUS:
        return AMBIGUOUS
    if lead is None:
        return tail
    if tail is None or tail == lead:
        return lead
    return AMBIGUOUS


def _read_in_order(parser, plain: str) -> _Reading:
    """The module docstring's order: a boxed verdict, else a marker's value, else the ends."""
    boxed = [parser._reading(parser._whole.fullmatch(b)) for b in find_boxed(plain)]
    reading = _pick(boxed, parser.occurrence)
    if reading is None:
        markers = [parser._reading(m) for m in parser._marker.finditer(plain)]
        reading = _pick(markers, parser.occurrence)
    if reading is None:
        reading = parser._ends(plain)
    return reading


def _reward(reading: _Reading) -> float | None:
    return None if reading is None or isinstance(reading, _Ambiguous) else reading


def _check_occurrence(occurrence: str) -> None:
    if occurrence not in ("first", "last"):
        raise ValueError(f"occurrence={occurrence!r}: use 'first' or 'last'")


def _check_markers(owner: str, markers: tuple[str, ...]) -> None:
    if not markers or not all(isinstance(m, str) and m.strip() for m in markers):
        raise ValueError(f"{owner}.markers={markers!r}: give one or more non-empty words")


def _alternatives(words: Sequence[str]) -> str:
    # Longest first so "incorrect" is not read as its suffix "correct".
    return "|".join(re.escape(w) for w in sorted(set(words), key=len, reverse=True))


def _marker_words(markers: Sequence[str]) -> str:
    return "|".join(r"\s+".join(re.escape(part) for part in m.split()) for m in markers)


def _yes_no_phrase(words: str) -> str:
    """A verdict phrase: groups (negation, word) and, for "X and/or Y", (negation2, word2)."""
    one = rf"({_NEGATION})?(?<![\w-])({words})(?![\w-])"
    return rf"{one}(?:[^\S\n]*(?:\band\b|\bor\b|/|&)[^\S\n]*{one})?"


@dataclass(kw_only=True, frozen=True)
class YesNoParser:
    """A binary verdict: a yes-word gives `yes_reward`, a no-word gives `no_reward`.

    Read, in order: a `\\boxed{}` verdict; a line that starts with a marker ("Verdict: No",
    "**Final answer:** Yes"); else the first and the last words of the text, which must agree
    when both are verdicts ("No, the correct answer is 7." reads No: "7" is no verdict). Words
    match whole and case-insensitively ("Yesterday", "nobody", "yes-man" are not verdicts), a
    negation flips them ("not correct", "isn't correct"), and a phrase with both readings ("Yes
    and no", "Yes or No") does not parse. `occurrence` picks among several boxed or marker
    verdicts: judges that revise write the final one last.
    """

    yes_words: tuple[str, ...] = ("yes", "correct")
    no_words: tuple[str, ...] = ("no", "incorrect")
    yes_reward: float = 1.0
    no_reward: float = -1.0
    occurrence: Occurrence = "last"
    # Line openers whose value is the verdict; matched case-insensitively, after markdown. Not a
    # bare "answer": judges restate the response's answer ("Answer: No") on lines of their own.
    markers: tuple[str, ...] = ("verdict", "final verdict", "final answer", "judgment", "judgement")
    # Built from the fields above in __post_init__.
    _yes: frozenset[str] = field(init=False, repr=False, compare=False)
    _leading: re.Pattern[str] = field(init=False, repr=False, compare=False)
    _phrase_at_end: re.Pattern[str] = field(init=False, repr=False, compare=False)
    _whole: re.Pattern[str] = field(init=False, repr=False, compare=False)
    _marker: re.Pattern[str] = field(init=False, repr=False, compare=False)
    _marker_tail: re.Pattern[str] = field(init=False, repr=False, compare=False)

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
        _check_markers("YesNoParser", self.markers)
        phrase = _yes_no_phrase(_alternatives((*self.yes_words, *self.no_words)))
        marker = rf"{_MARKER_PREFIX}(?:{_marker_words(self.markers)})\b"
        flags = re.IGNORECASE | re.MULTILINE
        patterns = {
            "_yes": frozenset(w.lower() for w in self.yes_words),
            "_leading": re.compile(rf"[\W_]*{phrase}{_CLAUSE_END}", flags),
            "_phrase_at_end": re.compile(rf"{phrase}\Z", flags),
            "_whole": re.compile(rf"[\W_]*{phrase}[\W_]*", flags),
            "_marker": re.compile(rf"{marker}{_MARKER_SEPARATOR}(?:{phrase}{_CLAUSE_END})?", flags),
            "_marker_tail": re.compile(rf"{marker}[^\w\n]*(?:(?:is|was)\b[^\w\n]*)?\Z", flags),
        }
        for name, value in patterns.items():
            object.__setattr__(self, name, value)  # frozen: set once, here

    def _reading(self, match: re.Match[str] | None) -> _Reading:
        """The verdict of a phrase match (its groups 1-4); None when the phrase is absent."""
        if match is None or match.group(2) is None:
            return None
        negation, word, negation2, word2 = match.group(1, 2, 3, 4)
        is_yes = (word.lower() in self._yes) != (negation is not None)
        if word2 is not None:
            is_yes2 = (word2.lower() in self._yes) != (negation2 is not None)
            if is_yes2 != is_yes:
                return AMBIGUOUS
        return self.yes_reward if is_yes else self.no_reward

    def _is_bare_verdict(self, text: str) -> bool:
        return self._whole.fullmatch(text) is not None

    def _ends(self, plain: str) -> _Reading:
        lead = self._reading(self._leading.match(plain))
        end = _end_of_words(plain)
        # A verdict phrase is short: search only the text's tail (lookbehind sees before pos).
        tail = self._reading(self._phrase_at_end.search(plain, max(0, end - _TAIL_CHARS), end))
        return _agree(lead, tail)

    def parse(self, text: str) -> float | None:
        plain = strip_markup(_blank_quotes(text, self._is_bare_verdict, self._marker_tail))
        return _reward(_read_in_order(self, plain))


# A number and its optional scale ("8/10", "8 out of 10", so the scale is not read as a second
# score), not part of a version string or a longer decimal; "7 or 8" is caught as ambiguous.
# Groups: (score, scale, alternative score).
_NUMBER = r"[-+]?\d+(?:\.\d+)?"
_SCORE_PHRASE = (
    rf"(?<![\w.])({_NUMBER})(?!\w|\.\d)(?:\s*(?:/|out\s+of)\s*(\d+(?:\.\d+)?)(?!\w|\.\d))?"
    rf"(?:[^\S\n]+or[^\S\n]+({_NUMBER})(?!\w|\.\d))?"
)
# "1-10", "1 to 10", "between 1 and 10": the judge quoting the scale, not giving a score.
_RANGE = re.compile(r"(?<![\w.])\d+(?:\.\d+)?\s*(?:-|to|and)\s*\d+(?:\.\d+)?(?![\w.])")
# A bare number that ends the text is a score only in a sentence about scoring ("I rate it 7",
# "on a scale of 1-10 this is a 6"), not in "... so the correct answer is 5."
_SCORE_CUE = re.compile(
    r"\b(?:scor(?:e|es|ed|ing)|rat(?:e|es|ed|ing)|grad(?:e|es|ed|ing)|scale|giv(?:e|es|ing))\b",
    re.IGNORECASE,
)
_SENTENCE_END = re.compile(r"[.!?\n](?=\s|\Z)")


@dataclass(kw_only=True, frozen=True)
class ScoreParser:
    """A pointwise score in [low, high], normalized to [0, 1]; out-of-range scores do not parse.

    Read, in order: a `\\boxed{}` score; a marker and its value anywhere ("Score: 7", "**Final
    score:** 8/10", "revised score 9"); else a score with its scale at the start ("7/10. Good")
    or a score at the end ("I'd say 7 out of 10", "On a scale of 1-10 I rate it 6"), which
    must agree when both are there. A bare number ends the text as a score only when it is the
    whole text or its sentence talks of scoring. "7/10" and "7 out of 10" read as 7; a stated
    scale other than `high` (e.g. "3/5") is rescaled to [low, high]; a scale the judge quotes
    ("on a scale of 1-10") is skipped; "7 or 8" and a designated score out of range do not
    parse. `occurrence` picks among several boxed or marker scores.
    """

    low: float = 1.0
    high: float = 10.0
    occurrence: Occurrence = "last"
    should_normalize: bool = True  # False returns the raw score
    # Words whose value is the score; matched case-insensitively anywhere, after markdown.
    markers: tuple[str, ...] = ("score", "rating", "grade")
    # Built from the fields above in __post_init__.
    _marker: re.Pattern[str] = field(init=False, repr=False, compare=False)
    _marker_tail: re.Pattern[str] = field(init=False, repr=False, compare=False)
    _whole: re.Pattern[str] = field(init=False, repr=False, compare=False)
    _leading: re.Pattern[str] = field(init=False, repr=False, compare=False)
    _phrase_at_end: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_occurrence(self.occurrence)
        if not (math.isfinite(self.low) and math.isfinite(self.high) and self.low < self.high):
            raise ValueError(
                f"ScoreParser: low={self.low!r}, high={self.high!r}; need finite low < high"
            )
        _check_markers("ScoreParser", self.markers)
        marker = rf"(?<![\w-])(?:{_marker_words(self.markers)})\b"
        patterns = {
            "_marker": re.compile(
                rf"{marker}{_MARKER_SEPARATOR}(?:{_SCORE_PHRASE})?", re.IGNORECASE
            ),
            "_marker_tail": re.compile(
                rf"{marker}[^\w\n+\-]*(?:(?:is|of)\b[^\w\n+\-]*)?\Z", re.IGNORECASE
            ),
            "_whole": re.compile(rf"[^\w+\-]*{_SCORE_PHRASE}[\W_]*"),
            "_leading": re.compile(rf"[^\w+\-]*{_SCORE_PHRASE}"),
            "_phrase_at_end": re.compile(rf"{_SCORE_PHRASE}\Z"),
        }
        for name, value in patterns.items():
            object.__setattr__(self, name, value)  # frozen: set once, here

    def _reading(self, match: re.Match[str] | None) -> _Reading:
        """The score of a score-phrase match (groups 1-3), normalized. An invalid score in a
        designated position is ambiguous, so no other number stands in for it."""
        if match is None or match.group(1) is None:
            return None
        if match.group(3) is not None:
            return AMBIGUOUS  # "7 or 8"
        value = float(match.group(1))
        if match.group(2) is not None:
            scale = float(match.group(2))
            if scale <= 0:
                return AMBIGUOUS
            if scale != self.high:
                value = self.low + value / scale * (self.high - self.low)
        if not (self.low <= value <= self.high):
            return AMBIGUOUS
        if not self.should_normalize:
            return value
        return (value - self.low) / (self.high - self.low)

    def _is_bare_verdict(self, text: str) -> bool:
        return self._whole.fullmatch(text) is not None

    def _ends(self, plain: str) -> _Reading:
        whole = self._whole.fullmatch(plain)
        if whole is not None:
            return self._reading(whole)
        leading = self._leading.match(plain)
        # A leading bare number is too often a list item ("1. The response..."); with its scale
        # ("7/10. Good") it is a score.
        lead = self._reading(leading) if leading and leading.group(2) else None
        end = _end_of_words(plain)
        trailing = self._phrase_at_end.search(plain, max(0, end - _TAIL_CHARS), end)
        tail: _Reading = None
        if trailing is not None:
            sentence_start = max(0, end - _TAIL_CHARS)
            for stop in _SENTENCE_END.finditer(plain, sentence_start, trailing.start()):
                sentence_start = stop.end()
            if trailing.group(2) is not None or _SCORE_CUE.search(plain, sentence_start, end):
                tail = self._reading(trailing)
        return _agree(lead, tail)

    def parse(self, text: str) -> float | None:
        plain = strip_markup(_blank_quotes(text, self._is_bare_verdict, self._marker_tail))
        plain = _RANGE.sub(" ", plain)
        return _reward(_read_in_order(self, plain))
