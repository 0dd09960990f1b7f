NUM_GPUS = 0

import json

import pytest

from yatt.core import RunLog


def test_log_writes_one_line_per_step_and_tensorboard(tmp_path):
    log = RunLog(tmp_path)
    for step in range(3):
        log.log(step, {"reward/mean": step / 2, "loss": float(step)})
    log.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1, 2]
    assert lines[2]["reward/mean"] == 1.0
    assert any((tmp_path / "tensorboard").iterdir()), "TensorBoard events were written"


def test_resume_drops_steps_from_the_resume_point(tmp_path):
    log = RunLog(tmp_path, should_use_tensorboard=False)
    for step in range(5):
        log.log(step, {"x": step})
    log.close()
    resumed = RunLog(tmp_path, should_use_tensorboard=False, resume_step=3)
    resumed.log(3, {"x": 30})
    assert [(r["step"], r["x"]) for r in resumed.read()] == [(0, 0), (1, 1), (2, 2), (3, 30)]


def test_fresh_run_starts_a_new_file_and_non_writers_write_nothing(tmp_path):
    RunLog(tmp_path, should_use_tensorboard=False).log(0, {"x": 1})
    RunLog(tmp_path, should_use_tensorboard=False)
    assert not (tmp_path / "metrics.jsonl").exists()
    other = tmp_path / "other"
    RunLog(other, is_writer=False).log(0, {"x": 1})
    assert not other.exists()


def test_plot_writes_a_png(tmp_path):
    log = RunLog(tmp_path, should_use_tensorboard=False)
    for step in range(4):
        log.log(step, {"reward/mean": step, "length": 10 - step})
    path = log.plot(["reward/mean", "length"])
    assert path is not None and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_resume_tolerates_a_torn_last_line(tmp_path):
    log = RunLog(tmp_path, should_use_tensorboard=False)
    for step in range(3):
        log.log(step, {"loss": float(step)})
    with open(log.path, "a") as f:
        f.write('{"step": 3, "lo')  # a crash mid-write
    resumed = RunLog(tmp_path, should_use_tensorboard=False, resume_step=2)
    assert [r["step"] for r in resumed.read()] == [0, 1]
    resumed.log(2, {"loss": 2.0})
    assert [r["step"] for r in resumed.read()] == [0, 1, 2]


def test_a_damaged_line_before_the_end_is_an_error(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match="line 2 of 3 is not JSON"):
        RunLog(tmp_path, should_use_tensorboard=False, resume_step=1)


class FakeWandb:
    """The part of the wandb module RunLog uses (wandb 0.2x: init/log/finish, util.generate_id)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.util = type("util", (), {"generate_id": staticmethod(lambda: "run123")})

    def init(self, **kwargs):
        self.calls.append(("init", kwargs))
        return self

    def log(self, data, step):
        self.calls.append(("log", step, data))

    def finish(self):
        self.calls.append(("finish",))


def test_wandb_gets_every_step_and_a_resume_continues_its_run(tmp_path, monkeypatch):
    import importlib.util
    import sys

    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    log = RunLog(tmp_path, should_use_tensorboard=False, wandb_project="p", wandb_config={"lr": 1})
    log.log(0, {"reward/mean": 0.5})
    log.close()
    init = fake.calls[0][1]
    assert (init["project"], init["id"], init["config"]) == ("p", "run123", {"lr": 1})
    assert fake.calls[1] == ("log", 0, {"step": 0, "reward/mean": 0.5})
    assert fake.calls[-1] == ("finish",)

    fake.calls.clear()
    fake.util.generate_id = staticmethod(lambda: "other")  # a new id would start a new run
    RunLog(tmp_path, should_use_tensorboard=False, resume_step=1, wandb_project="p").close()
    assert fake.calls[0][1]["id"] == "run123" and fake.calls[0][1]["resume"] == "allow"


def test_a_wandb_project_without_wandb_is_a_clear_error(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(ValueError, match="pip install wandb"):
        RunLog(tmp_path, wandb_project="p")
    assert not (tmp_path / "metrics.jsonl").exists()
