"""Fit reports of a plan: whether each phase, and the host, can hold what the roles report.

Dataflow (read-only: nothing here sleeps or wakes a role):

    roles' memory_need() / host_need() reports + what the awake roles hold now
        + FitBooks (capacity, headroom, host memory readers)
        --> fit_report: a PhaseFit per phase (every other role asleep)
        --> host_fit_report: a HostFit for the roles some phase puts to sleep
        --> raise_unless_fits: MemoryFitError naming what to shrink

`Plan.fit_report`, `Plan.host_fit_report` and `Plan.check_fit` call these with the plan's state.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from yatt.placement._capabilities import MeasuresResidentBytes
from yatt.placement._fit import FitBooks
from yatt.placement._needs import (
    HostFit,
    HostNeed,
    MemoryFitError,
    MemoryNeed,
    PhaseFit,
    host_fit,
    phase_fit,
    role_host_need,
    role_need,
)
from yatt.placement._planner import WHOLE
from yatt.placement._roles import Role


def fit_report(
    roles: Mapping[str, Role],
    *,
    awake: Mapping[str, set[str]],
    phases: Mapping[str, Mapping[str, set[str]]],
    working: Mapping[str, Collection[str]],
    books: FitBooks,
) -> list[PhaseFit]:
    """Per phase, what it needs alone on the device (every other role asleep), from the
    roles' reports; phases with a role that gives no report are left out."""
    needs: dict[str, MemoryNeed] = {}
    for role_name, role in roles.items():
        need = role_need(role)
        if need is not None:
            needs[role_name] = need
    holding = 0  # what the roles hold now: their own count, else their report
    for role_name, role in roles.items():
        if not awake[role_name]:
            continue
        if isinstance(role, MeasuresResidentBytes):
            holding += role.resident_bytes()
        elif role_name in needs:
            holding += needs[role_name].resident_bytes(awake[role_name] - {WHOLE} or None)
        elif books.capacity_is_derived:
            # Its memory would count as not the roles': the capacity would come out short
            # and the check could refuse a phase that fits. Nothing to check by.
            return []
    capacity = books.capacity_bytes(holding)
    if capacity is None:
        return []
    fits = [
        phase_fit(
            phase,
            wanted,
            working[phase],
            needs,
            capacity_bytes=capacity,
            headroom_bytes=books.headroom_bytes(),
            whole_tag=WHOLE,
        )
        for phase, wanted in phases.items()
    ]
    return [fit for fit in fits if fit is not None]


def host_fit_report(
    roles: Mapping[str, Role],
    *,
    tags: Mapping[str, tuple[str, ...]],
    phases: Mapping[str, Mapping[str, set[str]]],
    books: FitBooks,
) -> HostFit | None:
    """What the roles that some phase puts to sleep hold in host memory while asleep, against
    the host's available memory (see `Plan.host_fit_report`)."""
    needs: dict[str, HostNeed] = {}
    for role_name, role in roles.items():
        sleeps = any(wanted.get(role_name) != set(tags[role_name]) for wanted in phases.values())
        need = role_host_need(role) if sleeps else None
        if need is not None:
            needs[role_name] = need
    if not needs:
        return None
    available = books.host_available_bytes()
    if available is None:
        return None
    return host_fit(needs, available_bytes=available, headroom_bytes=books.host_headroom_bytes)


def raise_unless_fits(report: list[PhaseFit], host: HostFit | None) -> None:
    """MemoryFitError listing every phase (and the host) that does not fit."""
    failing = [fit.explain() for fit in report if not fit.fits]
    if host is not None and not host.fits:
        failing.append(host.explain())
    if failing:
        raise MemoryFitError("\n".join(failing))
