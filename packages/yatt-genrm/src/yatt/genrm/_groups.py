"""Judge rollout groups as their samples finish: the streaming half of dynamic sampling.

    judging = GroupJudging(scorer, to_sample, group_size=8)
    # as the engine yields each completion (from any number of engine.stream calls):
    judging.add(completion, group=key, index=j)   # aborted ones are set aside, never judged
    group = await judging.next_group(timeout_s=0.01)   # a JudgedGroup once all its samples
                                                       # are judged, else None after the wait
    sampler.add(to_batch(group))                  # e.g. core.DynamicSampler in stream mode
    ...
    engine.abort()                                # every rank is full: cut the rollout
    await judging.drain(abort=judge_engine.abort) # and the judge's leftover work
    judging.unfinished()                          # groups with a cut sample: drop or resume

A group is handed back whole, once: DAPO keeps or drops whole groups, so a group with an aborted
sample (finish_reason "abort": a partial response the engine cut) is never complete here; it
stays in unfinished() with its finished samples and their verdicts, to be dropped or resumed
(yatt.core.PartialRollouts). Each finished completion is judged the moment it is added, by
`scorer.ascore`, so concurrent samples batch together in the scorer (GenRM, OpenAIJudge, ...).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from yatt.genrm._types import Sample, Scorer, Verdict

ABORT = "abort"  # yatt.rollout's finish_reason for a response cut by engine.abort()


@dataclass
class JudgedGroup:
    """A group's samples by index (arrival order without indices) and their verdicts."""

    group: Hashable
    completions: list[Any]
    verdicts: list[Verdict]


@dataclass
class _Pending:
    judged: dict[int, tuple[Any, Verdict]] = field(default_factory=dict)
    aborted: dict[int, Any] = field(default_factory=dict)
    added: set[int] = field(default_factory=set)  # judged or being judged, aborted included


class GroupJudging:
    """Judges finished completions at once and hands back whole groups (module docstring).

    scorer: anything with `ascore(samples) -> verdicts` (GenRM, OpenAIJudge, RewardFunction,
        CombinedRM, GenRMClient). to_sample(completion) -> Sample: the text the judge reads.
    group_size: samples per group (a group is complete once that many are judged).
    on_verdict(group, completion, verdict): called for each verdict as it arrives (counters).
    Use it inside one running event loop (add() starts a task on it).
    """

    def __init__(
        self,
        scorer: Scorer,
        to_sample: Callable[[Any], Sample],
        *,
        group_size: int,
        on_verdict: Callable[[Hashable, Any, Verdict], None] | None = None,
    ) -> None:
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size={group_size!r}: must be an int >= 1")
        self.scorer = scorer
        self.to_sample = to_sample
        self.group_size = group_size
        self.on_verdict = on_verdict
        self._pending: dict[Hashable, _Pending] = {}
        self._ready: asyncio.Queue[JudgedGroup] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._error: BaseException | None = None  # a scorer that raised (not a bad verdict)
        self.num_judged = 0  # verdicts received
        self.num_aborted = 0  # completions set aside as aborted

    def add(self, completion: Any, *, group: Hashable, index: int | None = None) -> bool:
        """Judge `completion` (sample `index` of `group`) now; an aborted one (finish_reason
        "abort") is set aside unjudged. Returns whether it went to the judge."""
        pending = self._pending.setdefault(group, _Pending())
        if index is None:
            index = len(pending.added)
        if index in pending.added:
            raise ValueError(f"sample {index} of group {group!r} was added twice")
        if not 0 <= index < self.group_size:
            raise ValueError(f"index={index}: group_size is {self.group_size}")
        pending.added.add(index)
        if getattr(completion, "finish_reason", None) == ABORT:
            pending.aborted[index] = completion
            self.num_aborted += 1
            return False
        loop = asyncio.get_running_loop()
        if self._ready is None:
            self._ready = asyncio.Queue()
        task = loop.create_task(self._judge(group, index, completion))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    async def _judge(self, group: Hashable, index: int, completion: Any) -> None:
        try:
            (verdict,) = await self.scorer.ascore([self.to_sample(completion)])
        except Exception as e:  # re-raised by next_group()/drain(): the group would never end
            self._error = self._error or e
            return
        self.num_judged += 1
        if self.on_verdict is not None:
            self.on_verdict(group, completion, verdict)
        pending = self._pending.get(group)
        if pending is None:
            return
        pending.judged[index] = (completion, verdict)
        if len(pending.judged) == self.group_size:
            del self._pending[group]
            order = sorted(pending.judged)
            self._ready.put_nowait(
                JudgedGroup(
                    group=group,
                    completions=[pending.judged[i][0] for i in order],
                    verdicts=[pending.judged[i][1] for i in order],
                )
            )

    @property
    def num_judging(self) -> int:
        """Completions sent to the judge whose verdicts have not come back."""
        return len(self._tasks)

    def num_ready(self) -> int:
        """Judged groups waiting in next_group()."""
        return 0 if self._ready is None else self._ready.qsize()

    async def next_group(self, timeout_s: float | None = None) -> JudgedGroup | None:
        """The next whole judged group (in order of completion), waiting up to `timeout_s`
        for one (more completions may be added meanwhile); None if none came. Without a
        timeout it returns None at once when nothing is being judged and none is ready (the
        wait would never end)."""
        if self._ready is None:
            self._ready = asyncio.Queue()
        self._raise_if_failed()
        if timeout_s is None and not self._tasks and self._ready.empty():
            return None
        try:
            group = await asyncio.wait_for(self._ready.get(), timeout_s)
        except TimeoutError:
            group = None
        self._raise_if_failed()
        return group

    async def drain(self, *, abort: Callable[[], None] | None = None, poll_s: float = 0.01) -> None:
        """Wait for every verdict still coming. `abort` (e.g. the judge engine's abort()) is
        called before each wait, so judging nobody needs ends now, a batch the scorer starts
        late included; its verdicts then come back as errors."""
        while self._tasks:
            if abort is not None:
                abort()
            await asyncio.wait(set(self._tasks), timeout=poll_s)
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the scorer raised: {self._error!r}") from self._error

    def unfinished(self) -> dict[Hashable, tuple[dict[int, tuple[Any, Verdict]], dict[int, Any]]]:
        """Groups not handed back: {group: ({index: (completion, verdict)} judged,
        {index: completion} aborted)}. After drain() and the rollout's end, these are the
        groups the abort cut."""
        return {g: (p.judged, p.aborted) for g, p in self._pending.items()}

    def take_ready(self) -> list[JudgedGroup]:
        """The judged groups not yet taken by next_group() (e.g. surplus after the abort)."""
        out = []
        while self._ready is not None and not self._ready.empty():
            out.append(self._ready.get_nowait())
        return out
