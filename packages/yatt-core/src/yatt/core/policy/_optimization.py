"""Optimisation settings both policy configs share: the learning-rate schedule and its checks.

    lr of optimizer step t (0-based: t updates applied before it)
        t < W                 lr * (t + 1) / W                   linear warm-up, W = num_warmup_steps
        "constant"            lr
        "cosine", t < D       min + (lr - min) (1 + cos(pi (t - W) / (D - W))) / 2
        "cosine", t >= D      min = lr * min_lr_ratio            D = num_decay_steps

`compute_lr` is pure: a backend asks it for the step it is about to take, and the step count
(StepCounts.num_optimizer_steps) is in the policy's checkpointable state, so a resume continues
the schedule exactly. Skipped steps (non-finite, or no loss tokens) do not advance it.
After the warm-up this is Hugging Face's get_cosine_with_min_lr_schedule_with_warmup and
Megatron-Core's OptimizerParamScheduler "cosine" style (lr_decay_steps = D, min_lr = lr *
min_lr_ratio); their warm-ups start at 0, this one at lr / W, so no step is wasted.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, Literal

LRSchedule = Literal["constant", "cosine"]
LR_SCHEDULES: tuple[str, ...] = ("constant", "cosine")


def compute_lr(
    step: int,
    *,
    lr: float,
    num_warmup_steps: int = 0,
    schedule: LRSchedule = "constant",
    num_decay_steps: int | None = None,
    min_lr_ratio: float = 0.0,
) -> float:
    """The learning rate of optimizer step `step` (0-based); see the module docstring."""
    if step < num_warmup_steps:
        return lr * ((step + 1) / num_warmup_steps)
    if schedule == "constant":
        return lr
    if schedule != "cosine":
        raise ValueError(f"schedule={schedule!r} is not known; use one of {LR_SCHEDULES}")
    if num_decay_steps is None:
        raise ValueError("schedule='cosine' needs num_decay_steps")
    min_lr = lr * min_lr_ratio
    if step >= num_decay_steps:
        return min_lr
    progress = (step - num_warmup_steps) / (num_decay_steps - num_warmup_steps)
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_lr_schedule(config: Any) -> Callable[[int], float]:
    """step -> lr for a policy config's lr, lr_schedule, num_warmup_steps, num_decay_steps and
    min_lr_ratio (checked by check_optimizer_fields when the config was built)."""
    return functools.partial(
        compute_lr,
        lr=config.lr,
        num_warmup_steps=config.num_warmup_steps,
        schedule=config.lr_schedule,
        num_decay_steps=config.num_decay_steps,
        min_lr_ratio=config.min_lr_ratio,
    )


def check_optimizer_fields(owner: str, config: Any) -> None:
    """Raise ValueError naming `owner`.field for a bad optimisation setting of a policy config:
    lr, betas, weight_decay, grad_clip, lr_schedule, num_warmup_steps, num_decay_steps,
    min_lr_ratio."""
    if not _is_number(config.lr) or not 0 < config.lr < math.inf:
        raise ValueError(f"{owner}.lr={config.lr!r}: must be a finite number > 0")
    if len(config.betas) != 2 or not all(_is_number(b) and 0.0 <= b < 1.0 for b in config.betas):
        raise ValueError(f"{owner}.betas={config.betas!r}: need two values in [0, 1)")
    if not _is_number(config.weight_decay) or not 0 <= config.weight_decay < math.inf:
        raise ValueError(
            f"{owner}.weight_decay={config.weight_decay!r}: must be a finite number >= 0"
        )
    clip = config.grad_clip
    if clip is not None and (not _is_number(clip) or not 0 <= clip < math.inf):
        raise ValueError(
            f"{owner}.grad_clip={clip!r}: must be a finite number > 0, or 0 or None to disable"
        )
    _check_schedule(owner, config)


def _check_schedule(owner: str, config: Any) -> None:
    if config.lr_schedule not in LR_SCHEDULES:
        raise ValueError(f"{owner}.lr_schedule={config.lr_schedule!r}: use one of {LR_SCHEDULES}")
    warmup = config.num_warmup_steps
    if not _is_int(warmup) or warmup < 0:
        raise ValueError(f"{owner}.num_warmup_steps={warmup!r}: must be an int >= 0")
    decay = config.num_decay_steps
    ratio = config.min_lr_ratio
    if config.lr_schedule == "constant":
        # Set but unused would be a silent surprise: say which schedule uses them.
        if decay is not None:
            raise ValueError(
                f"{owner}.num_decay_steps={decay!r} applies to lr_schedule='cosine' only; "
                "set lr_schedule='cosine' or leave num_decay_steps unset"
            )
        if ratio != 0.0:
            raise ValueError(
                f"{owner}.min_lr_ratio={ratio!r} applies to lr_schedule='cosine' only; "
                "set lr_schedule='cosine' or leave min_lr_ratio at 0"
            )
        return
    if not _is_int(decay) or decay <= warmup:
        raise ValueError(
            f"{owner}.num_decay_steps={decay!r}: lr_schedule='cosine' needs an int > "
            f"num_warmup_steps ({warmup}), usually the run's number of steps"
        )
    if not _is_number(ratio) or not 0.0 <= ratio <= 1.0:
        raise ValueError(f"{owner}.min_lr_ratio={ratio!r}: must be in [0, 1]")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
