"""Score rollout completions as they finish: the partial-colocation overlap in one call.

    completions, verdicts = await score_as_completed(engine.stream(requests, sampling),
                                                     scorer, to_sample)

The producer pushes each completion to the scorer the moment the engine yields it, and a
consumer drains verdicts concurrently, so judge batches run while the rollout's long tail is
still generating and the scorer's bounded queue never blocks the producer for long.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Any

from yatt.genrm._types import Sample, Verdict


async def score_as_completed(
    completions: AsyncIterator[Any],
    scorer: Any,
    to_sample: Callable[[Any], Sample],
) -> tuple[list[Any], list[Verdict]]:
    """(completions in arrival order, their verdicts in the same order).

    `scorer` is a GenRM, CombinedRM or GenRMClient (anything with submit/finish/results);
    `to_sample(completion)` turns a completion into the text the judge reads. Sample ids are
    replaced by the arrival index, so verdicts pair with completions whatever ids you chose.
    """
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

    await asyncio.gather(produce(), consume())
    missing = [i for i in range(len(arrived)) if str(i) not in verdicts]
    if missing:
        raise AssertionError(f"scorer returned no verdict for completions {missing[:5]}")
    return arrived, [verdicts[str(i)] for i in range(len(arrived))]
