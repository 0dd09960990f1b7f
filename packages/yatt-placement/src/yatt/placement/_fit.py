"""offload="auto": a switch puts a role to sleep only when the next phase has no room beside it.

With offload="always" a switch into phase P sleeps every awake role P does not name. With
"auto" those roles stay awake as long as P fits next to them:

    need = bytes P's asleep roles (or tags) take to wake     measured at their last wake/sleep
         + P's peak growth (activations, logits, caches)      measured the last times P ran
         + headroom                                           default max(2 GiB, 5% of device)
    free = device free memory + bytes cached, unused, in torch's default pool (reusable)

While need > free the switch sleeps one more role, in `sleep_order`, and reads free again. A
phase never measured (the first step), or a role whose wake bytes are unknown, makes the switch
sleep them all as "always" does, so the first step runs as "always" and measures safely.

Measurements (defaults on CUDA; `FitConfig` replaces the readers, e.g. by fakes on CPU):
- wake bytes: the plan's meter around each wake call, per (role, tags); before a role's first
  such wake, what its last sleep from fully awake released.
- peak growth: from the end of P's switch to the start of the next switch, torch's peak allocated
  (or reserved, whichever grew more) over its level at the start, plus the device growth outside
  torch (non-torch allocations) that mem_get_info saw. The largest of P's last
  `_PEAK_WINDOW` runs counts, so one short batch does not lower the guard. The CUDA reader
  resets torch.cuda's peak memory stats at every switch.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

logger = logging.getLogger(__name__)

OffloadMode = Literal["always", "auto"]
OFFLOAD_MODES = ("always", "auto")
_PEAK_WINDOW = 4
_MIN_HEADROOM_BYTES = 2 << 30
_HEADROOM_FRACTION = 0.05

WakeCall = tuple[str, tuple[str, ...]]  # (role, tags) as the plan passes them to wake_up


@dataclass(kw_only=True)
class FitConfig:
    """How offload="auto" reads memory; a field left None takes the CUDA default."""

    # Bytes this process can still allocate now. Default on CUDA: mem_get_info's free bytes plus
    # those cached unused in torch's default pool. Without CUDA and without this, "auto" acts
    # as "always".
    free_bytes: Callable[[], int] | None = None
    # Bytes the memory in use rose, at its highest, above its level at the previous call, since
    # that call; each call starts a new window. Read at the end of a switch and at the next one.
    # Default on CUDA: torch's peak stats plus growth outside torch; else the meter's growth.
    peak_growth: Callable[[], int] | None = None
    # Room kept free beyond the estimate (fragmentation, a longer batch than the measured one).
    # Default: max(2 GiB, 5% of the device's memory); 2 GiB without CUDA.
    headroom_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.headroom_bytes is not None and self.headroom_bytes < 0:
            raise ValueError(
                f"FitConfig.headroom_bytes={self.headroom_bytes} must be >= 0, e.g. 2 << 30"
            )


def make_fit_books(
    offload: object, fit: FitConfig | None, meter: Callable[[], int]
) -> FitBooks | None:
    """The books of offload="auto", or None where switches sleep as "always" does."""
    if offload not in OFFLOAD_MODES:
        raise ValueError(
            f"offload={offload!r} is not known; use 'always' (a switch sleeps every role the "
            "phase does not name) or 'auto' (only when the phase would not fit beside them)"
        )
    if fit is not None and offload != "auto":
        raise ValueError(f"fit={fit!r} applies to offload='auto' only; pass offload='auto'")
    if offload == "always":
        return None
    books = FitBooks(fit or FitConfig(), meter)
    if books.can_measure:
        return books
    logger.info(
        "offload='auto' without CUDA needs FitConfig(free_bytes=...); without it every switch "
        "sleeps the roles its phase does not name, as offload='always' does"
    )
    return None


def make_default_meter(roles: Iterable[object]) -> Callable[[], int]:
    """A plan's default meter: the device's used memory (other processes count) with CUDA,
    else the sum of `resident_bytes()` over the roles that have it."""
    if torch.cuda.is_available():
        return read_device_used_bytes
    measured = [role for role in roles if hasattr(role, "resident_bytes")]
    return lambda: sum(role.resident_bytes() for role in measured)


def read_device_used_bytes() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def read_cuda_free_bytes() -> int:
    """Device free memory plus the bytes cached, unused, in torch's default pool.

    Only the default pool's cache counts: a phase's new tensors (activations) can reuse it, not
    that of private pools (region tags, offloaded objects), and a paused tag's cached blocks are
    not even on the device (they would count twice).
    """
    device = torch.cuda.current_device()
    free, _ = torch.cuda.mem_get_info(device)
    try:
        segments = torch.cuda.memory_snapshot(include_traces=False)
    except TypeError:  # torch before include_traces: traces are there only if recorded
        segments = torch.cuda.memory_snapshot()
    cached = sum(
        segment["total_size"] - segment["active_size"]
        for segment in segments
        if segment.get("device") == device
        and tuple(segment.get("segment_pool_id", (0, 0))) == (0, 0)
    )
    return free + max(0, cached)


class CudaPeakGrowth:
    """The default `FitConfig.peak_growth` on CUDA (see the module doc)."""

    def __init__(self) -> None:
        self._start: tuple[int, int, int] | None = None

    def __call__(self) -> int:
        device = torch.cuda.current_device()
        growth = 0
        if self._start is not None:
            allocated0, reserved0, used0 = self._start
            reserved = torch.cuda.memory_reserved(device)
            in_torch = max(
                torch.cuda.max_memory_allocated(device) - allocated0,
                torch.cuda.max_memory_reserved(device) - reserved0,
            )
            # What the device gained beyond this process's torch reservations.
            outside = (read_device_used_bytes() - used0) - (reserved - reserved0)
            growth = max(0, in_torch) + max(0, outside)
        torch.cuda.reset_peak_memory_stats(device)
        self._start = (
            torch.cuda.memory_allocated(device),
            torch.cuda.memory_reserved(device),
            read_device_used_bytes(),
        )
        return growth


class MeterGrowth:
    """`peak_growth` from a meter alone: what stayed in use, as no peak can be read."""

    def __init__(self, meter: Callable[[], int]) -> None:
        self._meter = meter
        self._start: int | None = None

    def __call__(self) -> int:
        now = self._meter()
        growth = 0 if self._start is None else max(0, now - self._start)
        self._start = now
        return growth


def sleep_order(
    candidates: Sequence[str], needed_next: Collection[str], size: Callable[[str], int]
) -> list[str]:
    """The order in which a switch puts roles to sleep until its phase fits.

    Roles the following phase (the one that came next last time) does not need go first: they
    would sleep at the next switch anyway, while keeping a needed one saves its wake-up. Within
    each group, the largest first, so the fewest roles sleep.
    """
    return sorted(candidates, key=lambda name: (name in needed_next, -size(name)))


class FitBooks:
    """What offload="auto" knows: wake bytes per role, peak growth per phase, free memory."""

    def __init__(self, config: FitConfig, meter: Callable[[], int]) -> None:
        on_cuda = torch.cuda.is_available()
        self._free_bytes = config.free_bytes or (read_cuda_free_bytes if on_cuda else None)
        self._peak_growth = config.peak_growth or (
            CudaPeakGrowth() if on_cuda else MeterGrowth(meter)
        )
        self._headroom_bytes = config.headroom_bytes
        self._growth: dict[str, deque[int]] = {}
        self._wake_bytes: dict[WakeCall, int] = {}
        self._released: dict[str, int] = {}
        self._measuring: str | None = None

    @property
    def can_measure(self) -> bool:
        return self._free_bytes is not None

    def free_bytes(self) -> int:
        assert self._free_bytes is not None
        return self._free_bytes()

    def headroom_bytes(self) -> int:
        if self._headroom_bytes is None:
            if torch.cuda.is_available():
                total = torch.cuda.mem_get_info()[1]
                self._headroom_bytes = max(_MIN_HEADROOM_BYTES, int(_HEADROOM_FRACTION * total))
            else:
                self._headroom_bytes = _MIN_HEADROOM_BYTES
        return self._headroom_bytes

    def start_phase(self, phase: str) -> None:
        """`phase`'s roles are awake: its growth is measured from here to `end_phase`."""
        self._peak_growth()
        self._measuring = phase

    def end_phase(self) -> None:
        if self._measuring is None:
            return
        growth = max(0, int(self._peak_growth()))
        self._growth.setdefault(self._measuring, deque(maxlen=_PEAK_WINDOW)).append(growth)
        self._measuring = None

    def growth_bytes(self, phase: str) -> int | None:
        runs = self._growth.get(phase)
        return max(runs) if runs else None

    def sleep_until_fits(
        self,
        need: int,
        others: Sequence[str],
        needed_next: Collection[str],
        size: Callable[[str], int],
        sleep: Callable[[str], None],
    ) -> list[str]:
        """Sleep roles of `others`, in `sleep_order`, until `need` bytes are free; returns the
        ones left awake."""
        kept = list(others)
        for name in sleep_order(others, needed_next, size):
            if need <= self.free_bytes():
                break
            sleep(name)
            kept.remove(name)
        return kept

    def record_wake(self, call: WakeCall, num_bytes: int) -> None:
        self._wake_bytes[call] = max(0, num_bytes)

    def record_sleep(self, role: str, num_bytes: int) -> None:
        """What `role` released, put to sleep from fully awake."""
        self._released[role] = max(0, num_bytes)

    def role_bytes(self, role: str) -> int | None:
        """Bytes `role` holds fully awake, as last measured."""
        if role in self._released:
            return self._released[role]
        woken = [n for (name, _), n in self._wake_bytes.items() if name == role]
        return sum(woken) if woken else None

    def need_bytes(
        self, phase: str, calls: Sequence[WakeCall], scales: dict[str, float]
    ) -> int | None:
        """Free bytes `phase` needs after its wake `calls`; None if anything is unmeasured.

        scales: a factor per role on its wake bytes (a memory share grown since they were
        measured).
        """
        growth = self.growth_bytes(phase)
        if growth is None:
            return None
        by_role: dict[str, list[WakeCall]] = {}
        for call in calls:
            by_role.setdefault(call[0], []).append(call)
        wake = 0
        for name, role_calls in by_role.items():
            known = [self._wake_bytes.get(call) for call in role_calls]
            if None in known:
                # A wake of these tags was never measured: the whole role, as its sleep released.
                role_wake = self._released.get(name)
                if role_wake is None:
                    return None
            else:
                role_wake = sum(n for n in known if n is not None)
            wake += int(role_wake * scales.get(name, 1.0))
        return wake + growth + self.headroom_bytes()
