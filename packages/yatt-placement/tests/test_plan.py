import pytest
import torch

from yatt.placement import (
    MemorySplit,
    Plan,
    RegionRole,
    TrainerRole,
    is_offloaded,
    region,
    resident_bytes,
)
from yatt.placement.testing import RecordingRole

NUM_GPUS = 0

pytestmark = pytest.mark.usefixtures("cpu_regions")


@pytest.fixture(autouse=True)
def _books_meter(monkeypatch: pytest.MonkeyPatch) -> None:
    # On a GPU host the default meter reads the device; these tests check the roles' books.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


class Tagless:
    def __init__(self, log: list) -> None:
        self.log = log

    def sleep(self) -> None:
        self.log.append(("tagless", "sleep"))

    def wake_up(self, tags=None) -> None:
        self.log.append(("tagless", "wake", tags))


def _engines(log):
    rollout = RecordingRole("rollout", log, {"weights": 100, "kv_cache": 300})
    genrm = RecordingRole("genrm", log, {"weights": 50, "kv_cache": 150})
    train = RecordingRole("train", log, {"weights": 400, "kv_cache": 0})
    return rollout, genrm, train


def test_full_colocation_keeps_one_role_awake_per_phase():
    log: list = []
    rollout, genrm, train = _engines(log)
    plan = Plan.full_colocation(rollout=rollout, genrm=genrm, train=train)
    assert plan.phases == ("rollout", "genrm", "train", "sync")
    with plan.phase("rollout") as record:
        assert plan.current_phase == "rollout"
    assert log == [("genrm", "sleep"), ("train", "sleep")]
    assert (record.resident_bytes, record.released_bytes, record.woken_bytes) == (400, 600, 0)

    log.clear()
    with plan.phase("genrm") as record:
        pass
    # Weights before KV cache.
    assert log == [
        ("rollout", "sleep"),
        ("genrm", "wake", ("weights",)),
        ("genrm", "wake", ("kv_cache",)),
    ]
    assert (record.resident_bytes, record.released_bytes, record.woken_bytes) == (200, 400, 200)

    log.clear()
    with plan.phase("train"):
        pass
    with plan.phase("sync"):
        pass
    # Sync wakes only the rollout weights next to the trainer; rollout then adds the KV cache.
    assert log[-1] == ("rollout", "wake", ("weights",))
    assert rollout.awake == {"weights"}
    log.clear()
    with plan.phase("rollout"):
        pass
    assert log == [("train", "sleep"), ("rollout", "wake", ("kv_cache",))]


def test_wake_stages_cross_roles_and_leftover_tags_come_last():
    log: list = []
    rollout, genrm, _ = _engines(log)
    trainer_like = RecordingRole("t2", log, {"weights": 1, "optimizer": 1, "kv_cache": 0})
    trainer_like.memory_tags = ("optimizer", "weights")
    plan = Plan(
        roles={"a": rollout, "b": genrm, "c": trainer_like, "d": Tagless(log)},
        phases={"all": ["a", "b", "c", "d"], "none": []},
    )
    plan.switch_to("none")
    log.clear()
    plan.switch_to("all")
    assert log == [
        ("rollout", "wake", ("weights",)),
        ("genrm", "wake", ("weights",)),
        ("t2", "wake", ("weights",)),
        ("tagless", "wake", None),
        ("rollout", "wake", ("kv_cache",)),
        ("genrm", "wake", ("kv_cache",)),
        ("t2", "wake", ("optimizer",)),
    ]


def test_separate_never_sleeps_and_reentering_a_phase_is_free():
    log: list = []
    rollout, genrm, train = _engines(log)
    plan = Plan.separate(rollout=rollout, genrm=genrm, train=train)
    for name in ("rollout", "genrm", "train", "sync", "rollout"):
        with plan.phase(name) as record:
            assert record.released_bytes == 0 and record.woken_bytes == 0
    assert log == []
    assert record.resident_bytes == 400 + 200 + 400


