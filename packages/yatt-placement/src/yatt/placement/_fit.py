"""offload="auto": a switch puts a role to sleep only when the next phase has no room beside it.

With offload="always" a switch into phase P sleeps every awake role P does not name. With
"auto" those roles stay awake as long as P fits next to them:

    need = bytes P's asleep roles (or tags) take to wake     measured at their last wake/sleep,
                                                          or as the role reports (the larger)
         + P's peak growth (activations, logits, caches)      measured the last times P ran, or
                                                          its roles' reported peaks (the larger)
         + headroom                                           default max(2 GiB, 5% of device)
    free = device free memory + bytes cached, unused, in torch's default pool (reusable)

Before that reading, a switch that will wake something releases torch's allocator cache
(`release_cache`, torch.cuda.empty_cache): a woken region (torch_memory_saver's resume, vLLM's
cumem pool) and an onload into a private pool need memory the driver can hand out, and the
previous phase's freed activations sitting in the default pool's cache are not that (issue 27:
a 1.5B trainer kept awake beside its cached activations made the engine's resume run out).

While need > free the switch sleeps one more role, in `_planner.sleep_order`, and reads free
again (the pure planner decides, `Plan` sleeps). A phase neither measured nor reported (the first
step), or a role whose wake bytes are unknown, makes the switch sleep them all as "always" does,
so the first step runs as "always" and measures safely. Roles that report their needs (`yatt.placement.MemoryNeed`) let even the first
step keep roles awake, and let the plan refuse, before the step, a phase that cannot fit at all.

Measurements (defaults on CUDA; `FitConfig` replaces the readers, e.g. by fakes on CPU):
- wake bytes: the plan's meter around each wake call, per (role, tags); before a role's first
  such wake, what its last sleep from fully awake released.
  A role that sleeps whole forgets its per-tag wake measurements (the optimizer's state, made
  lazily in the first step, is not what its first wake measured); until its next wake, what
  its sleep released counts.
- peak growth: from the end of P's switch to the start of the next switch, torch's peak allocated
  (or reserved, whichever grew more) over the higher of its levels at the start and the end
  (what stays allocated at the end, e.g. optimizer state made lazily, belongs to a role's bytes
  from then on), plus the device growth outside torch (non-torch allocations) that mem_get_info
  saw. The largest of P's last `_PEAK_WINDOW` runs counts, so one short batch does not lower
  the guard. The CUDA reader resets torch.cuda's peak memory stats at every switch.
- the memory timeline's peak of P (`placement/<P>/peak_bytes`): the device's used memory once
  P's roles are awake + how far the device's use rose above it (`PeakGrowth.device`). Not the
  allocated growth above: torch serves a phase's new tensors first from blocks it already
  caches, and those are in the device's used memory already (a trainer's activations reuse the
  previous step's cache: counted twice, a 1.5B+1.5B train phase showed 193 GiB on a 141 GiB
  H200). The device's rise is torch's reserved peak over its start plus the growth outside
  torch, at most what was free at the start, so the peak never exceeds the device.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from yatt.placement._capabilities import MeasuresResidentBytes
from yatt.placement._capture_guard import empty_cache
from yatt.placement._needs import _DEFAULT_HOST_HEADROOM_BYTES, read_host_available_bytes
from yatt.placement._planner import WakeCall

logger = logging.getLogger(__name__)

OffloadMode = Literal["always", "auto"]
OFFLOAD_MODES = ("always", "auto")
_PEAK_WINDOW = 4
_MIN_HEADROOM_BYTES = 2 << 30
_HEADROOM_FRACTION = 0.05


@dataclass(frozen=True)
class PeakGrowth:
    """One phase run's growth, read two ways (a `FitConfig.peak_growth` may return this).

    in_use: what the phase's new tensors took at their highest, above the higher of the
        window's start and end levels: what offload="auto" plans by (its free bytes count
        torch's cached blocks as reusable, so cached blocks must not be subtracted here).
    device: how far the device's used memory rose above its level at the start: the memory
        timeline's peak is that level + this (cached blocks reused are not new memory).
    """

    in_use: int
    device: int


def split_growth(reading: int | PeakGrowth) -> PeakGrowth:
    """A `peak_growth` reading as a PeakGrowth: a plain int is both (a meter without a cache)."""
    if isinstance(reading, PeakGrowth):
        return PeakGrowth(in_use=max(0, int(reading.in_use)), device=max(0, int(reading.device)))
    return PeakGrowth(in_use=max(0, int(reading)), device=max(0, int(reading)))


@dataclass(kw_only=True)
class FitConfig:
    """How offload="auto" reads memory; a field left None takes the CUDA default."""

    # Bytes this process can still allocate now. Default on CUDA: mem_get_info's free bytes plus
    # those cached unused in torch's default pool. Without CUDA and without this, "auto" acts
    # as "always".
    free_bytes: Callable[[], int] | None = None
    # Bytes the memory in use rose, at its highest, above its level at the previous call, since
    # that call; each call starts a new window. Read at the end of a switch and at the next one.
    # An int, or a PeakGrowth when what auto plans by and what the device saw differ (a caching
    # allocator). Default on CUDA: CudaPeakGrowth; else the meter's growth.
    peak_growth: Callable[[], int | PeakGrowth] | None = None
    # Room kept free beyond the estimate (fragmentation, a longer batch than the measured one).
    # Default: max(2 GiB, 5% of the device's memory); 2 GiB without CUDA.
    headroom_bytes: int | None = None
    # Called before a switch wakes anything, so cached free blocks go back to the driver.
    # Default on CUDA: torch.cuda.empty_cache; else nothing.
    release_cache: Callable[[], None] | None = None
    # Bytes the roles may hold together: the device's memory less what is not theirs (CUDA
    # context, other processes). Default on CUDA: total - (used now - what the roles hold
    # now), read at the first switch. Only the check of reported needs uses it.
    capacity_bytes: Callable[[], int] | None = None
    # Host bytes the roles may pin while asleep: read once, at the plan's first switch, before
    # any role sleeps. Default: the kernel's MemAvailable (/proc/meminfo); None where that
    # cannot be read (the host check is then skipped).
    host_available_bytes: Callable[[], int | None] | None = None
    # Host room kept beyond the roles' reports (batches, tokenizer, Python). Default: 4 GiB.
    host_headroom_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("headroom_bytes", "host_headroom_bytes"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"FitConfig.{name}={value} must be >= 0, e.g. 2 << 30")


def make_fit_books(offload: object, fit: FitConfig | None, meter: Callable[[], int]) -> FitBooks:
    """The readings of a plan: what offload="auto" decides by, and the memory timeline of
    either mode (a plan with offload="always" measures too; it only never keeps roles awake)."""
    if offload not in OFFLOAD_MODES:
        raise ValueError(
            f"offload={offload!r} is not known; use 'always' (a switch sleeps every role the "
            "phase does not name) or 'auto' (only when the phase would not fit beside them)"
        )
    books = FitBooks(fit or FitConfig(), meter)
    if offload == "auto" and not books.can_measure:
        logger.info(
            "offload='auto' without CUDA needs FitConfig(free_bytes=...); without it every "
            "switch sleeps the roles its phase does not name, as offload='always' does"
        )
    return books


def make_default_meter(roles: Iterable[object]) -> Callable[[], int]:
    """A plan's default meter: the device's used memory (other processes count) with CUDA,
    else the sum of `resident_bytes()` over the roles that have it."""
    if torch.cuda.is_available():
        return read_device_used_bytes
    measured = [role for role in roles if isinstance(role, MeasuresResidentBytes)]
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


def release_cuda_cache() -> None:
    """The default `FitConfig.release_cache` on CUDA."""
    empty_cache()  # never inside another thread's CUDA-graph capture (_capture_guard)


@dataclass(frozen=True)
class AllocatorStats:
    """What CudaPeakGrowth reads at each window's edge (bytes, this process's device)."""

    allocated: int  # torch: in tensors now
    reserved: int  # torch: held from the driver now (tensors + cached blocks)
    peak_allocated: int  # since the last reset
    peak_reserved: int
    device_used: int  # the device's used memory (every process, every allocator)
    device_total: int


def read_cuda_allocator_stats() -> AllocatorStats:
    device = torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(device)
    return AllocatorStats(
        allocated=torch.cuda.memory_allocated(device),
        reserved=torch.cuda.memory_reserved(device),
        peak_allocated=torch.cuda.max_memory_allocated(device),
        peak_reserved=torch.cuda.max_memory_reserved(device),
        device_used=total - free,
        device_total=total,
    )


def reset_cuda_peaks() -> None:
    torch.cuda.reset_peak_memory_stats(torch.cuda.current_device())


class CudaPeakGrowth:
    """The default `FitConfig.peak_growth` on CUDA (see the module doc): a PeakGrowth per window.

    read/reset: the allocator's readers (torch.cuda's by default; fakes in tests)."""

    def __init__(
        self,
        read: Callable[[], AllocatorStats] = read_cuda_allocator_stats,
        reset: Callable[[], None] = reset_cuda_peaks,
    ) -> None:
        self._read = read
        self._reset = reset
        self._start: AllocatorStats | None = None

    def __call__(self) -> PeakGrowth:
        now = self._read()
        growth = PeakGrowth(in_use=0, device=0)
        if (start := self._start) is not None:
            # Above the higher level: what stayed allocated is a role's own from now on.
            in_torch = max(
                now.peak_allocated - max(start.allocated, now.allocated),
                now.peak_reserved - max(start.reserved, now.reserved),
            )
            # What the device gained beyond this process's torch reservations.
            outside = max(
                0, (now.device_used - start.device_used) - (now.reserved - start.reserved)
            )
            # The device's rise: new reservations only (tensors placed in cached blocks were
            # in device_used already), never beyond what was free at the start.
            rise = max(0, now.peak_reserved - start.reserved) + outside
            growth = PeakGrowth(
                in_use=max(0, in_torch) + outside,
                device=min(rise, max(0, start.device_total - start.device_used)),
            )
        self._reset()
        # Read after the reset: the next window's peaks start at the levels read here.
        self._start = self._read()
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


class FitBooks:
    """What offload="auto" knows: wake bytes per role, peak growth per phase, free memory."""

    def __init__(self, config: FitConfig, meter: Callable[[], int]) -> None:
        on_cuda = torch.cuda.is_available()
        self._free_bytes = config.free_bytes or (read_cuda_free_bytes if on_cuda else None)
        self._peak_growth = config.peak_growth or (
            CudaPeakGrowth() if on_cuda else MeterGrowth(meter)
        )
        self._headroom_bytes = config.headroom_bytes
        self._release_cache = config.release_cache or (release_cuda_cache if on_cuda else None)
        self._capacity_bytes = config.capacity_bytes
        self.host_available_bytes = config.host_available_bytes or read_host_available_bytes
        self.host_headroom_bytes = (
            _DEFAULT_HOST_HEADROOM_BYTES
            if config.host_headroom_bytes is None
            else config.host_headroom_bytes
        )
        self._growth: dict[str, deque[int]] = {}  # PeakGrowth.in_use of P's recent runs
        self._device_growth: dict[str, int] = {}  # PeakGrowth.device of P's latest run
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

    def release_cache(self) -> None:
        if self._release_cache is not None:
            self._release_cache()

    @property
    def capacity_is_derived(self) -> bool:
        """Whether capacity_bytes subtracts what the roles hold from the device's use."""
        return self._capacity_bytes is None

    def capacity_bytes(self, roles_hold: int) -> int | None:
        """Bytes the roles may hold together (see FitConfig.capacity_bytes); None if unknown.

        roles_hold: what the roles hold now (the CUDA default subtracts it from the device's
        used memory to find what is not theirs). Blocks cached unused in torch's default pool
        count as free (the free-bytes reader's view): they are no role's and no other
        process's, and a 7B policy's models built on the device left enough of them to refuse
        a phase that fits (bench/results/lora_nvidia_h200.md at 941d160)."""
        if self._capacity_bytes is not None:
            return self._capacity_bytes()
        if not torch.cuda.is_available():
            return None
        free, total = torch.cuda.mem_get_info()
        if self._free_bytes is not None:
            free = max(free, self._free_bytes())
        return total - max(0, (total - free) - roles_hold)

    def latest_device_growth_bytes(self, phase: str) -> int | None:
        """How far the device's use rose in `phase`'s latest run (its timeline peak's part)."""
        return self._device_growth.get(phase)

    def start_phase(self, phase: str) -> None:
        """`phase`'s roles are awake: its growth is measured from here to `end_phase`."""
        self._peak_growth()
        self._measuring = phase

    def end_phase(self) -> None:
        if self._measuring is None:
            return
        growth = split_growth(self._peak_growth())
        self._growth.setdefault(self._measuring, deque(maxlen=_PEAK_WINDOW)).append(growth.in_use)
        self._device_growth[self._measuring] = growth.device
        self._measuring = None

    def growth_bytes(self, phase: str) -> int | None:
        runs = self._growth.get(phase)
        return max(runs) if runs else None

    def record_wake(self, call: WakeCall, num_bytes: int) -> None:
        self._wake_bytes[call] = max(0, num_bytes)

    def record_sleep(self, role: str, num_bytes: int) -> None:
        """What `role` released, put to sleep from fully awake; its wake measurements are stale
        from here (it may have grown since: optimizer state made in its first step)."""
        self._released[role] = max(0, num_bytes)
        for call in [call for call in self._wake_bytes if call[0] == role]:
            del self._wake_bytes[call]

    def role_bytes(self, role: str) -> int | None:
        """Bytes `role` holds fully awake, as last measured."""
        if role in self._released:
            return self._released[role]
        woken = [n for (name, _), n in self._wake_bytes.items() if name == role]
        return sum(woken) if woken else None

    def need_bytes(
        self,
        phase: str,
        calls: Sequence[WakeCall],
        scales: dict[str, float],
        *,
        reported_wake: Mapping[WakeCall, int] | None = None,
        reported_peak: int | None = None,
    ) -> int | None:
        """Free bytes `phase` needs after its wake `calls`; None if anything is unknown.

        scales: a factor per role on its measured wake bytes (a memory share grown since they
        were measured). reported_wake: per call, the bytes its role reports for it (already at
        its current share); reported_peak: the peak the phase's working roles report. Where
        both a measurement and a report exist, the larger counts.
        """
        reported_wake = reported_wake or {}
        growth = self.growth_bytes(phase)
        if reported_peak is not None:
            growth = max(growth or 0, reported_peak)
        if growth is None:
            return None
        by_role: dict[str, list[WakeCall]] = {}
        for call in calls:
            by_role.setdefault(call[0], []).append(call)
        wake = 0
        for name, role_calls in by_role.items():
            known = [self._wake_bytes.get(call) for call in role_calls]
            measured: int | None
            if None in known:
                # A wake of these tags was never measured: the whole role, as its sleep released.
                measured = self._released.get(name)
            else:
                measured = sum(n for n in known if n is not None)
            reported = [reported_wake.get(call) for call in role_calls]
            report = None if None in reported else sum(n for n in reported if n is not None)
            if measured is None and report is None:
                return None
            scaled = int((measured or 0) * scales.get(name, 1.0))
            wake += max(scaled, report or 0)
        return wake + growth + self.headroom_bytes()
