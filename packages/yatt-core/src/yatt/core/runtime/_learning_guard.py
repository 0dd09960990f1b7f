"""Stop a run that cannot learn instead of letting it run to the end and exit 0.

A GRPO step updates nothing when dynamic sampling found no group with reward variance (every
sample of a prompt got the same reward, so every advantage is 0) or when the optimizer step was
skipped (a non-finite loss or gradient norm). One such step is normal; many in a row mean the
reward or the optimisation is broken, and the run would burn its budget producing nothing.

    guard = LearningGuard(max_idle_steps=20)
    for step in ...:
        batch, sampling_stats = sample_dynamically(...)
        train_metrics = policy.train_step(batch, loss)
        guard.update(step, train_metrics, sampling_stats)   # counts
        log(step, metrics | guard.metrics())                 # the step's metrics are kept
        guard.check(step)                                    # raises NoLearningError

`train_metrics["is_skipped"]` is the same on every data-parallel rank (train_step decides it from
globally reduced numbers), so every rank raises at the same step and none waits in a collective.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


class NoLearningError(RuntimeError):
    """`max_idle_steps` consecutive steps updated nothing; the message names the cause."""


@dataclass
class LearningGuard:
    """Counts consecutive steps without a parameter update and raises after `max_idle_steps`.

    max_idle_steps: 0 turns the guard off. The count restarts at every step that updates.
    """

    max_idle_steps: int = 20
    num_idle_steps: int = 0  # consecutive, up to the last step seen
    num_idle_steps_total: int = 0
    causes: dict[str, int] = field(default_factory=dict)  # of the current idle run

    def __post_init__(self) -> None:
        if isinstance(self.max_idle_steps, bool) or not isinstance(self.max_idle_steps, int):
            raise TypeError(f"max_idle_steps={self.max_idle_steps!r}: must be an int")
        if self.max_idle_steps < 0:
            raise ValueError(f"max_idle_steps={self.max_idle_steps}: must be >= 0 (0 = off)")

    def update(
        self,
        step: int,
        train_metrics: Mapping[str, float],
        sampling_stats: Mapping[str, float] | None = None,
        *,
        is_solved: bool = False,
    ) -> None:
        """Record one step: train_step's metrics (unprefixed) and, with dynamic sampling,
        sample_dynamically's stats of this rank. `check` raises once the limit is reached.

        is_solved: every sample of the step was right (the same on every rank), so no group
        had reward variance because the policy has learnt the prompts: not a failure, and it
        restarts the count. Only the caller knows the rewards' meaning."""
        if "is_skipped" not in train_metrics:
            raise KeyError("train_metrics needs 'is_skipped' (the dict train_step returns)")
        if not train_metrics["is_skipped"] or is_solved:
            self.num_idle_steps = 0
            self.causes = {}
            return
        cause = _idle_cause(train_metrics, sampling_stats)
        self.num_idle_steps += 1
        self.num_idle_steps_total += 1
        self.causes[cause] = self.causes.get(cause, 0) + 1

    def check(self, step: int) -> None:
        """Raise NoLearningError when the last `max_idle_steps` steps updated nothing."""
        if self.max_idle_steps and self.num_idle_steps >= self.max_idle_steps:
            counted = "; ".join(f"{count} x {text}" for text, count in self.causes.items())
            raise NoLearningError(
                f"step {step}: {self.num_idle_steps} steps in a row updated nothing, so the run "
                f"cannot learn ({counted}). The steps are in the metrics as train/is_skipped"
            )

    def metrics(self) -> dict[str, float]:
        """Idle steps in a row now, and in total since the guard was made."""
        return {
            "train/idle_steps_in_a_row": float(self.num_idle_steps),
            "train/idle_steps": float(self.num_idle_steps_total),
        }


def _idle_cause(
    train_metrics: Mapping[str, float], sampling_stats: Mapping[str, float] | None
) -> str:
    if sampling_stats is not None and not sampling_stats.get("num_groups_kept", 1.0):
        generated = sampling_stats.get("num_groups_generated", 0.0)
        return (
            f"no group with reward variance ({generated:.0f} generated on this rank, every "
            "sample of a prompt got the same reward): check the reward (functions, judge, "
            "the rows' answer field) or raise rollout.temperature"
        )
    if not train_metrics.get("num_loss_tokens", 1.0):
        return "no response tokens to train on: check rollout.max_new_tokens and the prompts"
    return (
        f"the optimizer step was skipped (loss={train_metrics.get('loss')}, grad_norm="
        f"{train_metrics.get('grad_norm')}, not finite): lower the learning rate or check the data"
    )
