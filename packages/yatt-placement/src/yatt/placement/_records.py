"""What a plan records of each switch, and the flat metrics it reports."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(kw_only=True, frozen=True)
class PhaseRecord:
    """One switch into a phase. Bytes are device-wide on CUDA, the roles' sum on CPU."""

    phase: str
    switch_s: float  # sleep_s + wake_s + the readings in between
    sleep_s: float
    wake_s: float
    released_bytes: int  # freed by the roles put to sleep
    woken_bytes: int  # taken by the roles woken
    resident_bytes: int  # held once the phase's roles are awake
    kept_awake: tuple[str, ...] = ()  # roles the phase does not name, left awake (offload="auto")
    kept_awake_bytes: int = 0  # what they hold, as last measured
    # offload="auto": what the phase needed free (wake + peak + headroom) and what was free when
    # the switch decided (after the sleeps it chose); 0 where it did not decide by them.
    need_bytes: int = 0
    free_bytes: int = 0
    # The memory timeline: per role, bytes on the device once the phase's roles are awake
    # (0 asleep), and bytes it would take to wake (as reported or last measured; 0 awake).
    role_resident_bytes: Mapping[str, int] = field(default_factory=dict)
    role_asleep_bytes: Mapping[str, int] = field(default_factory=dict)


def phase_metrics(
    phase: str,
    record: PhaseRecord | None,
    num_switches: int,
    peak_growth_bytes: int | None,
    *,
    roles: Sequence[str] = (),
    latest_device_growth_bytes: int | None = None,
) -> dict[str, float]:
    """`placement/<phase>/...` floats for the latest switch into `phase` (zeros before any).

    roles: the plan's role names (the per-role keys are fixed by them).
    latest_device_growth_bytes: how far the device's use rose in the phase's latest run
    (PeakGrowth.device), for its peak."""
    prefix = f"placement/{phase}/"
    resident = float(record.resident_bytes if record else 0)
    out = {
        prefix + "switch_s": record.switch_s if record else 0.0,
        prefix + "sleep_s": record.sleep_s if record else 0.0,
        prefix + "wake_s": record.wake_s if record else 0.0,
        prefix + "released_bytes": float(record.released_bytes if record else 0),
        prefix + "woken_bytes": float(record.woken_bytes if record else 0),
        prefix + "resident_bytes": resident,
        prefix + "num_switches": float(num_switches),
        prefix + "kept_awake": float(len(record.kept_awake) if record else 0),
        prefix + "kept_awake_bytes": float(record.kept_awake_bytes if record else 0),
        # Largest growth of the phase's recent runs over its start, as offload="auto" measured it.
        prefix + "peak_growth_bytes": float(peak_growth_bytes or 0),
        # The phase's highest use in its latest run: resident after the switch + the device's
        # rise (not the allocated growth: tensors placed in cached blocks are resident already).
        prefix + "peak_bytes": resident + float(latest_device_growth_bytes or 0) if record else 0.0,
        prefix + "need_bytes": float(record.need_bytes if record else 0),
        prefix + "free_bytes": float(record.free_bytes if record else 0),
    }
    for role in roles:
        held = record.role_resident_bytes.get(role, 0) if record else 0
        away = record.role_asleep_bytes.get(role, 0) if record else 0
        out[f"{prefix}role/{role}/resident_bytes"] = float(held)
        out[f"{prefix}role/{role}/asleep_bytes"] = float(away)
        is_awake = record is not None and role not in record.role_asleep_bytes
        out[f"{prefix}role/{role}/is_awake"] = 1.0 if is_awake else 0.0
    return out
