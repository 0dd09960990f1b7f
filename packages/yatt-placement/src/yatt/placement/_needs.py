"""What roles say they need on the device, and the check that a plan's every phase can fit.

A role may report its memory before anything is measured (`memory_need()`, optional):

    MemoryNeed(
        resident={"weights": 28 << 30, "optimizer": 56 << 30},   # per memory tag, awake
        peak={"activations": 9 << 30, "gradients": 28 << 30},    # while it works, on top
        settings={"activations": "TorchPolicyConfig.max_tokens_per_microbatch=16384 (lower "
                  "it) or gradient_checkpointing=True"},
    )

`resident` is what waking each tag allocates (an engine: its weights, its KV pool and its
graphs; a trainer: parameters and gradients' home, optimizer state). `peak` is what the role's
work adds above that at its highest, in the phases where it works (a trainer: activations,
gradients, the optimizer step's temporaries; an engine with a fixed pool: nothing). `settings`
name, per part (a tag or a peak part), the setting that shrinks it: the error below lists them.

`check_phases` adds, per phase, the resident bytes of the tags the phase wakes and the peaks of
the roles working in it, plus the headroom, and compares with the device's capacity for the
roles (every other role asleep: the best any placement can do). A phase that cannot fit raises
`MemoryFitError` before the step, naming its largest parts and their settings.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

_GIB = float(1 << 30)


def _fmt(num_bytes: int) -> str:
    if num_bytes >= 1 << 30:
        return f"{num_bytes / _GIB:.1f} GiB"
    if num_bytes >= 1 << 20:
        return f"{num_bytes / (1 << 20):.1f} MiB"
    return f"{num_bytes} bytes"


@dataclass(kw_only=True, frozen=True)
class MemoryNeed:
    """Bytes a role needs on its device: per memory tag awake, and its work's peak on top."""

    # Memory tag -> bytes waking it allocates ("*" for a role without memory_tags).
    resident: Mapping[str, int]
    # Part name -> bytes the role's work allocates at its peak, above `resident`.
    peak: Mapping[str, int] = field(default_factory=dict)
    # Part name (a tag or a peak part) -> the setting that shrinks it, for error messages.
    settings: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for what, parts in (("resident", self.resident), ("peak", self.peak)):
            for name, num_bytes in parts.items():
                if not isinstance(num_bytes, int) or num_bytes < 0:
                    raise ValueError(
                        f"MemoryNeed.{what}[{name!r}]={num_bytes!r}: bytes, an int >= 0"
                    )

    @property
    def peak_bytes(self) -> int:
        return sum(self.peak.values())

    def resident_bytes(self, tags: object = None) -> int:
        """Bytes of `tags` (default: every tag)."""
        if tags is None:
            return sum(self.resident.values())
        return sum(self.resident.get(tag, 0) for tag in tags)  # type: ignore[union-attr]


@runtime_checkable
class ReportsMemoryNeed(Protocol):
    """A role that says what its phases need on the device (None: unknown)."""

    def memory_need(self) -> MemoryNeed | None: ...


def role_need(role: object) -> MemoryNeed | None:
    """The role's report (`memory_need()`), or None if it gives none."""
    if not isinstance(role, ReportsMemoryNeed):
        return None
    need = role.memory_need()
    if need is not None and not isinstance(need, MemoryNeed):
        raise TypeError(
            f"{type(role).__name__}.memory_need() returned a {type(need).__name__}; "
            "return a yatt.placement.MemoryNeed or None"
        )
    return need


class MemoryFitError(ValueError):
    """A phase of the plan cannot fit on the device even with every other role asleep."""


