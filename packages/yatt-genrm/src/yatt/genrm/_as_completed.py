"""Score rollout completions as they finish: the partial-colocation overlap in one call.

    scored = await score_as_completed(engine.stream(requests, sampling), scorer, to_sample)
    completions, verdicts = scored   # a 2-tuple, as before
    scored.stats                     # ScoreStats of this call: num_errors, num_unparsable,
                                     # first_error, first_unparsable, num_judge_prompt_tokens, ...

The producer pushes each completion to the scorer the moment the engine yields it, and a
consumer drains verdicts concurrently, so judge batches run while the rollout's long tail is
still generating and the scorer's bounded queue never blocks the producer for long.

`stats` is counted from this call's verdicts, not by differencing the scorer's running
`metrics`, so it stays exact while other calls use the same scorer.

`should_stop` (a stop signal's flag) is read every POLL_S while the call waits: once it returns
True the rollout stream is closed (the engine drops its requests), the scorer's pending judge
requests and reward calls are aborted, and ScoringStopped is raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, NamedTuple

from yatt.genrm._stats import ScoreStats
from yatt.genrm._stopping import POLL_S, ScoringStopped, check_should_stop
from yatt.genrm._types import Sample, Scorer, Verdict


class ScoredCompletions(NamedTuple):
    """(completions in arrival order, their verdicts in the same order), plus `stats`."""

    completions: list[Any]
    verdicts: list[Verdict]

    @property
    def stats(self) -> ScoreStats:
        """Counts, first causes and judge tokens of this call's verdicts."""
        return ScoreStats.from_verdicts(self.verdicts)


async def score_as_completed(
    completions: AsyncIterator[Any],
    scorer: Scorer,
    to_sample: Callable[[Any], Sample],
    *,
    should_stop: Callable[[], bool] | None = None,
) -> ScoredCompletions:
    """(completions in arrival order, their verdicts in the same order), with `.stats`.

    `scorer` is a GenRM, OpenAIJudge, RewardFunction, CombinedRM or GenRMClient (anything with
    submit/finish/results); `to_sample(completion)` turns a completion into the text the judge
    reads. Sample ids are replaced by the arrival index, so verdicts pair with completions
    whatever ids you chose. `should_stop`: see the module's docstring.
    """
    check_should_stop(should_stop)
    arrived: list[Any] = []
    verdicts: dict[str, Verdict] = {}

    async def produce() -> None:
        try:
            async for completion in completions:
                sample = dataclasses.replace(to_sample(completion), id=str(len(arrived)))
                arrived.append(completion)
                await scorer.submit(sample)
        finally:
            await scorer.finish()  # also on error, so the consumer below ends

    async def consume() -> None:
        async for verdict in scorer.results():
            verdicts[verdict.sample_id] = verdict

    both = asyncio.gather(produce(), consume())
    if should_stop is None:
        await both
    else:
        begin = time.monotonic()
        if await _is_stopped(both, completions, scorer, should_stop):
            waited_s = time.monotonic() - begin
            raise ScoringStopped(num_samples=len(arrived), waited_s=waited_s)
    missing = [i for i in range(len(arrived)) if str(i) not in verdicts]
    if missing:
        raise AssertionError(f"scorer returned no verdict for completions {missing[:5]}")
    return ScoredCompletions(arrived, [verdicts[str(i)] for i in range(len(arrived))])


async def _is_stopped(
    work: asyncio.Future, completions: Any, scorer: Scorer, should_stop: Callable[[], bool]
) -> bool:
    """`await work`, reading should_stop() every POLL_S; once true (then True is returned),
    work is cancelled, the rollout stream closed and the scorer's pending work aborted."""
    while not work.done():
        if should_stop():
            break
        await asyncio.wait({work}, timeout=POLL_S)
    if work.done():
        work.result()
        return False
    work.cancel()
    await asyncio.gather(work, return_exceptions=True)
    aclose = getattr(completions, "aclose", None)
    if aclose is not None:  # an async generator: its finally aborts the engine's requests
        with contextlib.suppress(Exception):
            await aclose()
    abort = getattr(scorer, "_abort", None)
    if abort is not None:
        await abort()
    return True
