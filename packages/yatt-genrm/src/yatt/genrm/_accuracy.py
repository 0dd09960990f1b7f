"""The accuracy metric, read only from a signal the run declares (JudgeSpec.accuracy).

    accuracy = AccuracySignal("exact_match", rules=[ExactMatch()])   # or from_spec(spec, exact_match)
    value = accuracy.read(sample, verdict)     # float, or None: this verdict lacks the signal

A signal is a verdict component (a rule, a reward function, "judge": Verdict.components) or a
named value a reward function returned beside its score ("<function name>/<key>":
Verdict.metrics). A rule named here is also computed from the sample when the reward does not
weigh it (the exact match of a judged run). A reward alone never stands in for accuracy: a
run that declares none has no accuracy metric, and a declared name that a verdict does not
carry is reported as missing, never read as 0.
"""

from __future__ import annotations

from collections.abc import Iterable

from yatt.genrm._types import Sample, Verdict
from yatt.genrm._verifiers import RuleVerifier


class AccuracySignal:
    """Reads the declared accuracy signal of one judged response."""

    def __init__(self, name: str, *, rules: Iterable[RuleVerifier] = ()) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"name={name!r}: the signal's name, e.g. 'exact_match'")
        self.name = name
        # rules computed from the sample when the verdict does not carry them (weight 0)
        self.rules = {rule.name: rule for rule in rules}

    @classmethod
    def from_spec(cls, spec, exact_match: RuleVerifier) -> AccuracySignal | None:
        """spec.accuracy's signal (None when it is ""), with `exact_match` (build_judge's exact
        match) computed for the metric when the reward does not weigh it."""
        if not spec.accuracy:
            return None
        return cls(spec.accuracy, rules=[exact_match])

    def read(self, sample: Sample, verdict: Verdict) -> float | None:
        """The signal's value for this response; None when its verdict does not carry it
        (the reward function failed or returned None for it, or the name is no signal of this
        reward). A rule's None (no reference) reads as 0, as a wrong answer."""
        if self.name in verdict.components:
            value = verdict.components[self.name]
            if value is None and self.name in self.rules:
                return 0.0
            return None if value is None else float(value)
        if self.name in verdict.metrics:
            return float(verdict.metrics[self.name])
        if self.name in self.rules:
            return self.rules[self.name].verify(sample) or 0.0
        return None

    def __repr__(self) -> str:
        return f"AccuracySignal({self.name!r})"
