"""What a checkpoint keeps beside the tensors of an RL run, and a resume from it.

    track_run_state(ckpt, loader=, sampler=, partials=, config=asdict(cfg), watched=(...))
    resumed = resume_run(ckpt, policy.state(), partials=partials)   # start at resumed.start_step
    metrics |= resumed.metrics(group)                               # the first step after it
    signal = save_stopped(ckpt, step, policy.state())               # a stop signal mid-rollout

`ckpt` is a yatt.ckpt.Checkpointer (track, keep_config, load, maybe_save, save, wait,
stop_signal, config_changes): the checkpointer saves and restores the named objects, this
module says which ones an RL run has and what a resume reports.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from yatt.core.runtime._metrics import reduce_metrics

logger = logging.getLogger("yatt.core")

# the checkpoint's cut groups not resumed, in the first step's metrics after a resume
RESUME_DROPPED_METRIC = "dynamic_sampling/num_partial_groups_dropped_on_resume"


def track_run_state(
    ckpt: Any,
    *,
    loader: Any,
    sampler: Any,
    partials: Any | None,
    config: Mapping[str, Any],
    watched: Sequence[str] = (),
) -> None:
    """Beside the tensors, each save keeps this rank's loader position, the sampler's keep
    rate (the next step's prior), with keep_partial the cut groups held for the next step
    (a PartialRollouts), and the resolved `config`; load() restores them (a checkpoint written
    before one was kept leaves it as it is) and compares the config on the `watched` dotted
    fields (settings that change what a run means)."""
    ckpt.track("loader", loader)
    ckpt.track("sampler", sampler)
    if partials is not None:
        ckpt.track("partials", partials)
    ckpt.keep_config(dict(config), watched=tuple(watched))


@dataclass(frozen=True)
class Resumed:
    """What resume_run restored: the step to start at, the checkpoint's cut groups this rank
    could not resume (their prompts not rebuilt, or keep_partial off now), and the watched
    config fields the resume changed."""

    start_step: int
    num_partial_groups_dropped: int = 0
    changed: tuple[str, ...] = ()

    def metrics(self, group) -> dict[str, float]:
        """The first step's metrics after the resume, over the ranks (collective)."""
        dropped = {RESUME_DROPPED_METRIC: float(self.num_partial_groups_dropped)}
        out = reduce_metrics(dropped, group=group, default_op="sum")
        return out | {f"resume/changed/{name}": 1.0 for name in self.changed}


def resume_run(ckpt: Any, state: dict[str, Any], *, partials: Any | None) -> Resumed:
    """Load the newest checkpoint: the tensors and what track_run_state tracks. Cut groups
    not resumed (keep_partial off now, or a prompt not rebuilt) are logged and counted."""
    extra = ckpt.load(state)
    held = extra.get("partials")
    num_dropped = 0
    if held is not None and partials is None:
        num_dropped = len(held.get("groups", ())) if isinstance(held, dict) else 0
        logger.warning(
            "the checkpoint holds %d cut groups; rollout.keep_partial is off: not resumed",
            num_dropped,
        )
    elif held is not None:
        num_dropped = partials.num_dropped_on_load
        if num_dropped:  # their rows are unusable now, or no longer give the same prompt ids
            logger.warning(
                "%d of the checkpoint's cut groups are not resumed: their prompts cannot be "
                "rebuilt from the saved rows (unusable now, or other prompt ids)",
                num_dropped,
            )
    logger.info("resumed after step %d", extra["step"])
    return Resumed(
        start_step=extra["step"] + 1,
        num_partial_groups_dropped=num_dropped,
        changed=tuple(name for name, _, _ in ckpt.config_changes),  # warned by the ckpt
    )


def save_stopped(ckpt: Any, step: int, state: dict[str, Any]) -> int | None:
    """A stop signal ended `step`'s rollout: the step is saved without an update (its drawn
    rows used up, as a skipped step's), so a resume continues at step + 1; returns the signal
    (the same on every rank: maybe_save agrees on it)."""
    decision = ckpt.maybe_save(step, state, phase="train", extra={"step": step})
    if not decision.is_saved:  # a rank without the signal, in a run whose ranks do not agree
        ckpt.save(step, state, extra={"step": step})
        ckpt.wait()
    signal = decision.stop_signal or ckpt.stop_signal
    logger.warning(
        "stopped by signal %s during step %d's rollout: saved without its update (a resume "
        "continues with step %d)",
        signal,
        step,
        step + 1,
    )
    return signal
