"""Votes -> one verdict: parse each judge generation, then aggregate the ones that parsed."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import Counter
from collections.abc import Sequence
from typing import Literal

from yatt.genrm._parsers import VerdictParser
from yatt.genrm._types import Verdict, Vote
from yatt.rollout import SamplingParams

logger = logging.getLogger("yatt.genrm")

Aggregate = Literal["mean", "majority"]
AGGREGATES: tuple[str, ...] = ("mean", "majority")

# Raw judge text kept in a log line; enough to see what went wrong, not a wall of text.
_LOG_TEXT_CHARS = 200


def aggregate_rewards(rewards: Sequence[float], how: Aggregate) -> float:
    """`mean`, or `majority`: the most frequent reward, ties resolved to the mean of the tied
    values (so a 2-2 Yes/No split is 0, not whichever came first)."""
    assert rewards, "aggregate_rewards needs at least one parsed vote"
    if how == "mean":
        return math.fsum(rewards) / len(rewards)
    counts = Counter(rewards)
    top = max(counts.values())
    tied = [r for r, c in counts.items() if c == top]
    return math.fsum(tied) / len(tied)


def make_judge_sampling(sampling: SamplingParams | None, votes: int) -> SamplingParams:
    """The judge's sampling with n = votes; by default greedy for one vote, 0.7 for several."""
    if sampling is None:
        # One vote: the judge's most likely verdict. Several: they must differ to be votes.
        sampling = SamplingParams(temperature=0.0 if votes == 1 else 0.7, max_new_tokens=512)
    if sampling.n not in (1, votes):
        raise ValueError(
            f"sampling.n={sampling.n}: the judge sets n from votes={votes}; leave n at 1"
        )
    if votes > 1 and sampling.temperature == 0:
        raise ValueError(
            f"votes={votes} with sampling.temperature=0: greedy votes are identical; "
            "set a temperature > 0 (e.g. 0.7) or votes=1"
        )
    return dataclasses.replace(sampling, n=votes)


def is_finished(finish_reason: str | None) -> bool:
    """Whether a judge generation ended where the judge chose to (its stop token or end of
    sequence: "stop"), so that its last line is a verdict it meant. "length" (cut at its token
    budget: the last line may be half a sentence that reads "Yes"), "abort" and anything else
    are not; None (not reported, e.g. text handed in directly) is taken as finished."""
    return finish_reason in (None, "stop")


def parse_vote(text: str, parser: VerdictParser, finish_reason: str | None) -> Vote:
    """One judge generation -> a Vote; a parser that raises counts as unparsable, never crashes.
    A generation that did not finish (`is_finished`) is an "error" vote, never parsed."""
    if not is_finished(finish_reason):
        return Vote(reward=None, text=text, status="error", finish_reason=finish_reason)
    try:
        reward = parser.parse(text)
    except Exception as e:  # a user parser's bug is a counted miss, not a dead run
        logger.warning("verdict parser %r raised %r on text %r", parser, e, text[:_LOG_TEXT_CHARS])
        reward = None
    if reward is not None and not math.isfinite(reward):
        reward = None
    if reward is None:
        return Vote(reward=None, text=text, status="unparsable", finish_reason=finish_reason)
    return Vote(reward=float(reward), text=text, status="ok", finish_reason=finish_reason)


def describe_unfinished(unfinished: Sequence[Vote], num_votes: int) -> str:
    """Why no verdict was read: the judge's generations that did not finish, by reason."""
    reasons = Counter(v.finish_reason for v in unfinished)
    parts = []
    for reason, count in sorted(reasons.items(), key=lambda item: str(item[0])):
        if reason == "length":
            what = (
                "cut at the judge's token budget (finish reason 'length'; raise its max_new_tokens)"
            )
        elif reason == "abort":
            what = "aborted"
        else:
            what = f"ended with finish reason {reason!r}"
        parts.append(f"{count} of {num_votes} {what}")
    return "no verdict read: the judge's generation did not finish: " + "; ".join(parts)


def build_verdict(
    sample_id: str, votes: Sequence[Vote], *, how: Aggregate, default_reward: float
) -> Verdict:
    """All parsed votes aggregated; none parsed -> `default_reward` with status "error" when a
    vote did not finish (cut at the token budget, aborted), else "unparsable"."""
    parsed = [v.reward for v in votes if v.reward is not None]
    text = votes[0].text if votes else ""
    if parsed:
        return Verdict(
            sample_id=sample_id,
            reward=aggregate_rewards(parsed, how),
            status="ok",
            text=text,
            votes=tuple(votes),
        )
    unfinished = [v for v in votes if v.status == "error"]
    if unfinished:
        return Verdict(
            sample_id=sample_id,
            reward=default_reward,
            status="error",
            text=text,
            votes=tuple(votes),
            error=describe_unfinished(unfinished, len(votes)),
        )
    return Verdict(
        sample_id=sample_id,
        reward=default_reward,
        status="unparsable",
        text=text,
        votes=tuple(votes),
    )


class FailureLog:
    """Logs failures (`what`: "rule failure", "judge request failed"): the first few, then 1 in
    `every`, so a cause that repeats on every sample does not flood the log (each failure is in
    its verdict anyway)."""

    def __init__(self, what: str, *, first: int = 5, every: int = 100) -> None:
        self._what, self._first, self._every, self._count = what, first, every, 0

    def record(self, sample_id: str, cause: str) -> None:
        self._count += 1
        if self._count <= self._first or self._count % self._every == 0:
            logger.warning("%s #%d (sample %s): %s", self._what, self._count, sample_id, cause)


class UnparsableLog:
    """Logs unparsable verdicts with a sample of their text: the first few, then 1 in `every`,
    so a judge that never follows the format does not flood the log."""

    def __init__(self, *, first: int = 5, every: int = 100) -> None:
        self._first, self._every, self._count = first, every, 0

    def record(self, sample_id: str, text: str) -> None:
        self._count += 1
        if self._count <= self._first or self._count % self._every == 0:
            logger.warning(
                "unparsable verdict #%d (sample %s): %r",
                self._count,
                sample_id,
                text[:_LOG_TEXT_CHARS],
            )
