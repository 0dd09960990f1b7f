"""offload="auto" never runs out of memory on a fake device with a caching allocator (issue 27):
the allocator's cache released before a wake, reported peaks counted before anything is
measured, the headroom kept, and a phase that cannot fit refused before the step."""

import pytest
import torch

from yatt.placement import FitConfig, MemoryFitError, MemoryNeed, Plan, TrainerRole
from yatt.placement._fit import FitBooks
from yatt.placement.testing import FakeDevice, FakeOutOfMemory, RecordingRole

NUM_GPUS = 0
PHASES = ("rollout", "genrm", "train", "sync")


@pytest.fixture(autouse=True)
def _no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    # On a GPU host the default readers would read the real device; these tests drive fakes.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _roles(log, device, *, train_peak=None, engine_peak=None):
    """A 400-byte engine, a 200-byte judge and a 400-byte trainer on `device`."""
    settings = {"activations": "TorchPolicyConfig.max_tokens_per_microbatch=16384"}
    return dict(
        rollout=RecordingRole(
            "rollout", log, {"weights": 100, "kv_cache": 300}, peak=engine_peak, device=device
        ),
        genrm=RecordingRole(
            "genrm", log, {"weights": 50, "kv_cache": 150}, peak=engine_peak, device=device
        ),
        train=RecordingRole(
            "train",
            log,
            {"weights": 200, "optimizer": 200},
            peak=train_peak,
            settings=settings,
            device=device,
        ),
    )


def _step(plan: Plan, device: FakeDevice, peaks: dict[str, int]) -> dict:
    records = {}
    for phase in PHASES:
        with plan.phase(phase) as record:
            device.run(peaks.get(phase, 0))
        records[phase] = record
    return records


TRAIN_PEAK = {"train": 1300}  # activations: more than the roles' 1000 bytes together


def test_a_wake_beside_the_previous_phases_cached_activations_gets_the_cache_back():
    # Issue 27's crash: the train phase's activations stay in torch's cache; in the next step
    # auto keeps the trainer awake for the rollout (1500 bytes would be free by torch's count)
    # but the engine's KV cache can only wake in memory the device hands out: 200 bytes.
    log: list = []
    device = FakeDevice(2000)
    roles = _roles(log, device)
    never_released = FitConfig(
        free_bytes=device.free_bytes,
        peak_growth=device.peak_growth,
        headroom_bytes=10,
        release_cache=lambda: None,  # the switch's release, taken away
    )
    plan = Plan.full_colocation(**roles, offload="auto", fit=never_released)
    _step(plan, device, TRAIN_PEAK)
    with pytest.raises(FakeOutOfMemory, match="cached by the allocator"):
        _step(plan, device, TRAIN_PEAK)

    log.clear()
    device = FakeDevice(2000)
    plan = Plan.full_colocation(**_roles(log, device), offload="auto", fit=device.fit())
    for _ in range(3):
        records = _step(plan, device, TRAIN_PEAK)
    assert records["rollout"].kept_awake == ("train",)  # kept, and the wake still fit
    assert device.num_empty_cache > 0


def test_reported_peaks_plan_the_first_step():
    log: list = []
    device = FakeDevice(2000)
    roles = _roles(log, device, train_peak={"activations": 1300}, engine_peak={})
    plan = Plan.full_colocation(**roles, offload="auto", fit=device.fit(headroom=10))
    records = _step(plan, device, TRAIN_PEAK)  # raises FakeOutOfMemory if anything is short
    # Nothing measured, but every role reports: no need to sleep everything as "always" does.
    assert records["rollout"].kept_awake == ("genrm", "train")
    # Train: 1300 + 10 with 2000 - 1000 free. Nothing known of what follows yet, so the
    # largest (the engine, 400) sleeps first, and that is enough.
    assert records["train"].kept_awake == ("genrm",)
    assert (records["train"].need_bytes, records["train"].free_bytes) == (1310, 2000 - 600)


def test_the_train_phase_peak_sleeps_the_roles_not_needed_next_first():
    log: list = []
    device = FakeDevice(2000)
    roles = _roles(log, device, train_peak={"activations": 1300}, engine_peak={})
    plan = Plan.full_colocation(**roles, offload="auto", fit=device.fit(headroom=10))
    _step(plan, device, TRAIN_PEAK)
    for phase in ("rollout", "genrm"):
        plan.switch_to(phase)
    assert {name for name, role in roles.items() if role.awake} == set(roles)
    log.clear()
    plan.switch_to("train")
    # Sync follows and needs the engine's weights: the judge sleeps first, then the engine,
    # since 1310 do not fit beside it (2000 - 800 = 1200).
    assert log == [("genrm", "sleep"), ("rollout", "sleep")]
    device.run(1300)


