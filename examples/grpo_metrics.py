"""What a step of the reference trainer reports: genrm.StepStats' sums over all ranks.

    stats = genrm.StepStats()               # this rank's sums over the step's rollout rounds
    stats.add(judged, accuracy)             # after each round (accuracy: the declared signal)
    metrics = summarize(stats, ...)         # all ranks, one small collective
    genrm.check_verdicts(step, metrics, stats.first_failure, warnings)
    metrics |= eval_metrics(eval_stats, group)   # eval/* of the held-out prompts
    metrics |= response_length_metrics(batch, group)  # the trained responses' length quantiles

StepStats, VerdictWarnings and check_verdicts are yatt.genrm's (kept importable from here):
verdict statuses are counted, a failure's cause logged at most once per log.warn_every_steps
steps, and a step whose every verdict failed stops the run.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch.distributed as dist

from yatt import core
from yatt.genrm import StepStats, VerdictWarnings, check_verdicts

__all__ = [
    "StepStats",
    "VerdictWarnings",
    "check_verdicts",
    "eval_metrics",
    "response_length_metrics",
    "summarize",
]


def summarize(
    stats: StepStats,
    sampling_stats: dict[str, float],
    skipped_by_cause: dict[str, int],
    group,
    *,
    has_images: bool = False,
    has_accuracy: bool = False,
) -> dict[str, float]:
    """The step's metrics over all ranks in one small collective (a host sync): sums of counts,
    max of phase times (the slowest rank sets the pace), means of dynamic sampling's stats.
    has_images: also images/per_sample and response/cut_at_vision_token. has_accuracy (a
    declared reward.accuracy): reward/accuracy and reward/accuracy_missing; without one no
    accuracy is reported at all (a reward is not an accuracy)."""
    sums = {
        "samples": stats.num_samples,
        "reward": stats.reward_sum,
        "correct": stats.num_correct,
        "accuracy_missing": stats.num_accuracy_missing,
        "response_tokens": stats.num_response_tokens,
        "verdicts": stats.num_verdicts,
        "errors": stats.num_errors,
        "unparsable": stats.num_unparsable,
    }
    if has_images:
        sums |= {"images": stats.num_images, "cut": stats.num_cut}
    sums |= {f"skipped/{cause}": count for cause, count in skipped_by_cause.items()}
    sums |= _reward_function_sums(stats, group)
    local = {f"sum/{key}": float(value) for key, value in sums.items()}
    local |= {f"time/{key}_s": seconds for key, seconds in stats.timings.items()}
    ops = {key: "sum" if key.startswith("sum/") else "max" for key in local}
    local |= {f"dynamic_sampling/{key}": value for key, value in sampling_stats.items()}
    total = core.reduce_metrics(local, group=group, ops=ops)  # unnamed keys: the mean
    num_samples = max(total["sum/samples"], 1.0)
    metrics = {
        "reward/mean": total["sum/reward"] / num_samples,
        "response/length_mean": total["sum/response_tokens"] / num_samples,
        "genrm/verdicts": total["sum/verdicts"],
        "genrm/errors": total["sum/errors"],
        "genrm/unparsable": total["sum/unparsable"],
        # Rows skipped since the start, all ranks: in total and by cause.
        "data/skipped_rows": sum(total[f"sum/skipped/{cause}"] for cause in skipped_by_cause),
    }
    metrics |= {
        f"data/skipped_rows/{cause}": total[f"sum/skipped/{cause}"] for cause in skipped_by_cause
    }
    if has_accuracy:
        metrics["reward/accuracy"] = total["sum/correct"] / num_samples
        metrics["reward/accuracy_missing"] = total["sum/accuracy_missing"]
    metrics |= _reward_function_metrics(total)
    if has_images:
        metrics["images/per_sample"] = total["sum/images"] / num_samples
        # Responses that sampled a vision token, ended before it (grpo_prompts.py).
        metrics["response/cut_at_vision_token"] = total["sum/cut"]
    metrics |= {key: value for key, value in total.items() if not key.startswith("sum/")}
    return metrics


def _reward_function_sums(stats: StepStats, group) -> dict[str, float]:
    """Per reward function its count, sum and sum of squares (per returned value its count
    and sum), every rank with the same keys: the names seen on any rank (a rank whose every
    call of a function failed passes zeros)."""
    # one gather for both kinds of name: "c:" reward functions, "k:" returned keys
    tagged = [f"c:{name}" for name in stats.component_sums]
    tagged += [f"k:{key}" for key in stats.metric_sums]
    tagged = _names_over_ranks(sorted(tagged), group)
    names = [name[2:] for name in tagged if name.startswith("c:")]
    keys = [key[2:] for key in tagged if key.startswith("k:")]
    sums: dict[str, float] = {}
    for name in names:
        count, total, squares = stats.component_sums.get(name, (0.0, 0.0, 0.0))
        sums |= {f"fn/{name}/count": count, f"fn/{name}/sum": total, f"fn/{name}/sq": squares}
    for key in keys:
        count, total = stats.metric_sums.get(key, (0.0, 0.0))
        sums |= {f"fnkey/{key}/count": count, f"fnkey/{key}/sum": total}
    return sums


def _reward_function_metrics(total: dict[str, float]) -> dict[str, float]:
    """reward/<function>/mean and /std (population) over the step's responses that function
    scored; reward/<function>/<key>/mean for the values functions returned beside a score."""
    out: dict[str, float] = {}
    for key, count in total.items():
        if key.startswith("sum/fn/") and key.endswith("/count") and count:
            name = key[len("sum/fn/") : -len("/count")]
            mean = total[f"sum/fn/{name}/sum"] / count
            variance = max(total[f"sum/fn/{name}/sq"] / count - mean * mean, 0.0)
            out[f"reward/{name}/mean"] = mean
            out[f"reward/{name}/std"] = math.sqrt(variance)
        elif key.startswith("sum/fnkey/") and key.endswith("/count") and count:
            name = key[len("sum/fnkey/") : -len("/count")]
            out[f"reward/{name}/mean"] = total[f"sum/fnkey/{name}/sum"] / count
    return out


def _names_over_ranks(names: list[str], group) -> list[str]:
    """The union of every rank's `names` (collective with more than one rank; a host sync)."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return names
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, names, group=group)
    return sorted(set().union(*gathered))