def test_metrics_have_fixed_keys_and_count_switches():
    log: list = []
    rollout, _, train = _engines(log)
    plan = Plan.full_colocation(rollout=rollout, train=train)
    before = plan.metrics()
    assert set(before) == {
        f"placement/{phase}/{key}"
        for phase in ("rollout", "train", "sync")
        for key in (
            "switch_s",
            "sleep_s",
            "wake_s",
            "released_bytes",
            "woken_bytes",
            "resident_bytes",
            "num_switches",
            "kept_awake",
            "kept_awake_bytes",
            "peak_growth_bytes",
            "peak_bytes",
            "need_bytes",
            "free_bytes",
        )
    } | {
        f"placement/{phase}/role/{role}/{key}"
        for phase in ("rollout", "train", "sync")
        for role in ("rollout", "train")
        for key in ("resident_bytes", "asleep_bytes", "is_awake")
    } | {"placement/headroom_bytes"}
    for name in ("train", "rollout", "train"):
        with plan.phase(name):
            pass
    after = plan.metrics()
    assert set(after) == set(before)
    assert all(isinstance(v, float) for v in after.values())
    assert after["placement/train/num_switches"] == 2.0
    assert after["placement/train/kept_awake"] == 0.0  # offload="always" keeps nobody awake
    assert after["placement/train/resident_bytes"] == 400.0
    assert after["placement/train/released_bytes"] == 400.0  # the rollout's weights + KV
    assert after["placement/rollout/switch_s"] >= after["placement/rollout/wake_s"] >= 0.0
    # The timeline: who is on the device in each phase, and what the asleep one would take.
    assert after["placement/train/role/train/resident_bytes"] == 400.0
    assert after["placement/train/role/train/is_awake"] == 1.0
    assert after["placement/train/role/rollout/is_awake"] == 0.0
    assert after["placement/train/role/rollout/resident_bytes"] == 0.0
    assert after["placement/rollout/role/rollout/resident_bytes"] == 400.0
    assert after["placement/rollout/role/train/is_awake"] == 0.0
    assert after["placement/sync/role/train/is_awake"] == 0.0  # never entered: zeros
    assert [r.phase for r in plan.records] == ["train", "rollout", "train"]


def test_phase_misuse_errors():
    log: list = []
    rollout, _, train = _engines(log)
    plan = Plan.full_colocation(rollout=rollout, train=train)
    with pytest.raises(ValueError, match="'genrm' is not in this plan"):
        plan.switch_to("genrm")
    with (
        plan.phase("train"),
        pytest.raises(RuntimeError, match="do not nest"),
        plan.phase("rollout"),
    ):
        pass
    assert plan.current_phase is None
    assert rollout.awake == set()  # the refused phase woke nothing
    with pytest.raises(ValueError, match="without sleep"):
        Plan(roles={"x": object()}, phases={"p": ["x"]})
    with pytest.raises(ValueError, match="names role 'y'"):
        Plan(roles={"x": rollout}, phases={"p": ["y"]})
    with pytest.raises(ValueError, match="memory_tags=None"):
        Plan(roles={"x": Tagless(log)}, phases={"p": [("x", ("weights",))]})
    with pytest.raises(RuntimeError, match="partial_colocation"):
        plan.update_load(rollout_pending_tokens=1, genrm_pending_tokens=1)


def test_roles_sharing_a_memory_region_are_refused():
    """Regions pause by name: a judge engine in the rollout engine's region would put the
    rollout engine to sleep with it (a judge engine config that lost its region_prefix)."""
    rollout = RegionRole({"weights": ("rollout/weights",), "kv_cache": ("rollout/kv_cache",)})
    judge = RegionRole({"weights": ("rollout/weights",), "kv_cache": ("genrm/kv_cache",)})
    train = RecordingRole("train", [], {"weights": 400, "kv_cache": 0})
    with pytest.raises(
        ValueError, match="'rollout' and 'genrm' share the memory region 'rollout/weights'"
    ):
        Plan.full_colocation(rollout=rollout, genrm=judge, train=train)
    judge = RegionRole({"weights": ("genrm/weights",), "kv_cache": ("genrm/kv_cache",)})
    assert Plan.full_colocation(rollout=rollout, genrm=judge, train=train).mode == "full_colocation"


def test_partial_colocation_keeps_engines_together_and_splits_by_load():
    log: list = []
    rollout, genrm, train = _engines(log)
    split = MemorySplit(
        total_fraction=0.8, min_rollout_fraction=0.25, max_rollout_fraction=0.75, smoothing=0.0
    )
    plan = Plan.partial_colocation(rollout=rollout, genrm=genrm, train=train, split=split)
    assert rollout.fractions == [pytest.approx(0.4)] and genrm.fractions == [pytest.approx(0.4)]
    with plan.phase("rollout"):
        pass
    with plan.phase("genrm"):
        pass
    assert log == [("train", "sleep")]
    assert plan.update_load(rollout_pending_tokens=900, genrm_pending_tokens=100) == 0.75
    assert rollout.fractions[-1] == pytest.approx(0.6)
    assert genrm.fractions[-1] == pytest.approx(0.2)
    assert plan.update_load(rollout_pending_tokens=300, genrm_pending_tokens=700) == 0.3
    metrics = plan.metrics()
    assert metrics["placement/rollout_memory_fraction"] == pytest.approx(0.24)
    assert metrics["placement/genrm_memory_fraction"] == pytest.approx(0.56)
    with plan.phase("train"):
        pass
    assert log[-4:-2] == [("rollout", "sleep"), ("genrm", "sleep")]