@dataclass(kw_only=True, frozen=True)
class PhaseFit:
    """One phase's requirement alone on the device, from the roles' reports."""

    phase: str
    need_bytes: int  # parts + headroom
    capacity_bytes: int
    headroom_bytes: int
    parts: Mapping[str, int]  # "role tag" / "role part" -> bytes
    settings: Mapping[str, str]  # same keys -> setting, where the role named one

    @property
    def fits(self) -> bool:
        return self.need_bytes <= self.capacity_bytes

    def explain(self) -> str:
        """A message that names what to change, largest parts first."""
        over = self.need_bytes - self.capacity_bytes
        lines = [
            f"phase {self.phase!r} needs {_fmt(self.need_bytes)} with every other role asleep "
            f"(headroom {_fmt(self.headroom_bytes)} included), but the device has "
            f"{_fmt(self.capacity_bytes)} for the roles: {_fmt(over)} too many. Largest parts:"
        ]
        for name, num_bytes in sorted(self.parts.items(), key=lambda kv: -kv[1])[:6]:
            setting = self.settings.get(name)
            how = f"; change {setting}" if setting else ""
            lines.append(f"  {name}: {_fmt(num_bytes)}{how}")
        lines.append(
            "Shrink one of these (micro-batch tokens, activation checkpointing, an engine's KV "
            "share, a smaller judge), or give the roles their own GPUs."
        )
        return "\n".join(lines)


def phase_fit(
    phase: str,
    wanted: Mapping[str, set[str]],
    working: set[str],
    needs: Mapping[str, MemoryNeed],
    *,
    capacity_bytes: int,
    headroom_bytes: int,
    whole_tag: str,
) -> PhaseFit | None:
    """`phase`'s requirement alone on the device; None when a role it wakes gives no report.

    wanted: role -> tags the phase wakes; working: the roles whose peak counts in this phase.
    """
    if any(name not in needs for name in wanted):
        return None
    parts: dict[str, int] = {}
    settings: dict[str, str] = {}
    for name, tags in wanted.items():
        need = needs[name]
        for tag in need.resident if whole_tag in tags else tags:
            key = f"{name} {tag}"
            parts[key] = need.resident.get(tag, 0)
            if tag in need.settings:
                settings[key] = need.settings[tag]
        if name in working:
            for part, num_bytes in need.peak.items():
                key = f"{name} {part}"
                parts[key] = num_bytes
                if part in need.settings:
                    settings[key] = need.settings[part]
    return PhaseFit(
        phase=phase,
        need_bytes=sum(parts.values()) + headroom_bytes,
        capacity_bytes=capacity_bytes,
        headroom_bytes=headroom_bytes,
        parts=parts,
        settings=settings,
    )


# -- host memory -----------------------------------------------------------------------------
# A role asleep keeps what it must not lose in host memory: an offloaded trainer's parameters
# and optimizer state (pinned), an engine's weights in a region with CPU backup (torch_memory_
# saver's pinned shadow, kept from one pause to the next by default). Pinned pages cannot be
# swapped: a plan whose roles pin more than the host has left fails at a pause (cudaHostAlloc
# out of memory) or brings the kernel's OOM killer, long after the models loaded. Roles report
# it with `host_need()`; the plan checks the sum before anything sleeps.

_DEFAULT_HOST_HEADROOM_BYTES = 4 << 30
_MEMINFO = "/proc/meminfo"


@dataclass(kw_only=True, frozen=True)
class HostNeed:
    """Host bytes a role holds while asleep (and, retained, from its first sleep on), per part."""

    # Part name ("weights", "optimizer", "weights backup") -> bytes.
    parts: Mapping[str, int]
    # Part name -> the setting that shrinks it, for error messages.
    settings: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, num_bytes in self.parts.items():
            if not isinstance(num_bytes, int) or num_bytes < 0:
                raise ValueError(f"HostNeed.parts[{name!r}]={num_bytes!r}: bytes, an int >= 0")

    @property
    def total_bytes(self) -> int:
        return sum(self.parts.values())


@runtime_checkable
class ReportsHostNeed(Protocol):
    """A role that says what its offload needs in host memory (None: unknown)."""

    def host_need(self) -> HostNeed | None: ...