def eval_metrics(stats: StepStats, group, *, has_accuracy: bool = False) -> dict[str, float]:
    """The held-out evaluation's metrics over all ranks (collective), as eval/*."""
    metrics = summarize(stats, {}, {}, group, has_accuracy=has_accuracy)
    keys = ("reward/mean", "reward/accuracy", "response/length_mean", "genrm/errors")
    out = {f"eval/{key}": metrics[key] for key in keys if key in metrics}
    out["eval/num_samples"] = metrics["genrm/verdicts"]
    out["eval/time_s"] = metrics.get("time/eval_s", 0.0)
    return out


def response_length_metrics(batch: core.Batch, group) -> dict[str, float]:
    """The trained responses' lengths over all ranks (collective; a host sync): median, p90
    (nearest rank: lengths a response had) and max, in tokens of the loss mask. The mean alone
    hides a long tail: a step waits for its longest response. Read before overlong filtering
    masks truncated responses out."""
    lengths = batch["loss_mask"].sum(-1).tolist() if len(batch) else []
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, lengths, group=group)
        lengths = [n for rank in gathered for n in rank]
    if not lengths:
        return {"response/length_p50": 0.0, "response/length_p90": 0.0, "response/length_max": 0.0}
    p50, p90 = np.percentile(lengths, [50, 90], method="inverted_cdf")
    return {
        "response/length_p50": float(p50),
        "response/length_p90": float(p90),
        "response/length_max": float(max(lengths)),
    }
