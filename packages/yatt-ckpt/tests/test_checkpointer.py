"""Save/load round trips, async staging semantics, RNG and extra, atomic layout."""

NUM_GPUS = 0

import json
import random
import threading

import numpy as np
import pytest
import torch
from torch import nn

from yatt.ckpt import Checkpointer, CheckpointError, CkptConfig


def build(
    seed: int,
) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3))
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)
    return model, optim, sched


def train_steps(model, optim, sched, num_steps: int) -> None:
    for _ in range(num_steps):
        loss = model(torch.randn(4, 6)).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        sched.step()


def visible_names(root) -> list[str]:
    """The entries of `root` but the writer's hidden lock file."""
    return sorted(p.name for p in root.iterdir() if p.name != ".yatt-ckpt-writer.lock")


def state_of(model, optim, sched, counter) -> dict:
    return {"model": model, "optim": optim, "sched": sched, "counter": counter}


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_round_trip_restores_model_optimizer_scheduler_tensor_and_extra(tmp_path, async_save):
    model, optim, sched = build(0)
    train_steps(model, optim, sched, 3)
    counter = torch.tensor([7, 8, 9])
    extra = {"config": {"lr": 0.05}, "loader": [3, 14]}
    with Checkpointer(tmp_path, async_save=async_save) as ckpt:
        ckpt.save(3, state_of(model, optim, sched, counter), extra=extra)
    fresh_model, fresh_optim, fresh_sched = build(1)
    fresh_counter = torch.zeros(3, dtype=torch.int64)
    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.latest() == 3
        assert (ckpt.step_path(3) / ".metadata").is_file()  # a DCP folder, for export tools
        with pytest.raises(CheckpointError, match="step 2 has no committed checkpoint"):
            ckpt.step_path(2)
        got = ckpt.load(state_of(fresh_model, fresh_optim, fresh_sched, fresh_counter))
    assert got == extra
    for (name, want), got_param in zip(
        model.state_dict().items(), fresh_model.state_dict().values(), strict=True
    ):
        assert torch.equal(want, got_param), name
    want_optim, got_optim = optim.state_dict(), fresh_optim.state_dict()
    for pid, want_state in want_optim["state"].items():
        for key, value in want_state.items():
            assert torch.equal(value, got_optim["state"][pid][key]), (pid, key)
    assert fresh_sched.state_dict() == sched.state_dict()
    assert fresh_optim.param_groups[0]["lr"] == optim.param_groups[0]["lr"]
    assert torch.equal(fresh_counter, counter)


def test_async_save_snapshots_at_call_time(tmp_path):
    model, optim, sched = build(0)
    train_steps(model, optim, sched, 1)
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"model": model})
        # The trainer may modify parameters as soon as save() returns.
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-3.0).add_(1.0)
        ckpt.wait()
        restored, _, _ = build(5)
        ckpt.load({"model": restored})
    for key, value in restored.state_dict().items():
        assert torch.equal(value, snapshot[key]), key


def test_extra_is_a_snapshot_at_call_time_and_a_callable_is_called_once(tmp_path, monkeypatch):
    import yatt.ckpt._checkpointer as checkpointer_module

    release = threading.Event()
    write = checkpointer_module.write_and_commit

    def held_write(*args, **kwargs):
        assert release.wait(30), "the test never released the writer"
        write(*args, **kwargs)

    monkeypatch.setattr(checkpointer_module, "write_and_commit", held_write)
    model, _, _ = build(0)
    extra = {"groups": [[1, 2], [3]], "keep_rate": 0.5}
    calls = []

    def build_extra() -> dict:
        calls.append(1)
        return {"groups": [list(g) for g in extra["groups"]], "keep_rate": extra["keep_rate"]}

    with Checkpointer(tmp_path, keep_last=5) as ckpt:
        ckpt.save(1, {"model": model}, extra=extra)
        # The trainer changes its state as soon as save() returns; the write has not started.
        extra["groups"][0].append(9)
        extra["keep_rate"] = 0.25
        release.set()
        ckpt.wait()
        ckpt.save(2, {"model": model}, extra=build_extra)  # built now: the state of step 2
        ckpt.wait()
        assert ckpt.load({"model": model}, step=1) == {"groups": [[1, 2], [3]], "keep_rate": 0.5}
        want = {"groups": [[1, 2, 9], [3]], "keep_rate": 0.25}
        assert ckpt.load({"model": model}, step=2) == want
    assert len(calls) == 1


