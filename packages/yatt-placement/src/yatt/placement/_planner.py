"""The pure planner of a phase switch: a snapshot of the device in, the sleeps and wakes out.

Dataflow of one switch (`Plan.switch_to` executes, this module decides, nothing here touches a
role, torch or a clock):

    Plan state (awake tags, measured bytes, free memory) --> SwitchSnapshot
    SwitchSnapshot --> plan_switch --> SwitchDecision(sleep, wake, kept)
    Plan sleeps `decision.sleep`, reads a new snapshot, and asks again until `sleep` is
    empty (each sleep frees what the device says, not what the books expected); then it
    wakes `decision.wake`, stage by stage.

The rule (see yatt.placement._plan and ._fit for why):
- need unknown (offload="always", or nothing measured or reported): every awake role the phase
  does not name sleeps, at once;
- else the roles whose memory share moved (and that cannot resize awake) sleep first, then one
  more role at a time, in `sleep_order`, while the phase needs more bytes than are free;
- wake: each wanted role's missing tags, grouped by the wake stages (weights before kv_cache,
  then the rest); a role without memory tags wakes whole in the first stage.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

WakeCall = tuple[str, tuple[str, ...]]  # (role, tags) as the plan passes them to wake_up
WHOLE = "*"  # the one tag of a role without memory_tags


@dataclass(frozen=True, kw_only=True)
class SwitchSnapshot:
    """What the planner sees at one moment of a switch into `phase`."""

    phase: str
    # Every role of the plan, in the plan's order, with the tags it declares (in order).
    tags: Mapping[str, tuple[str, ...]]
    # Per role, the tags awake now (empty: asleep).
    awake: Mapping[str, Collection[str]]
    # The phase's roles and the tags each must have awake.
    wanted: Mapping[str, Collection[str]]
    wake_stages: Sequence[Sequence[str]] = (("weights",), ("kv_cache",))
    # Free bytes the phase needs after its wakes (wake + peak + headroom); None: sleep all others.
    need_bytes: int | None = None
    # Device bytes free now; read only when need_bytes is known.
    free_bytes: int | None = None
    # Bytes each awake role holds (orders the sleeps: largest first).
    role_bytes: Mapping[str, int] = field(default_factory=dict)
    # Roles whose memory share moved since their KV cache was sized, and that apply it only
    # when woken: they sleep first.
    moved: Collection[str] = ()
    # Roles the phase after this one (as last time) needs: they sleep last.
    needed_next: Collection[str] = ()


@dataclass(frozen=True, kw_only=True)
class SwitchDecision:
    """What to do now: sleep `sleep` (then ask again with a new snapshot), or, when `sleep` is
    empty, wake `wake` stage by stage. `kept`: awake roles the phase does not name that stay."""

    sleep: tuple[str, ...]
    wake: tuple[tuple[WakeCall, ...], ...]
    kept: tuple[str, ...]
    need_bytes: int | None
    free_bytes: int | None

    @property
    def is_short(self) -> bool:
        """Nothing more to sleep, yet the phase needs more than is free (estimates are upper
        bounds: the wake may still fit)."""
        return (
            not self.sleep
            and self.need_bytes is not None
            and self.free_bytes is not None
            and self.need_bytes > self.free_bytes
        )


def sleep_order(
    candidates: Sequence[str], needed_next: Collection[str], size: Callable[[str], int]
) -> list[str]:
    """The order in which a switch puts roles to sleep until its phase fits.

    Roles the following phase (the one that came next last time) does not need go first: they
    would sleep at the next switch anyway, while keeping a needed one saves its wake-up. Within
    each group, the largest first, so the fewest roles sleep.
    """
    return sorted(candidates, key=lambda name: (name in needed_next, -size(name)))


def wake_calls(
    wanted: Mapping[str, Collection[str]],
    awake: Mapping[str, Collection[str]],
    tags: Mapping[str, tuple[str, ...]],
    wake_stages: Sequence[Sequence[str]],
) -> list[list[WakeCall]]:
    """Wake calls grouped by stage: each role's tags in the configured stages, then the rest."""
    missing = {
        name: [tag for tag in tags[name] if tag in set(wanted_tags) - set(awake[name])]
        for name, wanted_tags in wanted.items()
    }
    stages = []
    for stage in (*wake_stages, None):
        calls = []
        for name, role_tags in missing.items():
            if role_tags == [WHOLE] or stage is None:
                # A role without memory_tags wakes whole, in the first stage.
                chosen = role_tags
            else:
                chosen = [tag for tag in role_tags if tag in stage]
            if chosen:
                calls.append((name, tuple(chosen)))
                missing[name] = [tag for tag in role_tags if tag not in chosen]
        stages.append(calls)
    return stages


def plan_switch(snapshot: SwitchSnapshot) -> SwitchDecision:
    """The next step of a switch into `snapshot.phase` (see the module doc)."""
    wake = tuple(
        tuple(stage)
        for stage in wake_calls(
            snapshot.wanted, snapshot.awake, snapshot.tags, snapshot.wake_stages
        )
    )
    others = [r for r in snapshot.tags if r not in snapshot.wanted and snapshot.awake[r]]
    need, free = snapshot.need_bytes, snapshot.free_bytes

    def decide(sleep: Sequence[str]) -> SwitchDecision:
        kept = tuple(r for r in others if r not in sleep)
        return SwitchDecision(
            sleep=tuple(sleep), wake=wake, kept=kept, need_bytes=need, free_bytes=free
        )

    if need is None:
        return decide(others)
    # A moved share applies when the KV cache is next woken, so the role must sleep first.
    moved = [r for r in others if r in snapshot.moved]
    if moved:
        return decide(moved)
    if free is None:
        raise ValueError(
            f"SwitchSnapshot(phase={snapshot.phase!r}) has need_bytes={need} but no free_bytes; "
            "read the device's free bytes when the need is known"
        )
    if need <= free or not others:
        return decide(())
    order = sleep_order(others, snapshot.needed_next, lambda r: snapshot.role_bytes.get(r, 0))
    return decide(order[:1])
