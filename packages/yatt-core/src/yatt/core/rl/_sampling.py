"""DAPO dynamic sampling through a callback: the earlier form of `DynamicSampler`'s rounds.

    batch, stats = sample_dynamically(generate, num_groups=8, max_rounds=3, group=dp_group)

is, exactly, with no over-sampling (each round draws only the missing number):

    sampler = DynamicSampler(target_groups=8, max_rounds=3, should_adapt=False, group=dp_group)
    while not sampler.is_done():
        sampler.add(generate(sampler.num_to_draw()))
    batch, stats = sampler.take()

Prefer the sampler in a loop: generate -> score -> keep stay visible calls there, and it
over-samples and streams. This wrapper stays for callers written against it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from yatt.core.data._batch import Batch
from yatt.core.rl._sampler import DynamicSampler, logger
from yatt.core.runtime._repeated_log import RepeatedWarning

# One count across calls (each call builds a sampler): logged first, then once per 50.
_NOT_FILLED = RepeatedWarning(logger, metric="dynamic_sampling/is_filled")


def sample_dynamically(
    generate: Callable[[int], Batch],
    *,
    num_groups: int,
    max_rounds: int,
    group: dist.ProcessGroup | None = None,
    group_key: str = "group_id",
    reward_key: str = "reward",
    tolerance: float = 0.0,
) -> tuple[Batch, dict[str, float]]:
    """This rank's batch of up to `num_groups` groups with reward variance, and local stats.

    generate(num_missing) returns a scored batch with sample fields `group_key` and
    `reward_key`; it receives 0 once this rank is full and should still draw its prompts' share
    of any collective. Group ids are renumbered 0..K-1 in order of arrival. If max_rounds end
    first, the batch has fewer groups (stats report is_filled=0); collective over `group`.
    """
    sampler = DynamicSampler(
        target_groups=num_groups,
        max_rounds=max_rounds,
        should_adapt=False,
        tolerance=tolerance,
        group=group,
        group_key=group_key,
        reward_key=reward_key,
    )
    sampler.unfilled_warning = _NOT_FILLED
    while not sampler.is_done():
        sampler.add(generate(sampler.num_to_draw()))
    return sampler.take()