def role_host_need(role: object) -> HostNeed | None:
    """The role's report (`host_need()`), or None if it gives none."""
    if not isinstance(role, ReportsHostNeed):
        return None
    need = role.host_need()
    if need is not None and not isinstance(need, HostNeed):
        raise TypeError(
            f"{type(role).__name__}.host_need() returned a {type(need).__name__}; "
            "return a yatt.placement.HostNeed or None"
        )
    return need


HOST_MEMORY_ENV = "YATT_HOST_MEMORY_BYTES"


def read_host_available_bytes(path: str = _MEMINFO) -> int | None:
    """Host bytes that can still be allocated: the kernel's MemAvailable; None where there is no
    /proc/meminfo (not Linux).

    Where the environment sets YATT_HOST_MEMORY_BYTES (the machine's memory limit), that limit
    less the memory in use (MemTotal - MemAvailable): for virtual machines whose MemTotal
    starts low and grows as memory is used (memory hotplug), where MemAvailable alone would
    refuse a plan that fits.
    """
    fields: dict[str, int] = {}
    try:
        with open(path) as meminfo:
            for line in meminfo:
                name, _, rest = line.partition(":")
                if name in ("MemTotal", "MemAvailable"):
                    fields[name] = int(rest.split()[0]) * 1024  # kB
    except OSError:
        return None
    if "MemAvailable" not in fields:
        return None
    limit = os.environ.get(HOST_MEMORY_ENV)
    if not limit:
        return fields["MemAvailable"]
    try:
        limit_bytes = int(limit)
    except ValueError:
        raise ValueError(
            f"{HOST_MEMORY_ENV}={limit!r}: the host's memory limit in bytes, e.g. "
            f"{128 << 30} for 128 GiB"
        ) from None
    in_use = fields.get("MemTotal", 0) - fields["MemAvailable"]
    return max(0, limit_bytes - in_use)


@dataclass(kw_only=True, frozen=True)
class HostFit:
    """What the roles that sleep hold in host memory together, against what the host has."""

    need_bytes: int  # parts + headroom
    available_bytes: int
    headroom_bytes: int
    parts: Mapping[str, int]  # "role part" -> bytes
    settings: Mapping[str, str]

    @property
    def fits(self) -> bool:
        return self.need_bytes <= self.available_bytes

    def explain(self) -> str:
        over = self.need_bytes - self.available_bytes
        lines = [
            f"host memory: the roles that sleep hold {_fmt(self.need_bytes)} in host RAM while "
            f"asleep (headroom {_fmt(self.headroom_bytes)} included), but the host has "
            f"{_fmt(self.available_bytes)} available (MemAvailable, or {HOST_MEMORY_ENV} less "
            f"what is in use): {_fmt(over)} too many. "
            "Largest parts:"
        ]
        for name, num_bytes in sorted(self.parts.items(), key=lambda kv: -kv[1])[:6]:
            setting = self.settings.get(name)
            how = f"; change {setting}" if setting else ""
            lines.append(f"  {name}: {_fmt(num_bytes)}{how}")
        lines.append(
            "Shrink one of these, free host memory (other processes), or use a host with more "
            "RAM (or more GPUs: FSDP2 shards what each rank offloads)."
        )
        return "\n".join(lines)


def host_fit(
    needs: Mapping[str, HostNeed], *, available_bytes: int, headroom_bytes: int
) -> HostFit:
    """The roles' host needs (role -> report) summed, with the headroom, against the host."""
    parts: dict[str, int] = {}
    settings: dict[str, str] = {}
    for name, need in needs.items():
        for part, num_bytes in need.parts.items():
            key = f"{name} {part}"
            parts[key] = num_bytes
            if part in need.settings:
                settings[key] = need.settings[part]
    return HostFit(
        need_bytes=sum(parts.values()) + headroom_bytes,
        available_bytes=available_bytes,
        headroom_bytes=headroom_bytes,
        parts=parts,
        settings=settings,
    )
