"""The checkpointer's settings: retention, async mode and the save schedule."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(kw_only=True, frozen=True)
class CkptConfig:
    """Settings of a `Checkpointer`; validated when built.

    Schedule rule (used by `Checkpointer.maybe_save`): a call is *eligible* when `phases` is empty
    or its `phase` is listed (a call without a phase is eligible only when `phases` is empty). An
    eligible call saves when a stop signal arrived, when `step` is a positive multiple of
    `every_steps` not saved yet, or when `every_seconds` passed since the last save (or since the
    checkpointer was built). With neither `every_steps` nor `every_seconds`, an eligible call saves
    only on a stop signal. With when_busy="defer", a due save that finds the previous one still
    being written is deferred to the next eligible call (on every rank alike).
    """

    # Number of newest complete checkpoints kept; older ones are deleted after each commit.
    keep_last: int = 3
    # Also keep every checkpoint whose step is a multiple of this (None: keep none extra).
    keep_every: int | None = None
    # True: `save` returns once tensors are copied to CPU memory and writes in a background thread.
    async_save: bool = True
    # Who writes an async save: "thread" (a background thread of the trainer) or "process" (one
    # persistent writer process per rank, reading the staged tensors from shared memory; use it
    # for large states saved often beside a Python-heavy training loop, see docs/yatt-ckpt.md).
    writer: str = "thread"
    # Save when the step is a positive multiple of this (None: no step-based saves).
    every_steps: int | None = None
    # Save when this many seconds passed since the last save (None: no time-based saves).
    every_seconds: float | None = None
    # Phase boundaries at which `maybe_save` may save, e.g. ("train",); empty: every call.
    phases: tuple[str, ...] = ()
    # A scheduled save that comes while the previous one is still being written: "wait" for it
    # (the training loop stalls until the write ends), or "defer" the save to the first later
    # `maybe_save` that finds the writer free (saves as often as the disk allows, never
    # stalling; the newest checkpoint may be a few steps older). Stop-signal saves always wait.
    when_busy: str = "wait"

    def __post_init__(self) -> None:
        if not isinstance(self.keep_last, int) or self.keep_last < 1:
            raise ValueError(
                f"keep_last={self.keep_last!r} must be an int >= 1: the newest complete "
                "checkpoint is never deleted; pass keep_last=1 to keep only it"
            )
        if self.keep_every is not None and (
            not isinstance(self.keep_every, int) or self.keep_every < 1
        ):
            raise ValueError(
                f"keep_every={self.keep_every!r} must be None or an int >= 1 (keep every "
                "keep_every-th step)"
            )
        if self.writer not in ("thread", "process"):
            raise ValueError(
                f"writer={self.writer!r} must be 'thread' (write in a background thread) or "
                "'process' (write in a separate process per rank)"
            )
        if self.every_steps is not None and (
            not isinstance(self.every_steps, int) or self.every_steps < 1
        ):
            raise ValueError(
                f"every_steps={self.every_steps!r} must be None or an int >= 1 (save every "
                "every_steps steps)"
            )
        if self.every_seconds is not None and not (
            isinstance(self.every_seconds, int | float)
            and math.isfinite(self.every_seconds)
            and self.every_seconds > 0
        ):
            raise ValueError(
                f"every_seconds={self.every_seconds!r} must be None or a finite number > 0"
            )
        if self.when_busy not in ("wait", "defer"):
            raise ValueError(
                f"when_busy={self.when_busy!r} must be 'wait' (a due save waits for the previous "
                "write) or 'defer' (it moves to the first later maybe_save with the writer free)"
            )
        if isinstance(self.phases, str) or not all(isinstance(p, str) for p in self.phases):
            raise ValueError(
                f"phases={self.phases!r} must be a tuple of phase names, e.g. ('train',)"
            )
        object.__setattr__(self, "phases", tuple(self.phases))
