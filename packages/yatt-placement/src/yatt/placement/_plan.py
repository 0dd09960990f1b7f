"""Placement plans: which roles hold the device in each phase of an RL step, and the switches.

    plan = Plan.full_colocation(rollout=engine, genrm=judge, train=TrainerRole(model, opt))
    with plan.phase("rollout"):      # trainer and judge sleep, the engine wakes
        samples = engine.generate(prompts)
    with plan.phase("genrm"):
        scores = judge.score(samples)
    with plan.phase("train"):
        train_step(samples, scores)
    with plan.phase("sync"):         # trainer stays, the engine's weights (only) wake
        push_weights(model, engine)
    log(plan.metrics())

A switch into a phase (1) puts every awake role the phase does not name to sleep, then (2) wakes
the phase's roles in stages, all roles' "weights" before any "kv_cache" (then any other tags),
so memory fills in the order that keeps the peak lowest. Leaving a phase does nothing: the
next switch decides what sleeps, so consecutive phases that share a role do not bounce it.
A phase never puts part of a role to sleep: a role awake with more tags than asked stays so.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from yatt.placement._roles import Role
from yatt.placement._split import MemorySplit, next_rollout_fraction

# One phase entry: a role name (the whole role), or (name, tags) for part of it.
PhaseEntry = str | tuple[str, Sequence[str]]
_WHOLE = "*"  # the one tag of a role without memory_tags
_MAX_RECORDS = 1024
# Weights first: a KV cache sized from free memory must see every role's weights in place.
_WAKE_STAGES = (("weights",), ("kv_cache",))


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


def _synchronize() -> None:
    # Sleep and wake enqueue device work; time and memory readings must come after it.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _device_used_bytes() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def _rollout_weights(rollout: Role) -> PhaseEntry:
    """The sync phase needs only the engine's weights, if the engine can wake them alone."""
    if "weights" in (getattr(rollout, "memory_tags", None) or ()):
        return ("rollout", ("weights",))
    return "rollout"


def _ordered_roles(rollout: Role, genrm: Role | None, train: Role) -> dict[str, Role]:
    roles = {"rollout": rollout, "genrm": genrm, "train": train}
    return {name: role for name, role in roles.items() if role is not None}


