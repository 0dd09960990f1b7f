"""A multi-turn rollout's counts over all ranks: the per-rank metrics of
yatt.rollout.MultiTurnStats.as_metrics (counts, counts by cause, turns_mean, turns_max) reduced
in one collective (reduce_metrics).

    total = reduce_turn_metrics(turn_stats.as_metrics(prefix="multiturn/"),
                                num_turns=sum(turn_stats.turns), group=runtime.dp_group)

Counts are summed (a count by cause one rank never saw joins as 0), turns_max is the max, and
turns_mean is the summed turns over the summed trajectories: a mean of the ranks' means would
weigh a rank with one trajectory as much as one with a hundred.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch.distributed as dist

from yatt.core.runtime._metrics import reduce_metrics


def reduce_turn_metrics(
    metrics: Mapping[str, float],
    *,
    num_turns: int,
    group: dist.ProcessGroup | None = None,
    prefix: str = "multiturn/",
) -> dict[str, float]:
    """`metrics` (keys `prefix`num_trajectories, `prefix`turns_mean, `prefix`turns_max and
    counts) over the ranks of `group`; num_turns: this rank's turns over all its trajectories.
    Collective: every rank calls it once."""
    mean_key, max_key = prefix + "turns_mean", prefix + "turns_max"
    sum_key, count_key = prefix + "turns_sum", prefix + "num_trajectories"
    sums = {key: value for key, value in metrics.items() if key not in (mean_key, max_key)}
    sums[sum_key] = float(num_turns)
    ops = {key: "sum" for key in sums}
    sums[max_key] = metrics[max_key]
    ops[max_key] = "max"
    total = reduce_metrics(sums, group=group, ops=ops)
    total[mean_key] = total.pop(sum_key) / max(total[count_key], 1.0)
    return total
