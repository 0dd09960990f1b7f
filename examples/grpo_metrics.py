"""What a step of the reference trainer reports, and when the judge's failures stop the run.

    stats = StepStats()                     # this rank's sums over the step's rollout rounds
    stats.add(scored, accuracy)             # after each round (accuracy: the declared signal)
    metrics = summarize(stats, ...)         # all ranks, one small collective
    check_verdicts(step, metrics, stats.first_failure, warnings)
    metrics |= eval_metrics(eval_stats, group)   # eval/* of the held-out prompts

Verdict statuses are counted (genrm/verdicts, genrm/errors, genrm/unparsable) and a failure's
cause logged, at most once per log.warn_every_steps steps (the counts are in every step's
metrics); a step whose every verdict failed raises, since it cannot learn (every reward is the
default) and would otherwise run to the end and exit 0.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from grpo_data import Scored

from yatt import core, genrm

logger = logging.getLogger("train_grpo")
NUM_LOGGED_SAMPLES = 4  # responses a step writes to out_dir/samples.jsonl (rank 0's first)


@dataclass
class StepStats:
    """This rank's sums over one step's rollout rounds, reduced across ranks for the metrics."""

    num_rounds: int = 0
    num_samples: int = 0
    reward_sum: float = 0.0
    num_correct: float = 0.0  # sum of the declared accuracy signal (reward.accuracy)
    num_accuracy_missing: int = 0  # responses whose verdict did not carry that signal
    num_response_tokens: int = 0
    num_verdicts: int = 0
    num_errors: int = 0  # the judge failed (engine, template, context): default reward
    num_unparsable: int = 0  # no verdict in the judge's text: default reward
    num_images: int = 0  # the images of the sampled responses' prompts
    num_cut: int = 0  # responses ended before a sampled vision token
    first_failure: str | None = None  # the first failed verdict's cause, for the log
    timings: dict[str, float] = field(default_factory=dict)  # seconds per phase
    # the step's first few responses with their rewards, for out_dir/samples.jsonl
    samples: list[dict[str, Any]] = field(default_factory=list)
    # per reward function (Verdict.components, e.g. "judge", "rewards:score") its values'
    # [count, sum, sum of squares]; per returned value ("<function>/<key>", Verdict.metrics)
    # [count, sum]: reduced over ranks into reward/<name>/mean and /std (genrm.ScoreStats'
    # reward_metrics, over the whole step)
    component_sums: dict[str, list[float]] = field(default_factory=dict)
    metric_sums: dict[str, list[float]] = field(default_factory=dict)

    def add(
        self,
        scored: Sequence[Scored],
        accuracy: genrm.AccuracySignal | None,
        cut_token_ids: Sequence[int] = (),
    ) -> None:
        """A round's judged responses (accuracy: the declared signal; None: no metric)."""
        verdict_stats = genrm.ScoreStats.from_verdicts(item.verdict for item in scored)
        self.num_verdicts += verdict_stats.num_verdicts
        self.num_errors += verdict_stats.num_errors
        self.num_unparsable += verdict_stats.num_unparsable
        if self.first_failure is None:
            self.first_failure = verdict_stats.first_error or verdict_stats.first_unparsable
        for item in scored:
            if len(self.samples) < NUM_LOGGED_SAMPLES:
                self.samples.append(
                    {
                        "prompt": item.sample.prompt,
                        "completion": item.sample.response,
                        "reward": item.verdict.reward,
                    }
                )
            self.num_samples += 1
            self.reward_sum += item.verdict.reward
            if accuracy is not None:
                value = accuracy.read(item.sample, item.verdict)
                self.num_accuracy_missing += value is None
                self.num_correct += value or 0.0
            for name, value in item.verdict.components.items():
                if value is not None:
                    sums = self.component_sums.setdefault(name, [0.0, 0.0, 0.0])
                    sums[0] += 1
                    sums[1] += value
                    sums[2] += value * value
            for key, value in item.verdict.metrics.items():
                sums = self.metric_sums.setdefault(key, [0.0, 0.0])
                sums[0] += 1
                sums[1] += value
            self.num_response_tokens += len(item.completion.response_ids)
            self.num_images += len(item.prompt.images or ())
            self.num_cut += any(token in cut_token_ids for token in item.completion.response_ids)


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
    names = _names_over_ranks(sorted(stats.component_sums), group)
    keys = _names_over_ranks(sorted(stats.metric_sums), group)
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


@dataclass
class VerdictWarnings:
    """When to log failed verdicts: a new cause at once, the same cause at most once per
    `every_steps` steps (the counts are metrics every step; the log says why)."""

    every_steps: int = 20
    last_step: int | None = None
    last_cause: str | None = None
    accuracy: str = ""  # reward.accuracy: a step with responses missing it is logged once
    has_warned_accuracy: bool = False

    def should_warn(self, step: int, cause: str) -> bool:
        cause = re.sub(r"\d+", "#", cause)  # the same failure on another row is not new
        is_due = self.last_step is None or step - self.last_step >= self.every_steps
        if cause != self.last_cause or is_due:
            self.last_step, self.last_cause = step, cause
            return True
        return False


def check_verdicts(
    step: int,
    metrics: dict[str, float],
    first_failure: str | None,
    warnings: VerdictWarnings | None = None,
) -> None:
    """A step whose every verdict failed cannot learn: stop and say why, never train on zeros."""
    num_failed = metrics["genrm/errors"] + metrics["genrm/unparsable"]
    warnings = warnings if warnings is not None else VerdictWarnings()
    num_missing = metrics.get("reward/accuracy_missing", 0.0)
    if num_missing and not warnings.has_warned_accuracy:
        warnings.has_warned_accuracy = True
        logger.warning(
            "step %d: %d of %d responses carry no reward.accuracy=%r signal (counted in "
            "reward/accuracy_missing every step, read as wrong; logged once): name a verdict "
            "component or a '<function>/<key>' a reward function returns",
            step,
            num_missing,
            metrics["genrm/verdicts"],
            warnings.accuracy,
        )
    if num_failed and first_failure is not None and warnings.should_warn(step, first_failure):
        logger.warning(
            "step %d: %d of %d verdicts failed (counted in genrm/errors and genrm/unparsable "
            "every step; logged again after %d steps or for a new cause); first: %s",
            step,
            num_failed,
            metrics["genrm/verdicts"],
            warnings.every_steps,
            first_failure,
        )
    if metrics["genrm/verdicts"] and num_failed == metrics["genrm/verdicts"]:
        raise RuntimeError(
            f"step {step}: every one of {num_failed:.0f} judge verdicts failed "
            f"({metrics['genrm/errors']:.0f} errors, {metrics['genrm/unparsable']:.0f} "
            f"unparsable); first on this rank: {first_failure or 'see the other ranks'}. Check "
            "reward.judge_template, the judge's context (reward.engine.max_seq_len) and output"
        )
