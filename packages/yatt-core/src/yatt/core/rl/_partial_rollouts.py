"""Aborted responses kept to be finished next step (partial rollout: slime's, verl's, APRIL).

    step s    engine.abort() ends the long tail; each cut group, its finished samples included:
              partials.put(PartialGroup(samples=[PartialSample.from_completion(c) ...], step=s))
    step s+1  for group in partials.take(step=s + 1):      # older than one step: dropped, counted
                  for sample in group.unfinished():
                      Request(prompt_ids=sample.resume_prompt_ids(),
                              max_new_tokens=sample.num_tokens_left(max_new_tokens))
                  finished = sample.resumed(continuation)   # response and logprobs joined

A resumed response's first tokens were sampled by the previous step's weights, and their
logprobs are that engine's: training on them is off-policy by one step, which the loss's
rollout correction (importance weights of trainer vs engine logprobs, per token) corrects. So
resumption without rollout correction is refused (`check_partial_resumption`), and a group is
resumed at most one step after its oldest tokens were sampled; older ones are dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

# What turns rollout correction off, however a config spells it.
_CORRECTION_OFF = (None, False, "", "none", "off")


def check_partial_resumption(
    *, rollout_correction: object, field_name: str = "rollout_correction"
) -> None:
    """Refuse resuming aborted responses when the loss corrects nothing: ValueError naming
    `field_name` (the caller's dotted config field, e.g. "loss.rollout_correction")."""
    is_off = rollout_correction in _CORRECTION_OFF or (
        isinstance(rollout_correction, str)
        and rollout_correction.strip().lower() in ("none", "off")
    )
    if is_off:
        raise ValueError(
            f"{field_name}={rollout_correction!r}: resuming aborted responses trains on tokens "
            "the previous step's weights sampled (off-policy), which only rollout correction "
            f"(truncated or masked importance sampling) corrects: set {field_name}, or drop "
            "aborted responses instead of resuming them"
        )


class _CompletionWithReason(Protocol):
    prompt_ids: Sequence[int]
    response_ids: Sequence[int]
    logprobs: Sequence[float]
    finish_reason: str


@dataclass(kw_only=True, frozen=True)
class PartialSample:
    """One sample of a cut group: finished, or aborted mid-response (finish_reason "abort").

    Has prompt_ids, response_ids and logprobs, so it is a completion for `rollout_samples`.
    """

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]  # all the engine generated before the abort (or the end)
    logprobs: tuple[
        float, ...
    ]  # one per response token: the engine's, by the weights that sampled it
    finish_reason: str  # "abort": to resume; "stop" or "length": finished

    def __post_init__(self) -> None:
        for name in ("prompt_ids", "response_ids", "logprobs"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if len(self.logprobs) != len(self.response_ids):
            raise ValueError(
                f"a partial sample has {len(self.logprobs)} logprobs for "
                f"{len(self.response_ids)} response tokens; keep the engine's one per token"
            )

    @classmethod
    def from_completion(cls, completion: _CompletionWithReason) -> PartialSample:
        """From an engine's completion (e.g. yatt.rollout.Completion), finished or aborted."""
        return cls(
            prompt_ids=completion.prompt_ids,
            response_ids=completion.response_ids,
            logprobs=completion.logprobs,
            finish_reason=completion.finish_reason,
        )

    @property
    def is_finished(self) -> bool:
        return self.finish_reason != "abort"

    def resume_prompt_ids(self) -> list[int]:
        """The prompt that continues this response: the prompt and the response so far."""
        return [*self.prompt_ids, *self.response_ids]

    def num_tokens_left(self, max_new_tokens: int) -> int:
        """The response's remaining budget under the step's max_new_tokens."""
        return max(max_new_tokens - len(self.response_ids), 0)

    def resumed(self, continuation: _CompletionWithReason) -> PartialSample:
        """This response with the engine's continuation of `resume_prompt_ids()` appended,
        logprobs too (the old tokens keep the old engine's logprobs)."""
        if list(continuation.prompt_ids) != self.resume_prompt_ids():
            raise ValueError(
                "the continuation's prompt_ids are not this sample's resume_prompt_ids(): "
                "pair each continuation with the partial sample it continues"
            )
        return PartialSample(
            prompt_ids=self.prompt_ids,
            response_ids=(*self.response_ids, *continuation.response_ids),
            logprobs=(*self.logprobs, *continuation.logprobs),
            finish_reason=continuation.finish_reason,
        )


@dataclass(kw_only=True)
class PartialGroup:
    """A group cut by an abort: all its samples, finished ones included (a group is judged and
    trained whole). `step`: the step whose weights sampled its oldest tokens; a group resumed
    and cut again keeps its first step (dataclasses.replace(group, samples=...))."""

    samples: list[PartialSample]
    step: int
    prompt: Any = None  # the loop's own: what it needs to judge and train the group (row, images)

    def unfinished(self) -> list[PartialSample]:
        return [sample for sample in self.samples if not sample.is_finished]


@dataclass
class PartialRollouts:
    """Cut groups held from one step to the next, resumed at most one step after their oldest
    tokens were sampled. Local to a rank (a group's samples live on the rank that drew it).

    rollout_correction: the loss's setting; resumption without it is a ValueError.
    """

    rollout_correction: object
    max_staleness_steps: int = field(default=1, init=False)  # the partial-rollout bound
    num_resumed: int = field(default=0, init=False)  # groups handed back by take(), in total
    num_dropped_stale: int = field(default=0, init=False)  # groups too old to resume, in total
    _groups: list[PartialGroup] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        check_partial_resumption(rollout_correction=self.rollout_correction)

    def __len__(self) -> int:
        return len(self._groups)

    def put(self, group: PartialGroup) -> None:
        """Hold a cut group until the next take()."""
        if not group.samples:
            raise ValueError("a PartialGroup needs its samples (an empty group trains nothing)")
        self._groups.append(group)

    def take(self, step: int) -> list[PartialGroup]:
        """The held groups `step` may resume (at most max_staleness_steps after their oldest
        tokens), in the order they were put; older ones are dropped and counted. Empties it."""
        fresh: list[PartialGroup] = []
        for group in self._groups:
            if step - group.step <= self.max_staleness_steps:
                fresh.append(group)
            else:
                self.num_dropped_stale += 1
        self._groups = []
        self.num_resumed += len(fresh)
        return fresh
