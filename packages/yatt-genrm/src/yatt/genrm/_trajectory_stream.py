"""Multi-turn trajectories judged as each one ends, kept as whole groups: JudgedStream's
contract for environments and tools (partial colocation: rollout and judge resident together).

    stream = TrajectoryStream(multiturn=multiturn, scorer=scorer, sampling=sampling,
                              to_row=lambda prompt: env_row(prompt.row),   # reset(**row) reads
                              answer_key="answer", env_reward_weight=1.0,
                              judge_engine=judge_engine, load=placement.PendingLoad())
    await stream.run(sampler, draw=draw, keep=keep, should_stop=flag)  # feed, judge, keep, cut
    # or by hand:
    stream.feed(payloads)               # sampling.n trajectories per payload start now
    group = await stream.next_group()   # one row's JudgedSamples, each judged, else None
    await stream.cut()                  # cancel the trajectories still running, abort the judge
    stream.num_groups_cut, stream.turn_stats, stream.pending_tokens()

    payload --to_row--> row --MultiTurnRollout.stream--> trajectory, as each ends (any order)
        --trajectory_sample--> scorer.ascore + env_reward_weight x get_reward()   (GroupJudging)
        --> a group once all its sampling.n trajectories are judged --> keep(judged samples)

Each trajectory goes to the judge the moment it ends, while the other trajectories are still in
their tool loops: the judge call is a task on the same event loop, so it never holds another
trajectory's turn. A group is handed back whole, once. A row whose environment failed to
reset (fewer than n trajectories) or whose trajectory the engine aborted never completes: its
group is dropped when its rows' trajectories have all ended (counted). Once the sampler says
every rank is full (should_abort) or a stop signal arrives, the trajectories still running are
cancelled (their engine calls closed) and the judge's leftover work aborted; those groups are
counted as cut and dropped (a multi-turn trajectory is not resumed next step: its environment's
state would have to travel with it).

The live queues (KV the unfinished trajectories may hold, at most max_trajectory_tokens each,
and the judge's pending trajectory tokens) are recorded into `load` at each change, as
JudgedStream does: their time-weighted means move the next step's memory split.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

from yatt.genrm._groups import GroupJudging
from yatt.genrm._judged_round import JudgedSample
from yatt.genrm._judged_stream import _Load, _Sampler, keep_fed_until_full
from yatt.genrm._stopping import ScoringStopped
from yatt.genrm._trajectory import (
    TrajectoryCompletion,
    trajectory_reference,
    trajectory_sample,
    with_env_reward,
)
from yatt.genrm._types import Sample, Verdict
from yatt.rollout import Abortable, MultiTurnStats, SamplingParams

ABORT = "abort"  # a trajectory whose turn the engine aborted


class _WithEnvReward:
    """The scorer's verdicts (None: no scorer) plus weight x each trajectory's get_reward()."""

    def __init__(self, scorer: Any | None, weight: float) -> None:
        self.scorer, self.weight = scorer, weight

    async def ascore(self, samples: list[Sample]) -> list[Verdict]:
        verdicts: list[Any] = [None] * len(samples)
        if self.scorer is not None:
            verdicts = await self.scorer.ascore(samples)
        return [
            with_env_reward(verdict, sample, sample.metadata.get("env_reward"), self.weight)
            for verdict, sample in zip(verdicts, samples, strict=True)
        ]


class TrajectoryStream:
    """One step's multi-turn rollout as a stream of judged groups (module docstring). Use it
    inside one running event loop.

    multiturn: a yatt.rollout.MultiTurnRollout (anything with its stream(rows, sampling, *,
        stats, first_row_index) and config.max_trajectory_tokens).
    scorer: judges trajectory_sample's view (None: the environment's reward alone).
    sampling: the step's sampling (n = the group size; one seed, each row's turns draw from
        their own key under it).
    to_row(payload): what the payload's environments' reset(**row) read; the judge's reference
        is that row's `answer_key`, as text.
    judge_engine: the judge's engine when it has one (aborted at cut() if it can abort).
    """

    def __init__(
        self,
        *,
        multiturn: Any,
        scorer: Any | None,
        sampling: SamplingParams,
        to_row: Callable[[Any], dict[str, Any]],
        answer_key: str,
        env_reward_weight: float,
        judge_engine: Any = None,
        load: _Load | None = None,
    ) -> None:
        self.multiturn = multiturn
        self.sampling = sampling
        self.group_size = sampling.n
        self.to_row = to_row
        self.answer_key = answer_key
        self.judge_engine = judge_engine
        self.load = load
        self.turn_stats = MultiTurnStats()  # the trajectories that ended (cut ones are not)
        self.judging = GroupJudging(
            _WithEnvReward(scorer, env_reward_weight),
            self._to_sample,
            group_size=sampling.n,
            on_verdict=self._on_verdict,
        )
        self.payloads: list[Any] = []  # by group key (the rows' indices in the stream)
        self.num_in_flight = 0  # groups fed, neither handed back nor dropped
        self.num_groups_incomplete = 0  # dropped: a reset failed or the engine aborted a turn
        self.num_groups_cut = 0  # in flight when cut() ran: dropped
        self.num_cut_tokens = 0  # sampled tokens of the cut groups' trajectories that had ended
        self._max_tokens = int(multiturn.config.max_trajectory_tokens)
        self._arrived: dict[int, int] = {}  # group key -> trajectories that ended
        self._sampled: dict[int, int] = {}  # group key -> their sampled tokens
        self._broken: set[int] = set()  # a trajectory of theirs ended by an engine abort
        self._open: set[int] = set()  # keys in flight
        self._samples: dict[int, Sample] = {}  # id(completion) -> what the judge read
        self._judge_tokens: dict[int, int] = {}  # id(completion) -> its pending judge tokens
        self._rollout_pending = 0
        self._genrm_pending = 0
        self._pumps: set[asyncio.Task] = set()
        self._pump_error: BaseException | None = None
        self._is_cut = False

    # -- the whole step ----------------------------------------------------------------------

    async def run(
        self,
        sampler: _Sampler,
        *,
        draw: Callable[[int], Sequence[Any]],
        keep: Callable[[list[JudgedSample]], None],
        should_stop: Callable[[], bool] = lambda: False,
    ) -> None:
        """Payloads from draw(count) as the sampler asks (num_to_draw counts the groups in
        flight); each judged group to keep() at once; once should_abort() (every rank full:
        polls, never blocks) or should_stop() (a stop signal), or nothing is in flight or to
        draw, the trajectories still running are cut (counted in num_groups_cut)."""
        await keep_fed_until_full(self, sampler, draw, keep, should_stop)

    async def judge_all(
        self, payloads: Sequence[Any], *, should_stop: Callable[[], bool] | None = None
    ) -> list[JudgedSample]:
        """One round: every payload's trajectories, each judged as it ends; the whole groups'
        JudgedSamples by (row, sample). ScoringStopped once should_stop() turns true (the
        trajectories still running cancelled, the judge aborted: nothing kept)."""
        begin = time.monotonic()
        self.feed(payloads)
        judged: list[JudgedSample] = []
        while self.num_in_flight:
            group = await self.next_group()
            if group is not None:
                judged += group
            if should_stop is not None and should_stop():
                await self.cut()
                raise ScoringStopped(
                    num_samples=len(payloads) * self.group_size,
                    waited_s=time.monotonic() - begin,
                )
        await self.cut()  # nothing left to cut: closes the judge's bookkeeping
        judged.sort(key=lambda j: (j.completion.request_index, j.completion.sample_index))
        return judged

    # -- generate ----------------------------------------------------------------------------

    def feed(self, payloads: Sequence[Any]) -> None:
        """sampling.n trajectories per payload start now (a new group each)."""
        if not payloads:
            return
        first = len(self.payloads)
        self.payloads += list(payloads)
        rows = [self.to_row(payload) for payload in payloads]
        for key in range(first, first + len(rows)):
            self._arrived[key] = 0
            self._sampled[key] = 0
            self._open.add(key)
            self.num_in_flight += 1
            # The KV a trajectory may hold until it ends: at most its token limit.
            self._rollout_pending += self.group_size * self._max_tokens
        self._note()
        task = asyncio.get_running_loop().create_task(self._pump(rows, first))
        self._pumps.add(task)
        task.add_done_callback(self._pump_done)

    async def _pump(self, rows: list[dict[str, Any]], first: int) -> None:
        stream = self.multiturn.stream(
            rows, self.sampling, stats=self.turn_stats, first_row_index=first
        )
        try:
            async for trajectory in stream:
                self._judge(trajectory)
        finally:
            # Cancelled (cut): closing the stream cancels its trajectories still running.
            await stream.aclose()
        # Every trajectory of these rows has ended: a group short of n, or one with an
        # aborted trajectory, can never complete.
        for key in range(first, first + len(rows)):
            if key in self._open and (self._arrived[key] < self.group_size or key in self._broken):
                self._close(key)
                self.num_groups_incomplete += 1
                missing = self.group_size - self._arrived[key]
                self._rollout_pending -= missing * self._max_tokens
        self._note()

    def _pump_done(self, task: asyncio.Task) -> None:
        self._pumps.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._pump_error = self._pump_error or task.exception()

    # -- judge -------------------------------------------------------------------------------

    def _judge(self, trajectory: Any) -> None:
        key = trajectory.row_index
        self._arrived[key] += 1
        self._sampled[key] += trajectory.num_sampled_tokens
        self._rollout_pending -= self._max_tokens
        completion = TrajectoryCompletion(trajectory, request_index=key)
        if completion.finish_reason == ABORT:
            self._broken.add(key)
        else:
            tokens = len(trajectory.prompt_ids) + len(trajectory.response_ids)
            self._judge_tokens[id(completion)] = tokens
            self._genrm_pending += tokens
        self._note()
        self.judging.add(completion, group=key, index=trajectory.sample_index)

    def _to_sample(self, completion: TrajectoryCompletion) -> Sample:
        trajectory = completion.trajectory
        sample = trajectory_sample(
            trajectory, reference=trajectory_reference(trajectory.row, self.answer_key)
        )
        self._samples[id(completion)] = sample
        return sample

    def _on_verdict(self, key: Any, completion: Any, verdict: Verdict) -> None:
        self._genrm_pending -= self._judge_tokens.pop(id(completion), 0)
        self._note()

    async def next_group(self, timeout_s: float = 0.01) -> list[JudgedSample] | None:
        """A group whose every trajectory is judged, as JudgedSamples by sample index (each
        with its payload as the prompt), else None after `timeout_s`. Re-raises what ended a
        rollout call (an engine error): its groups would never come."""
        if self._pump_error is not None:
            raise RuntimeError(f"the multi-turn rollout raised: {self._pump_error!r}") from (
                self._pump_error
            )
        group = await self.judging.next_group(timeout_s=timeout_s)
        if group is None or group.group not in self._open:
            return None
        self._close(group.group)
        payload = self.payloads[group.group]
        return [
            JudgedSample(completion, self._samples.pop(id(completion)), verdict, payload)
            for completion, verdict in zip(group.completions, group.verdicts, strict=True)
        ]

    def _close(self, key: int) -> None:
        self._open.discard(key)
        self.num_in_flight -= 1

    # -- the end of the step -----------------------------------------------------------------

    async def cut(self) -> None:
        """Cancel the trajectories still running (their engine calls closed), then abort the
        judge's work nobody needs any more; the groups still open are counted as cut."""
        if self._is_cut:
            return
        self._is_cut = True
        pumps = list(self._pumps)
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        self.num_groups_cut = len(self._open)
        self.num_cut_tokens = sum(self._sampled[key] for key in self._open)
        self.num_in_flight -= len(self._open)
        self._open.clear()
        self._rollout_pending = 0
        self._note()
        judge = self.judge_engine
        await self.judging.drain(abort=judge.abort if isinstance(judge, Abortable) else None)
        self._genrm_pending = 0
        self._note()

    def pending_tokens(self) -> dict[str, float]:
        """The step's time-weighted mean live queues: Plan.update_load's arguments ({}
        without a `load`)."""
        return {} if self.load is None else self.load.pending_tokens(time.perf_counter())

    def stats(self) -> dict[str, float]:
        """The step's stream counters (after cut()): groups cut and dropped incomplete, the
        cut groups' sampled tokens, and the mean live queues."""
        return {
            "num_groups_cut": float(self.num_groups_cut),
            "num_groups_incomplete": float(self.num_groups_incomplete),
            "num_cut_tokens": float(self.num_cut_tokens),
            **{key: float(value) for key, value in self.pending_tokens().items()},
        }

    def _note(self) -> None:
        if self.load is None:
            return
        self.load.record(
            time.perf_counter(),
            rollout_tokens=max(self._rollout_pending, 0),
            genrm_tokens=max(self._genrm_pending, 0),
        )