class Plan:
    """Named roles, the roles each phase needs, and switches between phases with metrics.

    Most users call `Plan.full_colocation`, `Plan.partial_colocation` or `Plan.separate`;
    the constructor takes any set of phases.

    meter: returns the bytes in use, read around each switch. Default: the device's used memory
        (torch.cuda.mem_get_info, so other processes on the GPU count) when CUDA is available,
        else the sum of `resident_bytes()` over the roles that have it.
    """

    def __init__(
        self,
        *,
        roles: Mapping[str, Role],
        phases: Mapping[str, Sequence[PhaseEntry]],
        mode: str = "custom",
        wake_stages: Sequence[Sequence[str]] = _WAKE_STAGES,
        split: MemorySplit | None = None,
        meter: Callable[[], int] | None = None,
    ) -> None:
        for name, role in roles.items():
            if not isinstance(role, Role):
                raise ValueError(
                    f"roles[{name!r}] is a {type(role).__name__} without sleep() and "
                    "wake_up(tags=None); wrap a trainer in TrainerRole(model, optimizer)"
                )
        if not phases:
            raise ValueError("Plan(phases={}) needs at least one phase")
        self.mode = mode
        self._roles = dict(roles)
        self._phases = {name: self._parse_phase(name, entries) for name, entries in phases.items()}
        self._wake_stages = tuple(tuple(stage) for stage in wake_stages)
        # Roles are assumed awake when handed over: they were just built.
        self._awake = {name: set(self._tags_of(name)) for name in self._roles}
        self._current: str | None = None
        self._meter = meter if meter is not None else self._default_meter()
        self.records: deque[PhaseRecord] = deque(maxlen=_MAX_RECORDS)
        self._latest: dict[str, PhaseRecord] = {}
        self._num_switches = dict.fromkeys(self._phases, 0)
        self._split = split
        self._rollout_fraction = split.initial_rollout_fraction if split is not None else 0.0
        if split is not None:
            for name in ("rollout", "genrm"):
                if name not in self._roles:
                    raise ValueError(f"Plan(split=...) needs a role named {name!r}")
            self._apply_split()

    @classmethod
    def full_colocation(
        cls,
        *,
        rollout: Role,
        train: Role,
        genrm: Role | None = None,
        wake_stages: Sequence[Sequence[str]] = _WAKE_STAGES,
        meter: Callable[[], int] | None = None,
    ) -> Plan:
        """Each phase alone on every GPU: phases rollout, genrm (if given), train and sync."""
        roles = _ordered_roles(rollout, genrm, train)
        phases: dict[str, list[PhaseEntry]] = {"rollout": ["rollout"]}
        if genrm is not None:
            phases["genrm"] = ["genrm"]
        phases |= {"train": ["train"], "sync": ["train", _rollout_weights(rollout)]}
        return cls(
            roles=roles,
            phases=phases,
            mode="full_colocation",
            wake_stages=wake_stages,
            meter=meter,
        )

    @classmethod
    def partial_colocation(
        cls,
        *,
        rollout: Role,
        genrm: Role,
        train: Role,
        split: MemorySplit | None = None,
        wake_stages: Sequence[Sequence[str]] = _WAKE_STAGES,
        meter: Callable[[], int] | None = None,
    ) -> Plan:
        """Rollout and GenRM resident together (memory split by load), trainer offloaded."""
        engines: list[PhaseEntry] = ["rollout", "genrm"]
        phases = {
            "rollout": engines,
            "genrm": engines,
            "train": ["train"],
            "sync": ["train", _rollout_weights(rollout)],
        }
        return cls(
            roles={"rollout": rollout, "genrm": genrm, "train": train},
            phases=phases,
            mode="partial_colocation",
            split=split if split is not None else MemorySplit(),
            wake_stages=wake_stages,
            meter=meter,
        )

    @classmethod
    def separate(
        cls,
        *,
        rollout: Role,
        train: Role,
        genrm: Role | None = None,
        meter: Callable[[], int] | None = None,
    ) -> Plan:
        """Every role keeps its own GPUs and stays awake: the baseline; switches cost nothing."""
        roles = _ordered_roles(rollout, genrm, train)
        every: list[PhaseEntry] = list(roles)
        phases = dict.fromkeys(
            ["rollout", *(["genrm"] if genrm is not None else []), "train", "sync"], every
        )
        return cls(roles=roles, phases=phases, mode="separate", meter=meter)

    def _tags_of(self, role_name: str) -> tuple[str, ...]:
        return tuple(getattr(self._roles[role_name], "memory_tags", None) or (_WHOLE,))

    def _parse_phase(self, phase: str, entries: Sequence[PhaseEntry]) -> dict[str, set[str]]:
        wanted: dict[str, set[str]] = {}
        for entry in entries:
            name, tags = (entry, None) if isinstance(entry, str) else entry
            if name not in self._roles:
                raise ValueError(
                    f"phases[{phase!r}] names role {name!r}; roles are {sorted(self._roles)}"
                )
            known = self._tags_of(name)
            if tags is not None and (isinstance(tags, str) or not set(tags) <= set(known)):
                raise ValueError(
                    f"phases[{phase!r}] asks role {name!r} for tags {tags!r}; it declares "
                    f"memory_tags={known if known != (_WHOLE,) else None}"
                )
            wanted[name] = set(known if tags is None else tags)
        return wanted

    def _default_meter(self) -> Callable[[], int]:
        if torch.cuda.is_available():
            return _device_used_bytes
        measured = [role for role in self._roles.values() if hasattr(role, "resident_bytes")]
        return lambda: sum(role.resident_bytes() for role in measured)

    @property
    def phases(self) -> tuple[str, ...]:
        return tuple(self._phases)

    @property
    def current_phase(self) -> str | None:
        return self._current

    @contextmanager
    def phase(self, name: str) -> Iterator[PhaseRecord]:
        """Switch into phase `name` on entry (see the module doc); yields the switch's record."""
        if self._current is not None:
            raise RuntimeError(
                f"plan.phase({name!r}) entered inside phase {self._current!r}; phases do not nest"
            )
        record = self.switch_to(name)
        self._current = name
        try:
            yield record
        finally:
            self._current = None

    def switch_to(self, name: str) -> PhaseRecord:
        """Make phase `name`'s roles the awake ones; the `with plan.phase(...)` body's first step."""
        if name not in self._phases:
            raise ValueError(f"phase {name!r} is not in this plan; phases are {self.phases}")
        wanted = self._phases[name]
        _synchronize()
        start = time.perf_counter()
        before = self._meter()
        for role_name, role in self._roles.items():
            if role_name not in wanted and self._awake[role_name]:
                role.sleep()
                self._awake[role_name] = set()
        _synchronize()
        slept = time.perf_counter()
        after_sleep = self._meter()
        wake_start = time.perf_counter()
        for stage in self._stages_for(wanted):
            for role_name, tags in stage:
                role = self._roles[role_name]
                if tags == (_WHOLE,):
                    role.wake_up()
                else:
                    role.wake_up(tags=tags)
                self._awake[role_name] |= set(tags)
        _synchronize()
        end = time.perf_counter()
        after_wake = self._meter()
        record = PhaseRecord(
            phase=name,
            switch_s=end - start,
            sleep_s=slept - start,
            wake_s=end - wake_start,
            released_bytes=max(0, before - after_sleep),
            woken_bytes=max(0, after_wake - after_sleep),
            resident_bytes=after_wake,
        )
        self.records.append(record)
        self._latest[name] = record
        self._num_switches[name] += 1
        return record

    def _stages_for(self, wanted: dict[str, set[str]]) -> list[list[tuple[str, tuple[str, ...]]]]:
        """Wake calls grouped by stage: each role's tags in the configured stages, then the rest."""
        missing = {
            name: [tag for tag in self._tags_of(name) if tag in tags - self._awake[name]]
            for name, tags in wanted.items()
        }
        stages = []
        for stage in (*self._wake_stages, None):
            calls = []
            for name, tags in missing.items():
                if tags == [_WHOLE]:
                    # A role without memory_tags wakes whole, in the first stage.
                    chosen = tags
                elif stage is None:
                    chosen = tags
                else:
                    chosen = [tag for tag in tags if tag in stage]
                if chosen:
                    calls.append((name, tuple(chosen)))
                    missing[name] = [tag for tag in tags if tag not in chosen]
            stages.append(calls)
        return stages

    def sleep_all(self) -> None:
        """Put every awake role to sleep (end of run, or before handing the GPU elsewhere)."""
        for role_name, role in self._roles.items():
            if self._awake[role_name]:
                role.sleep()
                self._awake[role_name] = set()

    @property
    def rollout_fraction(self) -> float:
        """The rollout engine's part of the engines' memory (partial colocation)."""
        return self._rollout_fraction

    def update_load(self, *, rollout_pending_tokens: float, genrm_pending_tokens: float) -> float:
        """Move the memory split toward the measured load; returns the new rollout fraction.

        The shares of device memory go to roles with `set_memory_fraction` at once; they apply
        them when they next size their KV cache.
        """
        if self._split is None:
            raise RuntimeError(
                f"update_load() needs a memory split; this plan's mode is {self.mode!r}, "
                "use Plan.partial_colocation(..., split=MemorySplit(...))"
            )
        self._rollout_fraction = next_rollout_fraction(
            self._split, self._rollout_fraction, rollout_pending_tokens, genrm_pending_tokens
        )
        self._apply_split()
        return self._rollout_fraction

    def _memory_shares(self) -> dict[str, float]:
        assert self._split is not None
        total = self._split.total_fraction
        return {
            "rollout": total * self._rollout_fraction,
            "genrm": total * (1.0 - self._rollout_fraction),
        }

    def _apply_split(self) -> None:
        for name, share in self._memory_shares().items():
            setter = getattr(self._roles[name], "set_memory_fraction", None)
            if setter is not None:
                setter(share)

    def metrics(self) -> dict[str, float]:
        """Latest switch into each phase as flat floats; the keys are fixed by the plan's phases."""
        out: dict[str, float] = {}
        for name in self._phases:
            record = self._latest.get(name)
            prefix = f"placement/{name}/"
            out[prefix + "switch_s"] = record.switch_s if record else 0.0
            out[prefix + "sleep_s"] = record.sleep_s if record else 0.0
            out[prefix + "wake_s"] = record.wake_s if record else 0.0
            out[prefix + "released_bytes"] = float(record.released_bytes if record else 0)
            out[prefix + "woken_bytes"] = float(record.woken_bytes if record else 0)
            out[prefix + "resident_bytes"] = float(record.resident_bytes if record else 0)
            out[prefix + "num_switches"] = float(self._num_switches[name])
        if self._split is not None:
            shares = self._memory_shares()
            out["placement/rollout_memory_fraction"] = shares["rollout"]
            out["placement/genrm_memory_fraction"] = shares["genrm"]
        return out
