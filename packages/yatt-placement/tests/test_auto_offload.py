"""Plan(offload="auto") on a fake device: roles stay awake while the next phase fits beside them."""

import logging

import pytest
import torch

from yatt.placement import FitConfig, MemorySplit, Plan
from yatt.placement.testing import RecordingRole

NUM_GPUS = 0


@pytest.fixture(autouse=True)
def _no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    # On a GPU host the default readers would read the real device; these tests drive fakes.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


class FakeDevice:
    """Capacity, the roles' bytes, and the peaks the running phase reaches."""

    def __init__(self, capacity: int, roles: list[RecordingRole]) -> None:
        self.capacity, self.roles = capacity, roles
        self._level: int | None = None
        self._peak = 0

    def used(self) -> int:
        return sum(role.resident_bytes() for role in self.roles)

    def free_bytes(self) -> int:
        return self.capacity - self.used()

    def run(self, num_bytes: int) -> None:
        """The running phase allocates `num_bytes` at its peak, then frees them."""
        assert num_bytes <= self.free_bytes(), "out of memory on the fake device"
        self._peak = max(self._peak, self.used() + num_bytes)

    def peak_growth(self) -> int:
        used = self.used()
        growth = 0 if self._level is None else max(self._peak, used) - self._level
        self._level, self._peak = used, used
        return growth

    def fit(self, headroom: int = 10) -> FitConfig:
        return FitConfig(
            free_bytes=self.free_bytes, peak_growth=self.peak_growth, headroom_bytes=headroom
        )


def _sleeps(log: list) -> list[str]:
    return [entry[0] for entry in log if entry[1] == "sleep"]


def _cycle_roles(log: list) -> dict[str, RecordingRole]:
    return {
        "a": RecordingRole("a", log, {"weights": 100, "kv_cache": 300}),
        "b": RecordingRole("b", log, {"weights": 50, "kv_cache": 150}),
        "c": RecordingRole("c", log, {"weights": 400}),
    }


def _cycle_plan(
    log: list, capacity: int, offload: str = "auto", headroom: int = 10
) -> tuple[Plan, FakeDevice]:
    """Roles a (400 bytes), b (200) and c (400), and phases a, b, c that each need one."""
    roles = _cycle_roles(log)
    device = FakeDevice(capacity, list(roles.values()))
    plan = Plan(
        roles=roles,
        phases={"a": ["a"], "b": ["b"], "c": ["c"]},
        offload=offload,
        fit=device.fit(headroom) if offload == "auto" else None,
    )
    return plan, device


PEAKS = {"a": 200, "b": 100, "c": 300}


def _step(plan: Plan, device: FakeDevice, peaks: dict[str, int]) -> list:
    records = []
    for phase in ("a", "b", "c"):
        with plan.phase(phase) as record:
            device.run(peaks[phase])
        records.append(record)
    return records


def test_first_step_sleeps_everything_then_fitting_roles_stay_awake():
    log: list = []
    plan, device = _cycle_plan(log, capacity=10_000)
    first = _step(plan, device, PEAKS)
    # Nothing measured yet: every switch sleeps the others, as offload="always" does.
    assert [r.kept_awake for r in first] == [(), (), ()]
    assert _sleeps(log) == ["b", "c", "a", "b"]
    log.clear()
    second = _step(plan, device, PEAKS)
    assert [r.kept_awake for r in second] == [("c",), ("a", "c"), ("a", "b")]
    assert _sleeps(log) == []
    metrics = plan.metrics()
    assert metrics["placement/a/kept_awake"] == 1.0
    assert metrics["placement/a/kept_awake_bytes"] == 400.0  # role c
    assert metrics["placement/c/kept_awake"] == 2.0
    assert metrics["placement/c/kept_awake_bytes"] == 600.0  # a (400) and b (200)
    assert metrics["placement/c/peak_growth_bytes"] == PEAKS["c"]
    log.clear()
    _step(plan, device, PEAKS)
    assert log == []  # all awake and all fit: switches cost nothing


def test_always_sleeps_on_every_switch():
    log: list = []
    plan, device = _cycle_plan(log, capacity=10_000, offload="always")
    _step(plan, device, PEAKS)
    log.clear()
    records = _step(plan, device, PEAKS)
    assert _sleeps(log) == ["c", "a", "b"]
    assert [r.kept_awake for r in records] == [(), (), ()]
    assert plan.metrics()["placement/c/kept_awake"] == 0.0
    assert plan.metrics()["placement/c/peak_growth_bytes"] == 0.0


@pytest.mark.parametrize(
    ("peak_c", "kept", "slept"),
    [(650, ("a",), ["b"]), (950, (), ["b", "a"])],
    ids=["one-sleep-is-enough", "all-must-sleep"],
)
def test_a_grown_peak_sleeps_only_as_many_roles_as_needed(peak_c, kept, slept):
    log: list = []
    plan, device = _cycle_plan(log, capacity=2000, headroom=500)
    _step(plan, device, PEAKS)
    _step(plan, device, PEAKS)
    assert device.used() == 1000  # all three awake
    _step(plan, device, PEAKS | {"c": peak_c})  # c's peak grows; this time it still fit
    log.clear()
    _step(plan, device, PEAKS)
    # c now needs peak_c + 500 free, 1000 are. Phase a came after c last time, so b (not needed
    # next) sleeps first although a is larger; a sleeps only when b's room is not enough.
    assert _sleeps(log) == slept
    record = plan.records[-1]
    assert record.phase == "c" and record.kept_awake == kept
    assert device.free_bytes() >= peak_c + 500
    assert plan.metrics()["placement/c/peak_growth_bytes"] == peak_c