def test_a_wake_that_would_not_fit_sleeps_what_it_must_first():
    log: list = []
    device = FakeDevice(1000)  # the three roles fill it exactly
    roles = _roles(log, device, train_peak={"activations": 500}, engine_peak={})
    plan = Plan.full_colocation(**roles, offload="auto", fit=device.fit(headroom=10))
    for _ in range(2):
        _step(plan, device, {"train": 500})
    plan.switch_to("rollout")
    log.clear()
    plan.switch_to("genrm")
    # The judge (200) wakes beside the trainer and the engine (800 held): 10 short of its
    # headroom. Train follows and needs the trainer, so the engine sleeps, before the wake.
    assert log == [
        ("rollout", "sleep"),
        ("genrm", "wake", ("weights",)),
        ("genrm", "wake", ("kv_cache",)),
    ]
    assert plan.records[-1].kept_awake == ("train",)


def test_a_measured_peak_above_the_report_counts():
    log: list = []
    device = FakeDevice(2305)
    # The trainer under-reports (100); its measured 1300 must decide from the second step on.
    roles = _roles(log, device, train_peak={"activations": 100}, engine_peak={})
    plan = Plan.full_colocation(**roles, offload="auto", fit=device.fit(headroom=10))
    first = _step(plan, device, TRAIN_PEAK)
    assert first["train"].kept_awake == ("rollout", "genrm")  # 110 fit: the report misled
    second = _step(plan, device, TRAIN_PEAK)
    # 1310 > 2305 - 1000: the judge (not needed by sync) sleeps; the report alone would not.
    assert second["train"].need_bytes == 1310
    assert second["train"].kept_awake == ("rollout",)


@pytest.mark.parametrize(
    ("headroom", "kept"), [(400, ("genrm",)), (401, ())], ids=["fits", "one-byte-short"]
)
def test_the_headroom_is_kept_free(headroom, kept):
    # Train needs its 1000-byte peak + headroom with 1000 free; after the engine (400, the
    # largest) sleeps, 1400 are: enough at a headroom of 400, one byte short at 401.
    log: list = []
    device = FakeDevice(2000)
    roles = _roles(log, device, train_peak={"activations": 1000}, engine_peak={})
    plan = Plan.full_colocation(**roles, offload="auto", fit=device.fit(headroom=headroom))
    plan.switch_to("rollout")
    plan.switch_to("genrm")
    record = plan.switch_to("train")
    assert record.kept_awake == kept
    assert record.need_bytes == 1000 + headroom
    assert record.free_bytes >= record.need_bytes


def test_a_phase_that_cannot_fit_is_refused_before_anything_moves():
    log: list = []
    device = FakeDevice(2000)
    roles = _roles(log, device, train_peak={"activations": 1700}, engine_peak={})
    plan = Plan.full_colocation(**roles, offload="auto", fit=device.fit(headroom=10))
    with pytest.raises(MemoryFitError) as error:
        plan.switch_to("rollout")
    message = str(error.value)
    # 400 resident + 1700 activations + 10 headroom = 2110 > 2000, everything else asleep.
    assert message.startswith("phase 'train' needs 2110 bytes")
    assert "110 bytes too many" in message
    line = next(line for line in message.splitlines() if "train activations" in line)
    assert "1700 bytes; change TorchPolicyConfig.max_tokens_per_microbatch=16384" in line
    assert "phase 'sync'" not in message  # sync counts no activations (peak_phases)
    assert log == []  # nothing slept or woke
    # A smaller peak passes the check, which reports every phase's need.
    device = FakeDevice(2000)
    roles = _roles([], device, train_peak={"activations": 1500}, engine_peak={})
    plan = Plan.full_colocation(**roles, offload="auto", fit=device.fit(headroom=10))
    fits = {fit.phase: fit for fit in plan.check_fit()}
    assert fits["train"].need_bytes == 400 + 1500 + 10
    assert fits["sync"].need_bytes == 400 + 100 + 10  # the trainer + the engine's weights
    assert fits["rollout"].need_bytes == 400 + 10
    assert fits["genrm"].need_bytes == 200 + 10


