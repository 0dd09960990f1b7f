"""The step's batch from a DynamicSampler, and a stop signal that ended its rollout.

try:
    batch, sampling_stats = take_step_batch(sampler, should_stop=stop_flag_is_set)
except StepStopped as stopped:          # on every rank, when any rank was stopped
    log(stopped.sampling_stats); save without an update; exit
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from yatt.core.data._batch import Batch


class StepStopped(Exception):
    """A stop signal ended the step's rollout on some rank before its batch was full: every
    rank raises it (take_step_batch) with the step's sampling stats; a trainer logs the step,
    saves it without an update and exits."""

    def __init__(self, sampling_stats: dict[str, float]) -> None:
        super().__init__("a stop signal ended the step's rollout")
        self.sampling_stats = sampling_stats


def take_step_batch(
    sampler: Any, *, should_stop: bool = False, drop_keys: Sequence[str] = ()
) -> tuple[Batch, dict[str, float]]:
    """The step's kept groups (sampler.take(): collective, waits for every rank) and its
    sampling stats, without the sample fields `drop_keys` (e.g. the keep rule's signal once
    it has decided); StepStopped on every rank when a stop signal reached any (should_stop:
    this rank's, given to the sampler first)."""
    if should_stop:
        sampler.request_stop()
    batch, sampling_stats = sampler.take()
    if sampling_stats.get("is_stopped"):
        raise StepStopped(sampling_stats)
    for key in drop_keys:
        batch.samples.pop(key, None)
    return batch, sampling_stats