def test_without_a_following_need_the_largest_role_sleeps_first():
    log: list = []
    roles = {
        "a": RecordingRole("a", log, {"weights": 100}),
        "b": RecordingRole("b", log, {"weights": 100, "kv_cache": 200}),
        "c": RecordingRole("c", log, {"weights": 200}),
    }
    device = FakeDevice(1000, list(roles.values()))
    plan = Plan(
        roles=roles,
        phases={"all": ["a", "b", "c"], "p": ["a"], "q": ["a"]},
        offload="auto",
        fit=device.fit(),
    )
    peaks = {"all": 0, "p": 400, "q": 0}
    for _ in range(2):
        for phase in ("all", "p", "q"):
            log.clear()
            with plan.phase(phase):
                device.run(peaks[phase])
            if phase == "p":
                sleeps_in_p = _sleeps(log)
    # In the second p, b and c are awake and 400 bytes free; p needs 410. q, which follows p,
    # needs neither, so the larger one (b, 300) sleeps, and that is enough.
    assert sleeps_in_p == ["b"]
    assert plan.metrics()["placement/p/kept_awake_bytes"] == 200.0


def test_partial_colocation_applies_a_moved_split_with_auto():
    log: list = []
    rollout = RecordingRole("rollout", log, {"weights": 100, "kv_cache": 300})
    genrm = RecordingRole("genrm", log, {"weights": 50, "kv_cache": 150})
    train = RecordingRole("train", log, {"weights": 400, "optimizer": 400})
    device = FakeDevice(100_000, [rollout, genrm, train])
    split = MemorySplit(
        total_fraction=0.8, min_rollout_fraction=0.25, max_rollout_fraction=0.75, smoothing=0.0
    )
    plan = Plan.partial_colocation(
        rollout=rollout, genrm=genrm, train=train, split=split, offload="auto", fit=device.fit()
    )
    assert rollout.fraction == pytest.approx(0.4) and genrm.fraction == pytest.approx(0.4)
    phases = ("rollout", "genrm", "train", "sync")
    for _ in range(2):
        records = {name: plan.switch_to(name) for name in phases}
    # Second step: the engines' KV caches woke at the current shares, so they stay awake.
    assert records["train"].kept_awake == ("rollout", "genrm")
    plan.update_load(rollout_pending_tokens=900, genrm_pending_tokens=100)
    log.clear()
    records = {name: plan.switch_to(name) for name in phases}
    # The shares moved: the engines sleep when the trainer comes, though they would fit, so
    # their KV caches wake at the new sizes.
    assert records["train"].kept_awake == ()
    assert _sleeps(log) == ["rollout", "genrm"]
    plan.switch_to("rollout")
    assert rollout.kv_fraction == pytest.approx(0.6)
    assert genrm.kv_fraction == pytest.approx(0.2)
    records = {name: plan.switch_to(name) for name in phases}
    assert records["train"].kept_awake == ("rollout", "genrm")


def test_an_engine_that_resizes_while_awake_is_kept_through_a_moved_split():
    log: list = []
    rollout = RecordingRole("rollout", log, {"weights": 100, "kv_cache": 300})
    genrm = RecordingRole("genrm", log, {"weights": 50, "kv_cache": 150})
    rollout.resizes_while_awake = True  # e.g. the built-in engine: resizes at its next call
    train = RecordingRole("train", log, {"weights": 400, "optimizer": 400})
    device = FakeDevice(100_000, [rollout, genrm, train])
    plan = Plan.partial_colocation(
        rollout=rollout, genrm=genrm, train=train, offload="auto", fit=device.fit()
    )
    phases = ("rollout", "genrm", "train", "sync")
    for _ in range(2):
        for name in phases:
            plan.switch_to(name)
    plan.update_load(rollout_pending_tokens=900, genrm_pending_tokens=100)
    log.clear()
    records = {name: plan.switch_to(name) for name in phases}
    assert records["train"].kept_awake == ("rollout",)  # genrm cannot resize awake: it sleeps
    assert _sleeps(log) == ["genrm"]


def test_bad_offload_and_fit_values_are_refused():
    log: list = []
    roles = {"a": RecordingRole("a", log, {"weights": 1})}
    with pytest.raises(ValueError, match="offload='sometimes'"):
        Plan(roles=roles, phases={"p": ["a"]}, offload="sometimes")
    with pytest.raises(ValueError, match="offload='never'"):
        Plan.full_colocation(rollout=roles["a"], train=roles["a"], offload="never")
    # With offload="always" a FitConfig only feeds the readings (the memory timeline).
    plan = Plan(roles=roles, phases={"p": ["a"]}, fit=FitConfig(headroom_bytes=0))
    assert plan.metrics()["placement/headroom_bytes"] == 0.0
    with pytest.raises(ValueError, match="headroom_bytes=-1"):
        FitConfig(headroom_bytes=-1)


def test_auto_without_a_memory_reading_acts_as_always(caplog):
    log: list = []
    roles = _cycle_roles(log)
    device = FakeDevice(10_000, list(roles.values()))
    with caplog.at_level(logging.INFO, logger="yatt.placement._fit"):
        plan = Plan(roles=roles, phases={"a": ["a"], "b": ["b"], "c": ["c"]}, offload="auto")
    assert "FitConfig(free_bytes=...)" in caplog.text
    _step(plan, device, PEAKS)
    log.clear()
    _step(plan, device, PEAKS)
    assert _sleeps(log) == ["c", "a", "b"]