def test_check_fit_skips_phases_with_roles_that_do_not_report():
    device = FakeDevice(100)  # far too small, but nothing reports: nothing to refuse
    plan = Plan.full_colocation(**_roles([], device), offload="auto", fit=device.fit())
    assert plan.check_fit() == []


def test_the_timeline_shows_each_role_per_phase():
    log: list = []
    device = FakeDevice(2000)
    roles = _roles(log, device, train_peak={"activations": 1300}, engine_peak={})
    plan = Plan.full_colocation(**roles, offload="auto", fit=device.fit(headroom=10))
    for _ in range(2):
        _step(plan, device, TRAIN_PEAK)
    plan.sleep_all()  # ends the last phase's measurement
    m = plan.metrics()
    assert m["placement/train/role/train/resident_bytes"] == 400.0
    assert m["placement/train/role/rollout/is_awake"] == 0.0
    assert m["placement/train/role/rollout/asleep_bytes"] == 400.0  # its report
    assert m["placement/train/peak_bytes"] == 400.0 + 1300.0
    assert m["placement/train/need_bytes"] == 1310.0
    assert m["placement/rollout/role/train/is_awake"] == 1.0  # kept beside the engine
    assert m["placement/headroom_bytes"] == 10.0


def test_a_role_that_grew_since_its_first_wake_is_counted_whole():
    # The optimizer's state is made in the first train step, so the first wake of "optimizer"
    # measured nothing. Once the trainer has slept whole (releasing 1000), that stale wake
    # must not be what its next wake is planned by.
    books = FitBooks(
        FitConfig(free_bytes=lambda: 0, peak_growth=lambda: 0, headroom_bytes=0), lambda: 0
    )
    calls = [("train", ("weights",)), ("train", ("optimizer",))]
    books.record_wake(calls[0], 200)
    books.record_wake(calls[1], 0)
    books.start_phase("train")
    books.end_phase()  # growth 0
    assert books.need_bytes("train", calls, {}) == 200
    books.record_sleep("train", 1000)
    assert books.need_bytes("train", calls, {}) == 1000
    # A report larger than the measurement wins; a smaller one does not.
    assert books.need_bytes("train", calls, {}, reported_wake=dict.fromkeys(calls, 600)) == 1200
    assert books.need_bytes("train", calls, {}, reported_wake=dict.fromkeys(calls, 100)) == 1000


def test_trainer_role_reports_adam_state_before_it_exists():
    model = torch.nn.Linear(4, 3)  # 15 float32 parameters: 60 bytes
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    assert TrainerRole(model, optimizer).memory_need() is None  # no activation estimate
    role = TrainerRole(model, optimizer, activation_bytes=lambda: 1000)
    need = role.memory_need()
    assert need == MemoryNeed(
        resident={"weights": 60, "optimizer": 120},  # two moments, not made yet
        peak={"gradients": 60, "activations": 1000},
    )
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    # Made now: two moments (120 bytes) and a float32 step count per parameter (2 x 4 bytes).
    assert role.memory_need().resident["optimizer"] == 128
    role.sleep()
    assert role.memory_need().resident == {"weights": 60, "optimizer": 128}
    # Activations smaller than the optimizer step's parameter-sized temporaries: those count.
    small = TrainerRole(model, optimizer, activation_bytes=10).memory_need()
    assert small.peak == {"gradients": 60, "optimizer step": 60}


def test_derived_capacity_counts_torchs_cached_blocks_as_free(monkeypatch):
    # A 100-byte device: the driver sees 40 free; 20 more sit cached unused in torch's default
    # pool (free to the free-bytes reader); the roles hold 30. Not the roles': used 60, less
    # the 20 cached, less the roles' 30 = 10, so the roles may hold 90 (the driver's view alone
    # would give 70 and refuse a phase of 80 that fits).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *device: (40, 100))
    books = FitBooks(FitConfig(free_bytes=lambda: 60, peak_growth=lambda: 0), meter=lambda: 0)
    assert books.capacity_bytes(30) == 90
    # the cache never makes the driver's free count smaller
    books = FitBooks(FitConfig(free_bytes=lambda: 10, peak_growth=lambda: 0), meter=lambda: 0)
    assert books.capacity_bytes(30) == 100 - (60 - 30)
