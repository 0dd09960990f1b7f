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
With offload="auto" step (1) sleeps a role only when the phase would not fit beside it (`_fit`).
Dataflow: `Plan` keeps the state (roles, awake tags, measurements in `FitBooks`), hands a
`SwitchSnapshot` to the pure planner (`_planner.plan_switch`), and executes the decision it gets
back (sleeps, then wakes); fit reports (`check_fit`) come from `_fit_report`; the factories'
phase layouts and the checks of a layout against its roles come from `_phases`.
Before a switch wakes anything it releases torch's allocator cache (a woken region needs memory
the driver can hand out). Roles that report their needs (`MemoryNeed`) let offload="auto" check,
at the first switch, that every phase can fit at all, and fail then, naming what to shrink.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

from yatt.placement._capabilities import MeasuresResidentBytes, ResizesWhileAwake
from yatt.placement._capture_guard import synchronize
from yatt.placement._fit import FitConfig, OffloadMode, make_default_meter, make_fit_books
from yatt.placement._fit_report import fit_report, host_fit_report, raise_unless_fits
from yatt.placement._needs import HostFit, PhaseFit, role_need
from yatt.placement._phases import (
    WAKE_STAGES,
    PhaseEntry,
    check_distinct_regions,
    full_colocation_layout,
    parse_phase,
    partial_colocation_layout,
    role_tags,
    separate_layout,
    working_roles,
)
from yatt.placement._planner import (
    WHOLE,
    SwitchDecision,
    SwitchSnapshot,
    WakeCall,
    plan_switch,
    wake_calls,
)
from yatt.placement._records import PhaseRecord, phase_metrics
from yatt.placement._roles import Role
from yatt.placement._split import MemorySplit, SplitState

_MAX_RECORDS = 1024

logger = logging.getLogger(__name__)


def _synchronize() -> None:
    # Sleep and wake enqueue device work; time and memory readings must come after it.
    synchronize()  # never inside another thread's CUDA-graph capture (_capture_guard)


def _resizes_while_awake(role: Role) -> bool:
    return isinstance(role, ResizesWhileAwake) and bool(role.resizes_while_awake)