def test_rng_states_restored_on_load(tmp_path):
    model, _, _ = build(0)
    random.seed(11)
    np.random.seed(12)
    torch.manual_seed(13)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"model": model})
        want = (random.random(), np.random.rand(), torch.rand(3))
        random.seed(99)
        np.random.seed(99)
        torch.manual_seed(99)
        ckpt.load({"model": model})
        got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == want[0]
    assert got[1] == want[1]
    assert torch.equal(got[2], want[2])


def test_second_save_waits_for_first_and_both_commit(tmp_path, monkeypatch):
    import yatt.ckpt._writer as impl

    entered, release = threading.Event(), threading.Event()
    real_commit = impl.commit
    committed = []

    def slow_commit(root, tmp, step):
        if step == 1:
            entered.set()
            assert release.wait(30)
        real_commit(root, tmp, step)
        committed.append(step)

    monkeypatch.setattr(impl, "commit", slow_commit)
    model, _, _ = build(0)
    ckpt = Checkpointer(tmp_path, keep_last=5)
    try:
        ckpt.save(1, {"model": model})
        assert entered.wait(30)
        assert ckpt.latest() is None  # step 1 is held back just before its commit rename
        assert visible_names(tmp_path) == ["step-00000001.tmp"]
        second = threading.Thread(target=ckpt.save, args=(2, {"model": model}))
        second.start()
        second.join(0.5)
        assert second.is_alive(), "a second save must wait for the one in flight"
    finally:
        release.set()
    second.join(30)
    assert committed[0] == 1
    ckpt.close()
    assert committed == [1, 2]
    assert ckpt.latest() == 2
    assert (tmp_path / "latest").read_text().strip() == "step-00000002"


def test_layout_meta_and_verify(tmp_path):
    model, _, _ = build(0)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(123, {"model": model}, extra={"a": 1})
        ckpt.wait()
        info = ckpt.verify(123)
    folder = tmp_path / "step-00000123"
    assert info.step == 123 and info.world_size == 1 and info.path == folder
    assert info.versions["torch"] == torch.__version__
    assert info.file_sizes[".metadata"] == (folder / ".metadata").stat().st_size
    assert json.loads((folder / "rank-00000.json").read_text())["extra"] == {"a": 1}
    assert not list(tmp_path.glob("*.tmp"))


def test_resaving_a_step_replaces_it(tmp_path):
    counter = torch.tensor([1.0])
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(4, {"counter": counter}, extra="first")
        counter.fill_(2.0)
        ckpt.save(4, {"counter": counter}, extra="second")
        target = torch.zeros(1)
        assert ckpt.load({"counter": target}) == "second"
    assert target.item() == 2.0
    assert visible_names(tmp_path) == ["latest", "step-00000004"]


def test_leftover_tmp_folders_removed_at_start_up(tmp_path):
    model, _, _ = build(0)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"model": model})
    (tmp_path / "step-00000002.tmp").mkdir()
    (tmp_path / "step-00000002.tmp" / "__0_0.distcp").write_bytes(b"partial")
    (tmp_path / "latest.tmp").write_text("step-00000002")
    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.latest() == 1
    assert visible_names(tmp_path) == ["latest", "step-00000001"]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"keep_last": 0}, "keep_last"),
        ({"keep_every": 0}, "keep_every"),
        ({"every_steps": -1}, "every_steps"),
        ({"every_seconds": float("nan")}, "every_seconds"),
        ({"phases": "train"}, "phases"),
    ],
    ids=["keep_last", "keep_every", "every_steps", "every_seconds", "phases"],
)
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        CkptConfig(**kwargs)


def test_bad_save_arguments(tmp_path):
    model, optim, _ = build(0)
    with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(ValueError, match="extra is not JSON-able"):
            ckpt.save(1, {"model": model}, extra={"t": torch.zeros(1)})
        with pytest.raises(ValueError, match="extra is not JSON-able"):
            ckpt.save(1, {"model": model}, extra=lambda: {"t": torch.zeros(1)})
        with pytest.raises(ValueError, match="step=-1"):
            ckpt.save(-1, {"model": model})
        with pytest.raises(ValueError, match=r"state\['lr'\] is a float"):
            ckpt.save(1, {"model": model, "lr": 0.1})
        with pytest.raises(ValueError, match="add the module it optimizes"):
            ckpt.save(1, {"optim": optim})
        with pytest.raises(CheckpointError, match="no committed checkpoint"):
            ckpt.load({"model": model})
    with pytest.raises(ValueError, match="closed"):
        ckpt.save(1, {"model": model})


def test_from_config_uses_every_field(tmp_path):
    config = CkptConfig(keep_last=2, keep_every=5, async_save=False, every_steps=3, phases=("x",))
    ckpt = Checkpointer.from_config(tmp_path, config)
    assert ckpt.config == config
    ckpt.close()