def test_real_roles_on_the_bookkeeping_backend():
    torch.manual_seed(0)
    with region("engine/weights", enable_cpu_backup=True):
        engine_model = torch.nn.Linear(32, 32)
    with region("engine/kv"):
        kv = torch.zeros(4096)
    engine = RegionRole({"weights": ("engine/weights",), "kv_cache": ("engine/kv",)})
    model = torch.nn.Linear(16, 16)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    optimizer.step()
    trainer = TrainerRole(model, optimizer)
    trainer_bytes = trainer.resident_bytes()
    engine_bytes = engine.resident_bytes()
    assert engine_bytes == resident_bytes("engine/weights") + 4 * 4096

    plan = Plan.full_colocation(rollout=engine, train=trainer)
    weight = engine_model.weight.detach().clone()
    with plan.phase("train") as record:
        assert resident_bytes("engine/kv") == 0
    assert record.released_bytes == engine_bytes and record.resident_bytes == trainer_bytes
    with plan.phase("sync") as record:
        # Only the engine's weights joined the trainer.
        assert record.woken_bytes == resident_bytes("engine/weights")
        assert torch.equal(engine_model.weight, weight)
    with plan.phase("rollout") as record:
        assert is_offloaded(model) and is_offloaded(optimizer)
    assert record.resident_bytes == engine_bytes
    assert record.released_bytes == trainer_bytes
    plan.sleep_all()
    assert engine.resident_bytes() == 0
    del kv


def test_trainer_role_wakes_weights_apart_from_optimizer():
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(1, 4)).sum().backward()
    optimizer.step()
    role = TrainerRole(model, optimizer)
    role.sleep()
    assert role.resident_bytes() == 0
    role.wake_up(tags=("weights",))
    assert not is_offloaded(model) and is_offloaded(optimizer)
    with pytest.raises(ValueError, match="not in memory_tags"):
        role.wake_up(tags=("kv_cache",))
    with pytest.raises(ValueError, match="takes a sequence"):
        role.wake_up(tags="optimizer")
    role.wake_up()
    assert not is_offloaded(optimizer)


def test_trainer_role_asleep_before_its_first_step_still_reports_adamw_state():
    # AdamW keeps two float32 moments per trainable parameter (Loshchilov & Hutter); put to
    # sleep before the first step, the optimizer holds nothing yet, but the step will make them.
    model = torch.nn.Linear(8, 4)  # 36 float32 parameters
    role = TrainerRole(model, torch.optim.AdamW(model.parameters()), activation_bytes=0)
    expected = 2 * 4 * 36
    assert role.optimizer_state_bytes() == expected
    role.sleep()
    assert role.optimizer_state_bytes() == expected
    need = role.memory_need()
    assert need is not None and need.resident["optimizer"] == expected


def test_full_colocation_with_a_tagless_engine_syncs_it_whole():
    log: list = []
    _, _, train = _engines(log)
    plan = Plan.full_colocation(rollout=Tagless(log), train=train)
    plan.switch_to("train")
    log.clear()
    plan.switch_to("sync")
    assert log == [("tagless", "wake", None)]


def test_is_resident_together_follows_the_phases_not_the_mode_name():
    log: list = []
    rollout, genrm, train = _engines(log)
    full = Plan.full_colocation(rollout=rollout, genrm=genrm, train=train)
    partial = Plan.partial_colocation(rollout=rollout, genrm=genrm, train=train)
    separate = Plan.separate(rollout=rollout, genrm=genrm, train=train)
    assert not full.is_resident_together("rollout", "genrm")
    assert partial.is_resident_together("rollout", "genrm")
    assert not partial.is_resident_together("rollout", "train")
    assert separate.is_resident_together("rollout", "genrm", "train")
    # Sync wakes only the rollout's weights beside the trainer: not the whole engine.
    assert not full.is_resident_together("train", "rollout")
    custom = Plan(roles={"rollout": rollout, "genrm": genrm}, phases={"both": ["rollout", "genrm"]})
    assert custom.is_resident_together("genrm", "rollout")
    with pytest.raises(ValueError, match="roles are"):
        full.is_resident_together("rollout", "judge")
    assert log == []  # asking switches nothing


@pytest.mark.parametrize("factory", ["full_colocation", "partial_colocation"])
def test_reference_policy_is_awake_in_the_train_phase_only(factory):
    log: list = []
    rollout, genrm, train = _engines(log)
    reference = RecordingRole("reference", log, {"weights": 400, "kv_cache": 0})
    plan = getattr(Plan, factory)(rollout=rollout, genrm=genrm, train=train, reference=reference)
    with plan.phase("rollout"):
        assert not reference.awake and ("reference", "sleep") in log
    log.clear()
    with plan.phase("train"):
        assert reference.awake == {"weights", "kv_cache"} and train.awake
    assert ("reference", "wake", ("weights",)) in log
    with plan.phase("sync"):
        assert not reference.awake  # only the trainer and the engine's weights
    assert plan.is_resident_together("train", "reference")
    assert plan.has_memory_split == (factory == "partial_colocation")
    assert not plan.is_resident_together("rollout", "reference")
