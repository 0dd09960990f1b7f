"""How partial colocation divides device memory between the rollout engine and the GenRM.

Both engines are resident together; each step the one with more pending work (tokens still
to generate or to score) should get more KV cache. The target share is proportional to the
pending tokens, clipped to the user's bounds, and smoothed so one odd step does not resize
both caches back and forth:

    target   = clip(rollout_tokens / (rollout_tokens + genrm_tokens), min, max)
    fraction = smoothing * fraction + (1 - smoothing) * target
    rollout share of the device = total_fraction * fraction, GenRM share = the rest of it

The load is best measured on the live queues while the step runs (`PendingLoad`): the
tokens the rollout still has to generate and the tokens the judge still has to read and
write, sampled at every change (a request fed or finished, a sample sent to or back from the
judge) and averaged over time, so a queue that stayed long counts more than a burst:

    load = PendingLoad()
    load.record(now, rollout_tokens=..., genrm_tokens=...)   # at each change of the queues
    plan.update_load(**load.pending_tokens(end))             # the time-weighted means
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from yatt.placement._capabilities import ResizableMemory


@dataclass(kw_only=True)
class MemorySplit:
    """Bounds and pace of the rollout/GenRM memory split in partial colocation."""

    # Share of the device's memory the two engines may use together (the rest is headroom
    # for activations, NCCL buffers and the allocator's slack).
    total_fraction: float = 0.85
    # The rollout engine's part of total_fraction never leaves [min, max].
    min_rollout_fraction: float = 0.3
    max_rollout_fraction: float = 0.8
    # Where the split starts, before any load is measured.
    initial_rollout_fraction: float = 0.5
    # Weight of the previous split in each update: 0 follows the load at once, 0.9 slowly.
    smoothing: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 < self.total_fraction <= 1.0:
            raise ValueError(
                f"MemorySplit.total_fraction={self.total_fraction} must be in (0, 1]; e.g. 0.85"
            )
        if not 0.0 <= self.min_rollout_fraction <= self.max_rollout_fraction <= 1.0:
            raise ValueError(
                f"MemorySplit.min_rollout_fraction={self.min_rollout_fraction} and "
                f"max_rollout_fraction={self.max_rollout_fraction} must satisfy "
                "0 <= min <= max <= 1"
            )
        lo, hi = self.min_rollout_fraction, self.max_rollout_fraction
        if not lo <= self.initial_rollout_fraction <= hi:
            raise ValueError(
                f"MemorySplit.initial_rollout_fraction={self.initial_rollout_fraction} must lie "
                f"within [min_rollout_fraction, max_rollout_fraction] = [{lo}, {hi}]"
            )
        if not 0.0 <= self.smoothing < 1.0:
            raise ValueError(f"MemorySplit.smoothing={self.smoothing} must be in [0, 1); e.g. 0.5")


def next_rollout_fraction(
    split: MemorySplit, current: float, rollout_pending_tokens: float, genrm_pending_tokens: float
) -> float:
    """The rollout engine's part of `split.total_fraction` after one load measurement."""
    if rollout_pending_tokens < 0 or genrm_pending_tokens < 0:
        raise ValueError(
            f"pending tokens must be >= 0, got rollout_pending_tokens={rollout_pending_tokens}, "
            f"genrm_pending_tokens={genrm_pending_tokens}"
        )
    total = rollout_pending_tokens + genrm_pending_tokens
    if total == 0:
        # Nothing pending says nothing about the next step's load: keep the split.
        return current
    target = rollout_pending_tokens / total
    target = min(max(target, split.min_rollout_fraction), split.max_rollout_fraction)
    return split.smoothing * current + (1.0 - split.smoothing) * target


class PendingLoad:
    """Pending rollout and GenRM tokens over one step, as a step function of time: each
    record() holds until the next one (or `end`). pending_tokens(end) gives the time-weighted
    means, the arguments of Plan.update_load."""

    def __init__(self) -> None:
        self._samples: list[tuple[float, float, float]] = []  # (time, rollout, genrm)

    def record(self, now: float, *, rollout_tokens: float, genrm_tokens: float) -> None:
        """The queues from `now` on (times never go back)."""
        if rollout_tokens < 0 or genrm_tokens < 0:
            raise ValueError(
                f"pending tokens must be >= 0, got rollout_tokens={rollout_tokens}, "
                f"genrm_tokens={genrm_tokens}"
            )
        if self._samples and now < self._samples[-1][0]:
            raise ValueError(
                f"record(now={now}) is before the last record's {self._samples[-1][0]}"
            )
        self._samples.append((float(now), float(rollout_tokens), float(genrm_tokens)))

    def pending_tokens(self, end: float) -> dict[str, float]:
        """{"rollout_pending_tokens": mean, "genrm_pending_tokens": mean} over [first record,
        end]; zeros when nothing was recorded or no time passed (update_load keeps the split)."""
        sums = [0.0, 0.0]
        span = 0.0
        next_times = [t for t, _, _ in self._samples[1:]] + [end]
        for (t, rollout, genrm), t_next in zip(self._samples, next_times, strict=False):
            dt = max(min(t_next, end) - t, 0.0)
            sums[0] += rollout * dt
            sums[1] += genrm * dt
            span += dt
        if span <= 0:
            return {"rollout_pending_tokens": 0.0, "genrm_pending_tokens": 0.0}
        return {"rollout_pending_tokens": sums[0] / span, "genrm_pending_tokens": sums[1] / span}


class SplitState:
    """A plan's memory split: the rollout fraction, the shares it gives the two engines, and
    the share each engine's KV cache was last woken at (a new share applies at the next wake)."""

    ROLES = ("rollout", "genrm")

    def __init__(self, split: MemorySplit, roles: Mapping[str, object]) -> None:
        for name in self.ROLES:
            if name not in roles:
                raise ValueError(f"Plan(split=...) needs a role named {name!r}")
        self.split = split
        self.rollout_fraction = split.initial_rollout_fraction
        self._roles = roles
        self._woken_shares: dict[str, float] = {}
        self.apply()

    def shares(self) -> dict[str, float]:
        """Each engine's share of the device's memory."""
        total = self.split.total_fraction
        return {
            "rollout": total * self.rollout_fraction,
            "genrm": total * (1.0 - self.rollout_fraction),
        }

    def apply(self) -> None:
        for name, share in self.shares().items():
            role = self._roles[name]
            if isinstance(role, ResizableMemory):
                role.set_memory_fraction(share)

    def update(self, rollout_pending_tokens: float, genrm_pending_tokens: float) -> float:
        self.rollout_fraction = next_rollout_fraction(
            self.split, self.rollout_fraction, rollout_pending_tokens, genrm_pending_tokens
        )
        self.apply()
        return self.rollout_fraction

    def note_wake(self, role: str, *, sizes_kv_cache: bool) -> None:
        """`role` woke; with `sizes_kv_cache` its KV cache took the current share."""
        if role in self.ROLES and sizes_kv_cache:
            self._woken_shares[role] = self.shares()[role]

    def has_moved(self, role: str) -> bool:
        """Whether `role`'s share changed since its KV cache last woke (or it never woke)."""
        return role in self.ROLES and self._woken_shares.get(role) != self.shares()[role]

    def wake_scales(self) -> dict[str, float]:
        """Factor on each engine's measured wake bytes: a KV cache grows with its share."""
        return {
            name: max(1.0, share / self._woken_shares[name])
            for name, share in self.shares().items()
            if self._woken_shares.get(name)
        }
