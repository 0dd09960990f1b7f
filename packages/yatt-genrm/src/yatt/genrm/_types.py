"""The values that cross the GenRM boundary: a sample in, a verdict out.

Samples are text, not token ids: a judge reads the decoded prompt and response, and the trainer
decodes the policy's ids before it submits. Verdicts are plain data (JSON-able through `to_dict`)
so the HTTP service and the in-process GenRM return the same thing.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

VerdictStatus = Literal["ok", "unparsable", "error"]
VERDICT_STATUSES: tuple[str, ...] = ("ok", "unparsable", "error")

# pid + counter: unique within a process and across the processes of one job, cheap to make.
_ids = itertools.count()


def _new_sample_id() -> str:
    return f"{os.getpid()}-{next(_ids)}"


@dataclass(kw_only=True)
class Sample:
    """One (prompt, response) pair to judge; `reference` is the gold answer when there is one."""

    prompt: str
    response: str
    reference: str | None = None
    id: str = field(default_factory=_new_sample_id)  # echoed in the Verdict
    metadata: dict[str, Any] = field(default_factory=dict)  # extra template fields, opaque here

    def __post_init__(self) -> None:
        for name in ("prompt", "response"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(
                    f"Sample.{name} must be a str, got {type(getattr(self, name)).__name__}; "
                    "decode token ids before submitting"
                )
        if self.reference is not None and not isinstance(self.reference, str):
            raise ValueError(
                f"Sample.reference must be a str or None, got {type(self.reference).__name__}"
            )
        if not isinstance(self.id, str) or not self.id:
            raise ValueError(f"Sample.id={self.id!r}: must be a non-empty str")
        if not isinstance(self.metadata, dict):
            raise ValueError(f"Sample.metadata must be a dict, got {type(self.metadata).__name__}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "prompt": self.prompt,
            "response": self.response,
            "reference": self.reference,
            "metadata": self.metadata,
        }


@dataclass(kw_only=True, frozen=True)
class Vote:
    """One judge generation for a sample; `reward` is None when it did not parse."""

    reward: float | None
    text: str
    status: VerdictStatus
    finish_reason: str | None = None  # the engine's: "stop", "length", "abort"


@dataclass(kw_only=True, frozen=True)
class Verdict:
    """The judged reward for one sample.

    status "ok": at least one vote parsed and `reward` aggregates the parsed votes;
    "unparsable": no vote parsed and `reward` is the configured default (also: a reward
    function returned None, "cannot score this sample"; then `error` says which);
    "error": the judge or a rule failed (engine error, bad template field, transport, a reward
    function that raised or returned a non-number) and `error` says how.
    """

    sample_id: str
    reward: float
    status: VerdictStatus
    text: str = ""  # the raw verdict text of the first vote (all of them are in `votes`)
    votes: tuple[Vote, ...] = ()
    error: str | None = None
    components: dict[str, float | None] = field(default_factory=dict)  # rule/judge parts
    # Named values a reward function returned beside its score (a dict return's other keys),
    # as "<function name>/<key>": logged per function, never added to the reward.
    metrics: dict[str, float] = field(default_factory=dict)
    # Set when the sample's row cannot be judged at all (it cannot be sent to a worker process,
    # its text is not valid Unicode): a data problem, not the judge's. status is "error" and
    # `reward` the default; a trainer skips the sample as it skips a bad row, and ScoreStats
    # counts it as num_data_skips, not num_errors.
    skip_cause: str | None = None
    # The judge's work for this sample: prompt tokens times votes (what fills its KV cache; 0
    # when no judge request was sent) and the tokens of all its votes. Summed per call by
    # ScoreStats, so a caller never differences shared counters.
    num_judge_prompt_tokens: int = 0
    num_judge_response_tokens: int = 0

    def __post_init__(self) -> None:
        assert self.status in VERDICT_STATUSES, self.status
        assert math.isfinite(self.reward), self.reward
        assert self.num_judge_prompt_tokens >= 0 and self.num_judge_response_tokens >= 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "sample_id": self.sample_id,
            "reward": self.reward,
            "status": self.status,
            "text": self.text,
            "votes": [
                {
                    "reward": v.reward,
                    "text": v.text,
                    "status": v.status,
                    "finish_reason": v.finish_reason,
                }
                for v in self.votes
            ],
            "error": self.error,
            "components": dict(self.components),
            "metrics": dict(self.metrics),
            "skip_cause": self.skip_cause,
            "num_judge_prompt_tokens": self.num_judge_prompt_tokens,
            "num_judge_response_tokens": self.num_judge_response_tokens,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Verdict:
        """The inverse of `to_dict`; ValueError on a payload that is not a verdict."""
        if data.get("status") not in VERDICT_STATUSES:
            raise ValueError(
                f"verdict status {data.get('status')!r} is not one of {VERDICT_STATUSES}"
            )
        if not math.isfinite(float(data["reward"])):
            raise ValueError(f"verdict reward {data['reward']!r} is not finite")
        # Absent from an older server's payload.
        token_counts = {
            key: int(data.get(key, 0))
            for key in ("num_judge_prompt_tokens", "num_judge_response_tokens")
        }
        if min(token_counts.values()) < 0:
            raise ValueError(f"verdict token counts {token_counts} must be >= 0")
        return cls(
            sample_id=data["sample_id"],
            reward=float(data["reward"]),
            status=data["status"],
            text=data.get("text", ""),
            votes=tuple(Vote(**v) for v in data.get("votes", ())),
            error=data.get("error"),
            components=dict(data.get("components", {})),
            metrics={str(k): float(v) for k, v in dict(data.get("metrics", {})).items()},
            skip_cause=data.get("skip_cause"),
            **token_counts,
        )


def describe_failure(exc: BaseException) -> str:
    """ "Type: message", then each chained cause's ("caused by Type: message"): a verdict's
    error is read as text, and an engine's wrapper error alone hid why (a failed CUDA-graph
    capture's own CUDA error)."""
    parts, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        parts.append(f"{type(exc).__name__}: {exc}")
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    return "; caused by ".join(parts)


