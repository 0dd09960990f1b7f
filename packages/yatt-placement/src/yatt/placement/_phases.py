"""Phase layouts: which roles (and which of their memory tags) each phase of a plan keeps awake.

The three standard layouts (`full_colocation_layout`, `partial_colocation_layout`,
`separate_layout`) are what `Plan`'s factories build; `parse_phases` checks any layout against
its roles and turns it into role -> wanted tags; `working_roles` says in which phases each role's
reported peak happens. Nothing here sleeps, wakes or measures a role: `Plan` does that.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from yatt.placement._capabilities import InMemoryRegions, MemoryTagged
from yatt.placement._planner import WHOLE
from yatt.placement._roles import Role

# One phase entry: a role name (the whole role), or (name, tags) for part of it.
PhaseEntry = str | tuple[str, Sequence[str]]
# Weights first: a KV cache sized from free memory must see every role's weights in place.
WAKE_STAGES = (("weights",), ("kv_cache",))
# The factories' trainer and KL reference work (activations, gradients) in the train phase only:
# in sync the trainer is awake but its reported peak does not happen.
_TRAIN_PEAKS = {"train": ("train",), "reference": ("train",)}


@dataclass(frozen=True, kw_only=True)
class PhaseLayout:
    """A plan's roles, the entries of each phase, and where the roles' reported peaks happen."""

    roles: dict[str, Role]
    phases: dict[str, list[PhaseEntry]]
    peak_phases: dict[str, tuple[str, ...]] | None = None


def role_tags(role: Role) -> tuple[str, ...]:
    """The memory tags a role declares, or the one tag WHOLE when it declares none."""
    return tuple((role.memory_tags if isinstance(role, MemoryTagged) else None) or (WHOLE,))


def _rollout_weights(rollout: Role) -> PhaseEntry:
    """The sync phase needs only the engine's weights, if the engine can wake them alone."""
    if isinstance(rollout, MemoryTagged) and "weights" in (rollout.memory_tags or ()):
        return ("rollout", ("weights",))
    return "rollout"


def _ordered_roles(
    rollout: Role, genrm: Role | None, train: Role, reference: Role | None = None
) -> dict[str, Role]:
    roles = {"rollout": rollout, "genrm": genrm, "train": train, "reference": reference}
    return {name: role for name, role in roles.items() if role is not None}


def _train_entries(reference: Role | None) -> list[PhaseEntry]:
    """The train phase: the trainer, and a frozen KL reference policy whose logprobs the loss
    reads (awake only then: offloaded with the trainer in every other phase)."""
    return ["train", "reference"] if reference is not None else ["train"]


def _train_peaks(roles: Mapping[str, Role]) -> dict[str, tuple[str, ...]]:
    return {name: _TRAIN_PEAKS[name] for name in _TRAIN_PEAKS if name in roles}


def full_colocation_layout(
    *, rollout: Role, train: Role, genrm: Role | None = None, reference: Role | None = None
) -> PhaseLayout:
    """Each phase alone on every GPU: phases rollout, genrm (if given), train and sync."""
    roles = _ordered_roles(rollout, genrm, train, reference)
    phases: dict[str, list[PhaseEntry]] = {"rollout": ["rollout"]}
    if genrm is not None:
        phases["genrm"] = ["genrm"]
    phases |= {
        "train": _train_entries(reference),
        "sync": ["train", _rollout_weights(rollout)],
    }
    return PhaseLayout(roles=roles, phases=phases, peak_phases=_train_peaks(roles))


def partial_colocation_layout(
    *, rollout: Role, genrm: Role, train: Role, reference: Role | None = None
) -> PhaseLayout:
    """Rollout and GenRM awake together in their phases, the trainer in train and sync."""
    engines: list[PhaseEntry] = ["rollout", "genrm"]
    roles = _ordered_roles(rollout, genrm, train, reference)
    phases = {
        "rollout": engines,
        "genrm": engines,
        "train": _train_entries(reference),
        "sync": ["train", _rollout_weights(rollout)],
    }
    return PhaseLayout(roles=roles, phases=phases, peak_phases=_train_peaks(roles))


def separate_layout(
    *, rollout: Role, train: Role, genrm: Role | None = None, reference: Role | None = None
) -> PhaseLayout:
    """Every role awake in every phase (each on its own GPUs)."""
    roles = _ordered_roles(rollout, genrm, train, reference)
    every: list[PhaseEntry] = list(roles)
    phases = dict.fromkeys(
        ["rollout", *(["genrm"] if genrm is not None else []), "train", "sync"], every
    )
    return PhaseLayout(roles=roles, phases=phases)


def check_distinct_regions(roles: Mapping[str, Role]) -> None:
    """Two roles in one memory region would pause each other (regions sleep by name)."""
    owner: dict[str, str] = {}
    for name, role in roles.items():
        regions = role.memory_regions if isinstance(role, InMemoryRegions) else ()
        for region_tag in regions or ():
            if region_tag in owner and roles[owner[region_tag]] is not role:
                raise ValueError(
                    f"roles {owner[region_tag]!r} and {name!r} share the memory region "
                    f"{region_tag!r}, so putting one to sleep would put the other to sleep too; "
                    "give each engine its own region (EngineConfig.region_prefix)"
                )
            owner[region_tag] = name


def parse_phase(
    phase: str, entries: Sequence[PhaseEntry], roles: Mapping[str, Role]
) -> dict[str, set[str]]:
    """One phase's entries as role -> the tags it must have awake; a ValueError names an
    unknown role or tags the role does not declare."""
    wanted: dict[str, set[str]] = {}
    for entry in entries:
        name, tags = (entry, None) if isinstance(entry, str) else entry
        if name not in roles:
            raise ValueError(f"phases[{phase!r}] names role {name!r}; roles are {sorted(roles)}")
        known = role_tags(roles[name])
        if tags is not None and (isinstance(tags, str) or not set(tags) <= set(known)):
            raise ValueError(
                f"phases[{phase!r}] asks role {name!r} for tags {tags!r}; it declares "
                f"memory_tags={known if known != (WHOLE,) else None}"
            )
        wanted[name] = set(known if tags is None else tags)
    return wanted


def working_roles(
    roles: Mapping[str, Role],
    phases: Mapping[str, Mapping[str, set[str]]],
    peak_phases: Mapping[str, Sequence[str]],
) -> dict[str, set[str]]:
    """Per phase (parsed), the roles whose reported peak happens in it: the roles it wakes
    whole, less those whose `peak_phases` leave it out."""
    for role_name, names in peak_phases.items():
        unknown = [p for p in names if p not in phases]
        if role_name not in roles or unknown:
            raise ValueError(
                f"peak_phases[{role_name!r}]={list(names)!r}: roles are "
                f"{sorted(roles)}, phases {list(phases)}"
            )
    working: dict[str, set[str]] = {}
    for phase, wanted in phases.items():
        whole = {r for r, tags in wanted.items() if tags == set(role_tags(roles[r]))}
        working[phase] = {r for r in whole if r not in peak_phases or phase in peak_phases[r]}
    return working
