"""What a plan records of each switch, and the flat metrics it reports."""

from __future__ import annotations

from dataclasses import dataclass


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


def phase_metrics(
    phase: str, record: PhaseRecord | None, num_switches: int, peak_growth_bytes: int | None
) -> dict[str, float]:
    """`placement/<phase>/...` floats for the latest switch into `phase` (zeros before any)."""
    prefix = f"placement/{phase}/"
    return {
        prefix + "switch_s": record.switch_s if record else 0.0,
        prefix + "sleep_s": record.sleep_s if record else 0.0,
        prefix + "wake_s": record.wake_s if record else 0.0,
        prefix + "released_bytes": float(record.released_bytes if record else 0),
        prefix + "woken_bytes": float(record.woken_bytes if record else 0),
        prefix + "resident_bytes": float(record.resident_bytes if record else 0),
        prefix + "num_switches": float(num_switches),
        prefix + "kept_awake": float(len(record.kept_awake) if record else 0),
        prefix + "kept_awake_bytes": float(record.kept_awake_bytes if record else 0),
        # Largest growth of the phase's recent runs over its start, as offload="auto" measured it.
        prefix + "peak_growth_bytes": float(peak_growth_bytes or 0),
    }
