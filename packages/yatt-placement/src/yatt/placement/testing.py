"""Fakes for tests of plans (yours or ours) without a model or a GPU.

`RecordingRole` holds fixed bytes per memory tag and logs every sleep and wake; given `peak`, it
also reports its needs (`memory_need()`), and given `host`, what it holds in host memory while
asleep (`host_need()`). `FakeDevice` is a device of fixed capacity with a
caching allocator like torch's: a phase's transient allocations (`run`) stay cached after they
are freed, reusable by later transient allocations but not by a role's wake, which needs memory
the device can hand out; a wake or a run that does not fit raises `FakeOutOfMemory`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from yatt.placement._fit import FitConfig
from yatt.placement._needs import HostNeed, MemoryNeed

__all__ = ["FakeDevice", "FakeOutOfMemory", "RecordingRole"]


class FakeOutOfMemory(RuntimeError):
    """A wake or a phase's allocation that the FakeDevice could not hold."""


class RecordingRole:
    """Fixed bytes per memory tag; every sleep and wake goes into a shared `log` list.

    Entries: `(name, "sleep")` and `(name, "wake", tags)`. `fractions` lists the memory
    fractions the plan set, and `kv_fraction` the one in force when the KV cache last woke.
    peak: bytes per part its work adds while its phase runs; given (even empty), the role
    reports `memory_need()` (its sizes, this peak and `settings`). device: a FakeDevice whose
    free memory each wake must fit in. host: bytes per part it holds in host memory asleep;
    given, it reports `host_need()` (with `settings`).
    """

    def __init__(
        self,
        name: str,
        log: list,
        sizes: dict[str, int],
        *,
        peak: Mapping[str, int] | None = None,
        settings: Mapping[str, str] | None = None,
        device: FakeDevice | None = None,
        host: Mapping[str, int] | None = None,
    ) -> None:
        self.name, self.log, self.sizes = name, log, sizes
        self.host = None if host is None else dict(host)
        self.memory_tags: tuple[str, ...] = tuple(sizes)
        self.awake = set(self.memory_tags)
        self.fractions: list[float] = []
        self.kv_fraction: float | None = None
        self.peak = None if peak is None else dict(peak)
        self.settings = dict(settings or {})
        self.device = device
        if device is not None:
            device.roles.append(self)

    @property
    def fraction(self) -> float | None:
        """The memory fraction set last (None: never set)."""
        return self.fractions[-1] if self.fractions else None

    def sleep(self) -> None:
        self.log.append((self.name, "sleep"))
        self.awake.clear()

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        tags = tuple(self.memory_tags if tags is None else tags)
        if self.device is not None:
            self.device.allocate_wake(sum(self.sizes[t] for t in tags if t not in self.awake))
        self.log.append((self.name, "wake", tags))
        self.awake |= set(tags)
        if "kv_cache" in tags:
            self.kv_fraction = self.fraction

    def resident_bytes(self) -> int:
        return sum(self.sizes[tag] for tag in self.awake)

    def set_memory_fraction(self, fraction: float) -> None:
        self.fractions.append(fraction)

    def memory_need(self) -> MemoryNeed | None:
        if self.peak is None:
            return None
        return MemoryNeed(resident=dict(self.sizes), peak=self.peak, settings=self.settings)

    def host_need(self) -> HostNeed | None:
        if self.host is None:
            return None
        return HostNeed(parts=self.host, settings=self.settings)


class FakeDevice:
    """`capacity` bytes shared by its roles' memory and a caching allocator's blocks.

    roles: the RecordingRoles on it (a role made with device=this adds itself). `cached`: bytes
    freed by phases and kept by the allocator, reusable by `run` only; `empty_cache` returns
    them. `fit()` gives a FitConfig reading this device.
    """

    def __init__(self, capacity: int, roles: Sequence[RecordingRole] = ()) -> None:
        self.capacity = capacity
        self.roles: list[RecordingRole] = list(roles)
        self.cached = 0
        self.num_empty_cache = 0
        self._level: int | None = None
        self._peak = 0

    def used(self) -> int:
        """Bytes the roles hold."""
        return sum(role.resident_bytes() for role in self.roles)

    def device_free(self) -> int:
        """Bytes the device can hand out now (a wake needs these)."""
        return self.capacity - self.used() - self.cached

    def free_bytes(self) -> int:
        """What a phase's own allocations can use: device free plus the allocator's cache (what
        the CUDA reader of FitConfig.free_bytes reports)."""
        return self.device_free() + self.cached

    def allocate_wake(self, num_bytes: int) -> None:
        if num_bytes > self.device_free():
            raise FakeOutOfMemory(
                f"wake of {num_bytes} bytes with {self.device_free()} free on the device "
                f"({self.cached} cached by the allocator)"
            )

    def run(self, num_bytes: int) -> None:
        """The running phase allocates `num_bytes` at its peak, then frees them (cached)."""
        if num_bytes > self.free_bytes():
            raise FakeOutOfMemory(f"phase peak {num_bytes} bytes with {self.free_bytes()} free")
        self._peak = max(self._peak, self.used() + num_bytes)
        self.cached = max(self.cached, num_bytes)

    def empty_cache(self) -> None:
        self.num_empty_cache += 1
        self.cached = 0

    def peak_growth(self) -> int:
        """FitConfig.peak_growth: the peak over the higher of the window's start and end."""
        used = self.used()
        growth = 0 if self._level is None else max(0, self._peak - max(self._level, used))
        self._level, self._peak = used, used
        return growth

    def fit(self, headroom: int = 10) -> FitConfig:
        return FitConfig(
            free_bytes=self.free_bytes,
            peak_growth=self.peak_growth,
            headroom_bytes=headroom,
            release_cache=self.empty_cache,
            capacity_bytes=lambda: self.capacity,
        )