class Plan:
    """Named roles, the roles each phase needs, and switches between phases with metrics.

    Most users call `Plan.full_colocation`, `Plan.partial_colocation` or `Plan.separate`;
    the constructor takes any set of phases.

    meter: returns the bytes in use, read around each switch. Default: the device's used memory
        (torch.cuda.mem_get_info, so other processes on the GPU count) when CUDA is available,
        else the sum of `resident_bytes()` over the roles that have it.
    offload: "always" (default): a switch sleeps every awake role the phase does not name.
        "auto": only when the phase would not fit beside them, as measured in earlier steps (see
        `yatt.placement._fit`); the first step runs as "always". Without CUDA and without
        `fit.free_bytes`, "auto" runs as "always".
    fit: how the plan reads memory and the headroom "auto" keeps; defaults read the CUDA device.
    peak_phases: role -> the phases where the peak it reports (`MemoryNeed.peak`) happens;
        default: every phase that wakes the role whole.
    """

    def __init__(
        self,
        *,
        roles: Mapping[str, Role],
        phases: Mapping[str, Sequence[PhaseEntry]],
        mode: str = "custom",
        wake_stages: Sequence[Sequence[str]] = WAKE_STAGES,
        split: MemorySplit | None = None,
        meter: Callable[[], int] | None = None,
        offload: OffloadMode = "always",
        fit: FitConfig | None = None,
        peak_phases: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        for name, role in roles.items():
            if not isinstance(role, Role):
                raise ValueError(
                    f"roles[{name!r}] is a {type(role).__name__} without sleep() and "
                    "wake_up(tags=None); wrap a trainer in TrainerRole(model, optimizer)"
                )
        if not phases:
            raise ValueError("Plan(phases={}) needs at least one phase")
        check_distinct_regions(roles)
        self.mode = mode
        self.offload = offload
        self._roles = dict(roles)
        self._phases = {name: parse_phase(name, entries, roles) for name, entries in phases.items()}
        self._wake_stages = tuple(tuple(stage) for stage in wake_stages)
        # Roles are assumed awake when handed over: they were just built.
        self._awake = {name: set(self._tags_of(name)) for name in self._roles}
        self._current: str | None = None
        self._meter = meter if meter is not None else make_default_meter(self._roles.values())
        self._fit = make_fit_books(offload, fit, self._meter)
        self._is_auto = offload == "auto" and self._fit.can_measure
        self._working = working_roles(self._roles, self._phases, peak_phases or {})
        self._is_checked = False
        self._warned_short: set[str] = set()
        self._last_phase: str | None = None
        self._following: dict[str, str] = {}  # phase -> the phase that came after it last time
        self.records: deque[PhaseRecord] = deque(maxlen=_MAX_RECORDS)
        self._latest: dict[str, PhaseRecord] = {}
        self._num_switches = dict.fromkeys(self._phases, 0)
        self._split = SplitState(split, self._roles) if split is not None else None

    @classmethod
    def full_colocation(
        cls,
        *,
        rollout: Role,
        train: Role,
        genrm: Role | None = None,
        reference: Role | None = None,
        wake_stages: Sequence[Sequence[str]] = WAKE_STAGES,
        meter: Callable[[], int] | None = None,
        offload: OffloadMode = "always",
        fit: FitConfig | None = None,
    ) -> Plan:
        """Each phase alone on every GPU: phases rollout, genrm (if given), train and sync.
        A KL `reference` policy is awake in the train phase only."""
        layout = full_colocation_layout(
            rollout=rollout, train=train, genrm=genrm, reference=reference
        )
        return cls(
            roles=layout.roles,
            phases=layout.phases,
            mode="full_colocation",
            wake_stages=wake_stages,
            meter=meter,
            offload=offload,
            fit=fit,
            peak_phases=layout.peak_phases,
        )

    @classmethod
    def partial_colocation(
        cls,
        *,
        rollout: Role,
        genrm: Role,
        train: Role,
        reference: Role | None = None,
        split: MemorySplit | None = None,
        wake_stages: Sequence[Sequence[str]] = WAKE_STAGES,
        meter: Callable[[], int] | None = None,
        offload: OffloadMode = "always",
        fit: FitConfig | None = None,
    ) -> Plan:
        """Rollout and GenRM resident together (memory split by load), trainer offloaded; a KL
        `reference` policy is awake in the train phase only."""
        layout = partial_colocation_layout(
            rollout=rollout, genrm=genrm, train=train, reference=reference
        )
        return cls(
            roles=layout.roles,
            phases=layout.phases,
            peak_phases=layout.peak_phases,
            mode="partial_colocation",
            split=split if split is not None else MemorySplit(),
            wake_stages=wake_stages,
            meter=meter,
            offload=offload,
            fit=fit,
        )

    @classmethod
    def separate(
        cls,
        *,
        rollout: Role,
        train: Role,
        genrm: Role | None = None,
        reference: Role | None = None,
        meter: Callable[[], int] | None = None,
    ) -> Plan:
        """Every role keeps its own GPUs and stays awake: the baseline; switches cost nothing."""
        layout = separate_layout(rollout=rollout, train=train, genrm=genrm, reference=reference)
        return cls(roles=layout.roles, phases=layout.phases, mode="separate", meter=meter)

    def _tags_of(self, role_name: str) -> tuple[str, ...]:
        return role_tags(self._roles[role_name])

    @property
    def phases(self) -> tuple[str, ...]:
        return tuple(self._phases)

    @property
    def current_phase(self) -> str | None:
        return self._current

    def is_resident_together(self, *role_names: str) -> bool:
        """Whether some phase keeps every named role awake at once (whole), e.g. whether a
        trainer can stream the rollout's responses to the judge while the rollout still runs:
        True for partial colocation and separate GPUs, False for full colocation."""
        unknown = [name for name in role_names if name not in self._roles]
        if unknown:
            raise ValueError(f"is_resident_together{unknown}: roles are {sorted(self._roles)}")
        return any(
            all(wanted.get(name) == set(self._tags_of(name)) for name in role_names)
            for wanted in self._phases.values()
        )

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
        if not self._is_checked:
            self._is_checked = True
            # Before anything moves: a phase that can never fit, or roles that would pin more
            # host memory asleep than the host has, fail here.
            if self._is_auto:
                self.check_fit()
            else:
                raise_unless_fits([], self.host_fit_report())
        self._fit.end_phase()  # the previous phase's peak growth
        if self._last_phase is not None:
            self._following[self._last_phase] = name
        self._last_phase = name
        _synchronize()
        start = time.perf_counter()
        before = self._meter()
        stages = self._stages_for(wanted)
        if any(stages):
            # Woken regions and onloads need memory the driver can hand out; the previous
            # phase's freed activations cached in torch's default pool are not that.
            self._fit.release_cache()
        decision = self._sleep_for(name, stages)
        kept, need, free = list(decision.kept), decision.need_bytes, decision.free_bytes
        _synchronize()
        slept = time.perf_counter()
        after_sleep = self._meter()
        wake_start = time.perf_counter()
        for stage in decision.wake:
            for call in stage:
                self._wake(call)
        _synchronize()
        end = time.perf_counter()
        after_wake = self._meter()
        self._fit.start_phase(name)
        record = PhaseRecord(
            phase=name,
            switch_s=end - start,
            sleep_s=slept - start,
            wake_s=end - wake_start,
            released_bytes=max(0, before - after_sleep),
            woken_bytes=max(0, after_wake - after_sleep),
            resident_bytes=after_wake,
            kept_awake=tuple(kept),
            kept_awake_bytes=sum(self._role_bytes(r) for r in kept),
            need_bytes=need or 0,
            free_bytes=free or 0,
            role_resident_bytes={r: self._role_bytes(r) for r in self._roles if self._awake[r]},
            role_asleep_bytes={r: self._asleep_bytes(r) for r in self._roles if not self._awake[r]},
        )
        self.records.append(record)
        self._latest[name] = record
        self._num_switches[name] += 1
        return record

    def _need_bytes(self, phase: str, stages: list[list[WakeCall]]) -> int | None:
        """Free bytes `phase` needs after its wakes (offload="auto"); None: sleep every other."""
        if not self._is_auto:
            return None
        calls = [call for stage in stages for call in stage]
        scales = self._split.wake_scales() if self._split is not None else {}
        return self._fit.need_bytes(
            phase,
            calls,
            scales,
            reported_wake=self._reported_wake(calls),
            reported_peak=self._reported_peak(phase),
        )

    def _snapshot(self, phase: str, need: int | None) -> SwitchSnapshot:
        """The plan's state as the pure planner reads it (free memory read now, if needed)."""
        wanted = self._phases[phase]
        others = [r for r in self._roles if r not in wanted and self._awake[r]]
        # A new share applies when the KV cache is next woken, so the role must sleep first,
        # unless it resizes by itself while awake (the built-in engine, at its next call).
        moved = [
            r
            for r in others
            if self._split is not None
            and self._split.has_moved(r)
            and not _resizes_while_awake(self._roles[r])
        ]
        following = self._following.get(phase)
        return SwitchSnapshot(
            phase=phase,
            tags={r: self._tags_of(r) for r in self._roles},
            awake={r: frozenset(tags) for r, tags in self._awake.items()},
            wanted=wanted,
            wake_stages=self._wake_stages,
            need_bytes=need,
            free_bytes=self._fit.free_bytes() if need is not None else None,
            role_bytes={r: self._role_bytes(r) for r in others} if need is not None else {},
            moved=frozenset(moved),
            needed_next=frozenset(self._phases[following]) if following is not None else (),
        )

    def _sleep_for(self, phase: str, stages: list[list[WakeCall]]) -> SwitchDecision:
        """Put awake roles that `phase` does not name to sleep as the planner decides, one
        decision at a time (each read after the previous sleeps, so the device's free memory,
        not the books' estimate, says when the phase fits); returns the final decision."""
        need = self._need_bytes(phase, stages)
        while True:
            decision = plan_switch(self._snapshot(phase, need))
            if not decision.sleep:
                break
            for role_name in decision.sleep:
                self._sleep(role_name)
        if decision.is_short and phase not in self._warned_short:
            # Everything it could sleep is asleep: the estimate (a measured peak, a reported
            # need) exceeds the device. The wake may still fit (estimates are upper bounds).
            self._warned_short.add(phase)
            logger.warning(
                "phase %r needs %.1f GiB free (wake + peak + headroom) but only %.1f GiB are "
                "after putting %s to sleep; a wake or its peak may run out of memory. Shrink "
                "the micro-batch tokens, an engine's KV share, or use activation checkpointing.",
                phase,
                decision.need_bytes / 2**30,
                decision.free_bytes / 2**30,
                "every other role" if not decision.kept else f"all but {list(decision.kept)}",
            )
        return decision

    def _reported_wake(self, calls: Sequence[WakeCall]) -> dict[WakeCall, int]:
        """Per wake call, the bytes its role reports for those tags (roles that report)."""
        out = {}
        for call in calls:
            need = role_need(self._roles[call[0]])
            if need is not None:
                tags = None if call[1] == (WHOLE,) else call[1]
                out[call] = need.resident_bytes(tags)
        return out

    def _reported_peak(self, phase: str) -> int | None:
        """The peak the roles working in `phase` report; None unless every one reports."""
        total = 0
        for role_name in self._working[phase]:
            need = role_need(self._roles[role_name])
            if need is None:
                return None
            total += need.peak_bytes
        return total

    def fit_report(self) -> list[PhaseFit]:
        """Per phase, what it needs alone on the device (every other role asleep), from the
        roles' reports; phases with a role that gives no report are left out."""
        return fit_report(
            self._roles,
            awake=self._awake,
            phases=self._phases,
            working=self._working,
            books=self._fit,
        )

    def check_fit(self) -> list[PhaseFit]:
        """Raise MemoryFitError if a phase cannot fit on the device even with every other role
        asleep, by the roles' reports (`memory_need()`), or if the roles that sleep would hold
        more host memory than the host has (`host_fit_report`); returns the phases' requirements.

        offload="auto" runs it at the first switch, before anything moves; call it yourself
        before a run with offload="always". Without reports or a capacity reading (CPU without
        FitConfig.capacity_bytes) it checks nothing."""
        report = self.fit_report()
        raise_unless_fits(report, self.host_fit_report())
        return report

    def host_fit_report(self) -> HostFit | None:
        """What the roles that some phase puts to sleep hold in host memory while asleep (their
        `host_need()` reports, summed: a pinned copy stays cached from the first sleep on), with
        `FitConfig.host_headroom_bytes`, against the host's available memory
        (`FitConfig.host_available_bytes`, read now). None when no such role reports or the
        host cannot be read. Meant before any role sleeps: what they pin by then counts as used.
        The plan's first switch raises MemoryFitError when it does not fit, in either offload
        mode; `check_fit` includes it."""
        return host_fit_report(
            self._roles,
            tags={r: self._tags_of(r) for r in self._roles},
            phases=self._phases,
            books=self._fit,
        )

    def _sleep(self, role_name: str) -> None:
        role = self._roles[role_name]
        is_whole = self._awake[role_name] == set(self._tags_of(role_name))
        before = self._meter()
        role.sleep()
        if is_whole:
            self._fit.record_sleep(role_name, before - self._meter())
        self._awake[role_name] = set()

    def _wake(self, call: WakeCall) -> None:
        role_name, tags = call
        role = self._roles[role_name]
        before = self._meter()
        if tags == (WHOLE,):
            role.wake_up()
        else:
            role.wake_up(tags=tags)
        self._fit.record_wake(call, self._meter() - before)
        self._awake[role_name] |= set(tags)
        if self._split is not None:
            self._split.note_wake(role_name, sizes_kv_cache="kv_cache" in tags or tags == (WHOLE,))

    def _role_bytes(self, role_name: str) -> int:
        """What an awake role holds: its own count if it keeps one, else as last measured."""
        role = self._roles[role_name]
        if isinstance(role, MeasuresResidentBytes):
            return role.resident_bytes()
        return self._fit.role_bytes(role_name) or 0

    def _asleep_bytes(self, role_name: str) -> int:
        """What an asleep role would take to wake whole: its report, else as last measured."""
        need = role_need(self._roles[role_name])
        if need is not None:
            return need.resident_bytes()
        return self._fit.role_bytes(role_name) or 0

    def _stages_for(self, wanted: dict[str, set[str]]) -> list[list[WakeCall]]:
        """Wake calls grouped by stage (see `_planner.wake_calls`)."""
        tags = {r: self._tags_of(r) for r in self._roles}
        return wake_calls(wanted, self._awake, tags, self._wake_stages)

    def sleep_all(self) -> None:
        """Put every awake role to sleep (end of run, or before handing the GPU elsewhere)."""
        self._fit.end_phase()
        for role_name in self._roles:
            if self._awake[role_name]:
                self._sleep(role_name)

    @property
    def rollout_fraction(self) -> float:
        """The rollout engine's part of the engines' memory (partial colocation)."""
        return self._split.rollout_fraction if self._split is not None else 0.0

    @property
    def has_memory_split(self) -> bool:
        """Rollout and GenRM share the device by a split that `update_load` moves."""
        return self._split is not None

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
        return self._split.update(rollout_pending_tokens, genrm_pending_tokens)

    def metrics(self) -> dict[str, float]:
        """Latest switch into each phase as flat floats; the keys are fixed by the plan's phases."""
        out: dict[str, float] = {}
        for name in self._phases:
            out |= phase_metrics(
                name,
                self._latest.get(name),
                self._num_switches[name],
                self._fit.growth_bytes(name),
                roles=tuple(self._roles),
                latest_device_growth_bytes=self._fit.latest_device_growth_bytes(name),
            )
        out["placement/headroom_bytes"] = float(self._fit.headroom_bytes())
        if self._split is not None:
            shares = self._split.shares()
            out["placement/rollout_memory_fraction"] = shares["rollout"]
            out["placement/genrm_memory_fraction"] = shares["genrm"]
        return out