def error_verdict(sample_id: str, message: str, *, reward: float) -> Verdict:
    """The verdict of a sample the judge could not score; the run goes on."""
    return Verdict(sample_id=sample_id, reward=reward, status="error", error=message)


def skip_verdict(sample_id: str, cause: str, *, reward: float) -> Verdict:
    """The verdict of a sample whose row cannot be judged (a data skip, not a judge error)."""
    return Verdict(
        sample_id=sample_id, reward=reward, status="error", error=cause, skip_cause=cause
    )


def find_unusable_text(sample: Sample) -> str | None:
    """Why `sample` cannot be judged as text (a lone surrogate in a field, which no tokenizer
    or JSON body takes), or None. Checks the prompt, response, reference and the row's
    top-level string fields."""
    fields: list[tuple[str, object]] = [
        ("prompt", sample.prompt),
        ("response", sample.response),
        ("reference", sample.reference),
    ]
    fields += [(f"row[{key!r}]", value) for key, value in sample.metadata.items()]
    for name, value in fields:
        if not isinstance(value, str):
            continue
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return (
                f"its {name} is not valid Unicode ({e.reason} at character {e.start}): "
                "a data problem, skipped"
            )
    return None


@runtime_checkable
class Scorer(Protocol):
    """What judges samples: GenRM, OpenAIJudge, RewardFunction, CombinedRM, GenRMClient (each a
    StreamingScorer), or a test's yatt.genrm.testing.RecordingScorer.

    score / ascore judge a batch; score's `should_stop` (a stop signal's flag, polled while it
    waits) ends the call with ScoringStopped, its pending judge requests and reward calls
    aborted. submit / finish / results judge a stream (genrm.score_as_completed): samples in
    as responses finish, verdicts out as they are made, in any order."""

    async def ascore(self, samples: Sequence[Sample]) -> list[Verdict]: ...

    def score(
        self, samples: Sequence[Sample], *, should_stop: Callable[[], bool] | None = None
    ) -> list[Verdict]: ...

    async def submit(self, sample: Sample) -> None: ...

    async def finish(self) -> None: ...

    def results(self) -> AsyncIterator[Verdict]: ...
