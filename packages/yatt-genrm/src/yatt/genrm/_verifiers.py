"""Rule verifiers: cheap, deterministic checks of a response against its reference.

Each returns 1.0 (pass), 0.0 (fail) or None (cannot decide: the sample has no reference). The
answer checked is the last `\\boxed{}` of the response when there is one, else the whole response
(ExactMatch) or its last number (NumericMatch).

`call_rule` runs any rule (these, a `RewardFunction`, your own) so that a rule that raises or
returns something other than a finite number is a cause to report, never a crashed run.
"""

from __future__ import annotations

import logging
import math
import numbers
import re
import unicodedata
from dataclasses import dataclass
from fractions import Fraction
from typing import Protocol, runtime_checkable

from yatt.genrm._parsers import find_boxed, strip_markup
from yatt.genrm._types import Sample
from yatt.rollout import describe_raise

logger = logging.getLogger("yatt.genrm")


@runtime_checkable
class RuleVerifier(Protocol):
    name: str

    def verify(self, sample: Sample) -> float | None: ...


class InvalidRewardError(ValueError):
    """A rule returned something other than a finite number or None."""


def check_reward(value: object) -> float | None:
    """`value` as a float (a bool is 0/1), None as None; InvalidRewardError for anything else
    (a str, NaN, inf, a tensor), saying what it was."""
    if value is None:
        return None
    value = as_python_scalar(value)
    if not isinstance(value, numbers.Real):
        raise InvalidRewardError(
            f"returned {value!r:.80} (a {type(value).__name__}); "
            "return a finite number, or None when the sample cannot be scored"
        )
    reward = float(value)
    if not math.isfinite(reward):
        raise InvalidRewardError(f"returned {reward!r}; return a finite number, or None")
    return reward


def as_python_scalar(value: object) -> object:
    """A numpy scalar (np.bool_ from np.isclose, np.float32, a 0-d array) as the Python bool,
    int or float it holds; anything else as it is. np.bool_ is not a numbers.Real."""
    if type(value).__module__ == "numpy" and getattr(value, "shape", None) == ():
        try:
            return value.item()  # type: ignore[attr-defined]
        except Exception:
            return value
    return value


def call_rule(rule: RuleVerifier, sample: Sample) -> tuple[float | None, str | None]:
    """(reward or None, None) when `rule.verify(sample)` gives a number or None; (None, cause)
    when it raises or returns anything else. Never raises (except BaseException: Ctrl-C)."""
    try:
        return check_reward(rule.verify(sample)), None
    except InvalidRewardError as e:
        return None, f"{rule.name} {e}"
    except Exception as e:
        return None, f"{rule.name} raised {describe_raise(e)}"


def extract_answer(response: str) -> str:
    """The last `\\boxed{}` content, else the response itself."""
    boxed = find_boxed(response)
    return boxed[-1] if boxed else response


def normalize_text(text: str) -> str:
    """Casefold, NFKC, markup stripped, whitespace collapsed, edge punctuation dropped."""
    text = unicodedata.normalize("NFKC", strip_markup(text)).casefold()
    text = " ".join(text.split())
    return text.strip(" .,;:!?'\"()[]{}$")


@dataclass(kw_only=True, frozen=True)
class ExactMatch:
    """The (normalized) answer equals the (normalized) reference."""

    should_normalize: bool = True
    name: str = "exact_match"

    def verify(self, sample: Sample) -> float | None:
        if sample.reference is None:
            return None
        answer = extract_answer(sample.response)
        if self.should_normalize:
            return float(normalize_text(answer) == normalize_text(sample.reference))
        return float(answer.strip() == sample.reference.strip())


_NUM = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?%?|[-+]?\.\d+%?")


def parse_number(text: str) -> Fraction | None:
    """The last number in `text` ("1,234", "-3.5", "3/4", "50%", "\\frac{3}{4}"), exactly."""
    text = re.sub(r"\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}", r"\1/\2", text)
    matches = _NUM.findall(text.replace("\\%", "%"))
    if not matches:
        return None
    token = matches[-1].replace(",", "").replace(" ", "")
    is_percent = token.endswith("%")
    token = token.rstrip("%")
    try:
        value = Fraction(token)
    except (ValueError, ZeroDivisionError):
        return None
    return value / 100 if is_percent else value


@dataclass(kw_only=True, frozen=True)
class NumericMatch:
    """The answer's number equals the reference's, within `rel_tol`.

    With `math-verify` installed (the `math` extra) and `use_math_verify` left True, it decides
    instead: it also handles LaTeX expressions, sets and symbolic equivalence.
    """

    rel_tol: float = 1e-6
    use_math_verify: bool = True
    name: str = "numeric_match"

    def __post_init__(self) -> None:
        if not (math.isfinite(self.rel_tol) and self.rel_tol >= 0):
            raise ValueError(f"NumericMatch.rel_tol={self.rel_tol!r}: must be finite and >= 0")

    def verify(self, sample: Sample) -> float | None:
        if sample.reference is None:
            return None
        # math-verify's "equal" is trusted (it knows LaTeX and symbolic equivalence); its "not
        # equal" falls through to the plain number check, which reads forms it may miss.
        if self.use_math_verify and _math_verify(sample.reference, sample.response):
            return 1.0
        answer = extract_answer(sample.response)
        got, want = parse_number(answer), parse_number(sample.reference)
        if got is None or want is None:
            return 0.0
        return float(math.isclose(float(got), float(want), rel_tol=self.rel_tol, abs_tol=1e-12))


def _math_verify(reference: str, response: str) -> bool | None:
    """math-verify's decision, or None when it is not installed or finds no answer."""
    try:
        from math_verify import parse, verify
    except ImportError:
        return None
    try:
        # math-verify finds \boxed{}, "the answer is", $...$ itself; a bare LaTeX reference
        # such as "\frac{1}{2}" needs $...$ to be read as math.
        gold = parse(reference) or parse(f"${reference}$")
        pred = parse(response)
        if not gold or not pred:
            return None
        return bool(verify(gold, pred))
    except Exception as e:  # malformed LaTeX in model output is data, not a crash
        logger.debug("math-verify failed on %r vs %r: %r", response[:80], reference[:80], e)
        return None


@dataclass(kw_only=True, frozen=True)
class RegexMatch:
    """The response matches `pattern` (re.search); with pattern=None, the sample's reference is
    the pattern. `on_answer=True` matches the extracted answer instead of the whole response."""

    pattern: str | None = None
    flags: int = re.IGNORECASE
    on_answer: bool = False
    name: str = "regex_match"

    def __post_init__(self) -> None:
        if self.pattern is not None:
            try:
                re.compile(self.pattern, self.flags)
            except re.error as e:
                raise ValueError(
                    f"RegexMatch.pattern={self.pattern!r} does not compile: {e}"
                ) from None

    def verify(self, sample: Sample) -> float | None:
        pattern = self.pattern if self.pattern is not None else sample.reference
        if pattern is None:
            return None
        text = extract_answer(sample.response) if self.on_answer else sample.response
        try:
            return float(re.search(pattern, text, self.flags) is not None)
        except re.error as e:
            logger.warning(
                "reference regex %r of sample %s does not compile: %s", pattern, sample.id, e
            )
            return None
