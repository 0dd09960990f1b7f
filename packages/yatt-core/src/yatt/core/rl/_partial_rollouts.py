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

A streamed step does all of the above in one call: pass the holder as the stream's carry
(`genrm.JudgedStream(..., carry=partials)`): it resumes take(step) first and put()s each group
its abort cut (any group with samples, step and prompt; its samples' prompt_ids, response_ids,
logprobs and finish_reason are copied).

A checkpoint between steps keeps the held groups (`state_dict()`: plain lists of ints, floats
and strings, JSON-able, so yatt.ckpt's per-rank `extra` takes it, and a Checkpointer given it as
a named stateful object saves and restores it), so a run resumed after a crash resumes the same
cut groups as the uninterrupted run would have. `save_prompt`/`load_prompt` turn the loop's own
prompts into plain data and back.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

# state_dict()'s format: load_state_dict refuses another one (or a version it does not read).
STATE_FORMAT = "yatt.core.PartialRollouts"
STATE_VERSION = 1

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
    save_prompt(prompt) -> plain data, load_prompt(saved) -> prompt or None (the group dropped):
    how state_dict()/load_state_dict() keep a group's prompt (default: as it is).
    """

    rollout_correction: object
    save_prompt: Callable[[Any], Any] | None = field(default=None, kw_only=True, repr=False)
    load_prompt: Callable[[Any], Any] | None = field(default=None, kw_only=True, repr=False)
    max_staleness_steps: int = field(default=1, init=False)  # the partial-rollout bound
    num_resumed: int = field(default=0, init=False)  # groups handed back by take(), in total
    num_dropped_stale: int = field(default=0, init=False)  # groups too old to resume, in total
    num_dropped_on_load: int = field(default=0, init=False)  # the last load_state_dict's drops
    _groups: list[PartialGroup] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        check_partial_resumption(rollout_correction=self.rollout_correction)

    def __len__(self) -> int:
        return len(self._groups)

    def put(self, group: Any) -> None:
        """Hold a cut group until the next take(): a PartialGroup, or any group with samples
        (completions: prompt_ids, response_ids, logprobs, finish_reason), step and prompt."""
        if not group.samples:
            raise ValueError("a PartialGroup needs its samples (an empty group trains nothing)")
        if not isinstance(group, PartialGroup):
            samples = [
                s if isinstance(s, PartialSample) else PartialSample.from_completion(s)
                for s in group.samples
            ]
            group = PartialGroup(samples=samples, step=group.step, prompt=group.prompt)
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

    # -- checkpoints (between steps) -------------------------------------------------------------

    def state_dict(self, *, save_prompt: Callable[[Any], Any] | None = None) -> dict[str, Any]:
        """The held groups and the counters as plain data (lists of ints, floats and strings:
        JSON-able, for a checkpoint's `extra`). A group's `prompt` is the loop's own:
        `save_prompt(prompt)` turns it into plain data (default: the holder's save_prompt, else
        stored as it is)."""
        save_prompt = save_prompt or self.save_prompt
        groups = []
        for group in self._groups:
            prompt = group.prompt if save_prompt is None else save_prompt(group.prompt)
            samples = [
                {
                    "prompt_ids": [int(t) for t in sample.prompt_ids],
                    "response_ids": [int(t) for t in sample.response_ids],
                    "logprobs": [float(x) for x in sample.logprobs],
                    "finish_reason": sample.finish_reason,
                }
                for sample in group.samples
            ]
            groups.append({"step": group.step, "prompt": prompt, "samples": samples})
        return {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "max_staleness_steps": self.max_staleness_steps,
            "num_resumed": self.num_resumed,
            "num_dropped_stale": self.num_dropped_stale,
            "groups": groups,
        }

    def load_state_dict(
        self, state: Mapping[str, Any], *, load_prompt: Callable[[Any], Any] | None = None
    ) -> int:
        """Replace the held groups and the counters with those of `state` (a state_dict()).
        `load_prompt(saved)` rebuilds a group's prompt (default: the holder's load_prompt, else
        the saved value as it is); a group whose prompt it gives as None is dropped. Returns
        how many were dropped so (also kept in num_dropped_on_load). ValueError, naming the bad
        entry, for a malformed state or another format or version; nothing changes then."""
        _check_state(state)
        load_prompt = load_prompt or self.load_prompt
        groups = [
            PartialGroup(
                samples=[
                    PartialSample(
                        prompt_ids=sample["prompt_ids"],
                        response_ids=sample["response_ids"],
                        logprobs=[float(x) for x in sample["logprobs"]],
                        finish_reason=sample["finish_reason"],
                    )
                    for sample in saved["samples"]
                ],
                step=saved["step"],
                prompt=saved["prompt"],
            )
            for saved in state["groups"]
        ]
        num_dropped = 0
        if load_prompt is not None:  # the loop's own: may fail, so before anything changes
            prompts = [load_prompt(group.prompt) for group in groups]
            for group, prompt in zip(groups, prompts, strict=True):
                group.prompt = prompt
            num_dropped = sum(prompt is None for prompt in prompts)
            groups = [group for group in groups if group.prompt is not None]
        self.max_staleness_steps = state["max_staleness_steps"]
        self.num_resumed = state["num_resumed"]
        self.num_dropped_stale = state["num_dropped_stale"]
        self._groups = groups
        self.num_dropped_on_load = num_dropped
        return num_dropped


def _check_state(state: object) -> None:
    """A PartialRollouts.state_dict(), or a ValueError naming what is wrong with it."""
    where = "partial rollouts state"
    if not isinstance(state, Mapping):
        raise ValueError(f"{where} is a {type(state).__name__}, not a dict from state_dict()")
    if state.get("format") != STATE_FORMAT:
        raise ValueError(
            f"{where}: format={state.get('format')!r}, expected {STATE_FORMAT!r}: pass "
            "PartialRollouts.state_dict()'s dict"
        )
    if state.get("version") != STATE_VERSION:
        raise ValueError(
            f"{where}: version={state.get('version')!r}, this yatt reads version "
            f"{STATE_VERSION}: resume with the yatt that wrote it, or start without the "
            "partial groups"
        )
    for key in ("max_staleness_steps", "num_resumed", "num_dropped_stale"):
        _check_count(state.get(key), f"{where}: {key}")
    groups = state.get("groups")
    if not isinstance(groups, list):
        raise ValueError(f"{where}: groups={groups!r} must be a list")
    for g, group in enumerate(groups):
        at = f"{where}: groups[{g}]"
        if not isinstance(group, Mapping) or set(group) != {"step", "prompt", "samples"}:
            keys = sorted(group) if isinstance(group, Mapping) else type(group).__name__
            raise ValueError(f"{at} is {keys}, expected a dict of step, prompt, samples")
        _check_count(group["step"], f"{at}.step")
        samples = group["samples"]
        if not isinstance(samples, list) or not samples:
            raise ValueError(f"{at}.samples must be a non-empty list")
        for j, sample in enumerate(samples):
            _check_sample(sample, f"{at}.samples[{j}]")


def _check_sample(sample: object, at: str) -> None:
    keys = {"prompt_ids", "response_ids", "logprobs", "finish_reason"}
    if not isinstance(sample, Mapping) or set(sample) != keys:
        found = sorted(sample) if isinstance(sample, Mapping) else type(sample).__name__
        raise ValueError(f"{at} is {found}, expected a dict of {sorted(keys)}")
    for key in ("prompt_ids", "response_ids"):
        ids = sample[key]
        if not isinstance(ids, list) or not all(_is_token_id(t) for t in ids):
            raise ValueError(f"{at}.{key} must be a list of token ids (ints >= 0)")
    logprobs = sample["logprobs"]
    if not isinstance(logprobs, list) or not all(_is_logprob(x) for x in logprobs):
        raise ValueError(f"{at}.logprobs must be a list of numbers (not NaN or +inf)")
    if len(logprobs) != len(sample["response_ids"]):
        raise ValueError(
            f"{at} has {len(logprobs)} logprobs for {len(sample['response_ids'])} response "
            "tokens: one per token"
        )
    if not isinstance(sample["finish_reason"], str) or not sample["finish_reason"]:
        raise ValueError(f"{at}.finish_reason={sample['finish_reason']!r} must be a string")


def _check_count(value: object, at: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{at}={value!r} must be an int >= 0")


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_logprob(value: object) -> bool:
    # -inf is a logprob (JSON writes it -Infinity and reads it back); NaN and +inf are not.
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    return is_number and not math.isnan(value) and value != math.inf
