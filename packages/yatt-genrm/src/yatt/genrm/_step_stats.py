"""What one RL step's judged responses add up to on a rank, and when failed verdicts are
logged or stop a run.

    stats = StepStats()                     # this rank's sums over the step's rollout rounds
    stats.add(judged, accuracy)             # after each round (accuracy: an AccuracySignal)
    ... reduce stats' sums over ranks ...   # the trainer's summarize (one small collective)
    check_verdicts(step, metrics, stats.first_failure, warnings)

Verdict statuses are counted (genrm/verdicts, genrm/errors, genrm/unparsable in the metrics
a trainer builds) and a failure's cause logged, at most once per `every_steps` steps; a step
whose every verdict failed raises, since it cannot learn (every reward is the default) and
would otherwise run to the end and exit 0. Per reward function the values are summed for a
mean and std over the whole step (ScoreStats.reward_metrics is the same per call).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from yatt.genrm._accuracy import AccuracySignal
from yatt.genrm._judged_round import JudgedSample
from yatt.genrm._stats import ScoreStats

logger = logging.getLogger("yatt.genrm")
NUM_LOGGED_SAMPLES = 4  # responses a step keeps for its samples log (this rank's first)


@dataclass
class StepStats:
    """This rank's sums over one step's judged responses (all its rollout rounds); a trainer
    reduces them across ranks for its metrics."""

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
        judged: Sequence[JudgedSample],
        accuracy: AccuracySignal | None,
        cut_token_ids: Sequence[int] = (),
    ) -> None:
        """A round's judged responses (accuracy: the declared signal; None: no metric).
        cut_token_ids: a response holding one was ended before it (a vision token)."""
        verdict_stats = ScoreStats.from_verdicts(item.verdict for item in judged)
        self.num_verdicts += verdict_stats.num_verdicts
        self.num_errors += verdict_stats.num_errors
        self.num_unparsable += verdict_stats.num_unparsable
        if self.first_failure is None:
            self.first_failure = verdict_stats.first_error or verdict_stats.first_unparsable
        for item in judged:
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
            # A trajectory's tool results (loss mask 0) may hold image tokens with their images:
            # only a sampled token was cut at.
            mask = getattr(item.completion, "loss_mask", None)
            response = item.completion.response_ids
            self.num_cut += any(
                token in cut_token_ids and (mask is None or mask[i])
                for i, token in enumerate(response)
            )


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
