"""Per-call scoring stats: what one scoring call produced, counted from its own verdicts.

    verdicts = genrm.score(samples)                       # or ascore, or results() of a round
    stats = ScoreStats.from_verdicts(verdicts)
    scored = await score_as_completed(stream, genrm, to_sample)
    scored.stats                                          # the same, for that call

Counting from the call's verdicts (each carries its status, error and judge token counts) is
exact also when several calls share one scorer at once (the service, a CombinedRM), where
differencing the scorer's running `metrics` would mix the calls up.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from yatt.genrm._types import Verdict

# Judge text kept in a cause line: enough to see what the judge wrote, not a wall of text.
_CAUSE_TEXT_CHARS = 200


@dataclass(kw_only=True, frozen=True)
class ScoreStats:
    """Counts and first causes of one scoring call's verdicts."""

    num_verdicts: int
    num_ok: int
    num_unparsable: int  # no vote parsed, or no rule could score: the reward is the default
    num_errors: int  # the judge or a rule failed (engine, template, transport, a raise)
    # Samples whose row could not be judged at all (Verdict.skip_cause): data, not judge errors
    num_data_skips: int = 0
    first_data_skip: str | None = None
    first_unparsable: str | None  # "sample ID: no verdict in the judge's text '...'"; None if none
    first_error: str | None  # "sample ID: <Verdict.error>"; None if none
    num_judge_prompt_tokens: int  # judge prompt tokens times votes, as metrics["num_prompt_tokens"]
    num_judge_response_tokens: int  # tokens the judge generated, all votes
    # Per reward function (each Verdict.components name: a function, a rule, "judge") the mean
    # and std (population) of the values it gave, as "<name>/mean" and "<name>/std"; and each
    # metric a function returned (Verdict.metrics "<name>/<key>") as "<name>/<key>/mean".
    # Ready to log under a prefix (the trainer's "reward/").
    reward_metrics: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_verdicts(cls, verdicts: Iterable[Verdict]) -> ScoreStats:
        """The stats of `verdicts` (first causes in their order)."""
        counts = {"ok": 0, "unparsable": 0, "error": 0, "skip": 0}
        first_unparsable = first_error = first_skip = None
        num_prompt_tokens = num_response_tokens = 0
        values: defaultdict[str, list[float]] = defaultdict(list)
        for verdict in verdicts:
            num_prompt_tokens += verdict.num_judge_prompt_tokens
            num_response_tokens += verdict.num_judge_response_tokens
            for name, value in verdict.components.items():
                if value is not None:
                    values[f"{name}/"].append(value)
            for key, value in verdict.metrics.items():
                values[f"{key}/metric"].append(value)
            if verdict.skip_cause is not None:
                counts["skip"] += 1
                if first_skip is None:
                    first_skip = f"sample {verdict.sample_id}: {verdict.skip_cause}"
                continue
            counts[verdict.status] += 1
            if verdict.status == "unparsable" and first_unparsable is None:
                first_unparsable = describe_unparsable(verdict)
            if verdict.status == "error" and first_error is None:
                first_error = f"sample {verdict.sample_id}: {verdict.error}"
        return cls(
            num_verdicts=sum(counts.values()),
            num_ok=counts["ok"],
            num_unparsable=counts["unparsable"],
            num_errors=counts["error"],
            num_data_skips=counts["skip"],
            first_unparsable=first_unparsable,
            first_error=first_error,
            first_data_skip=first_skip,
            num_judge_prompt_tokens=num_prompt_tokens,
            num_judge_response_tokens=num_response_tokens,
            reward_metrics=_reward_metrics(values),
        )


def _reward_metrics(values: dict[str, list[float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, numbers in sorted(values.items()):
        mean = math.fsum(numbers) / len(numbers)
        if key.endswith("/metric"):
            out[f"{key[: -len('/metric')]}/mean"] = mean
            continue
        variance = math.fsum((x - mean) ** 2 for x in numbers) / len(numbers)
        out[f"{key}mean"] = mean
        out[f"{key}std"] = math.sqrt(variance)
    return out


def describe_unparsable(verdict: Verdict) -> str:
    """One line saying why `verdict` did not parse: the judge's text, and whether it was cut;
    or, for a verdict no judge wrote (a reward function returned None), its `error`."""
    if verdict.error is not None and not verdict.votes:
        return f"sample {verdict.sample_id}: {verdict.error}"
    text = verdict.text[:_CAUSE_TEXT_CHARS]
    cause = f"sample {verdict.sample_id}: no verdict in the judge's text {text!r}"
    if any(vote.finish_reason == "length" for vote in verdict.votes):
        # This package makes a cut vote an error verdict; a verdict made elsewhere (an older
        # service) may still be unparsable for it, and this says why.
        cause += " (cut at the judge's max_new_tokens)"
    return cause
