"""maybe_save: step and time schedules, phase boundaries, and signal-triggered final saves."""

NUM_GPUS = 0

import os
import signal
import threading
import time

import pytest
import torch

from yatt.ckpt import Checkpointer, CkptConfig, SaveDecision, exit_code_for_signal


def committed(root) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in root.glob("step-*") if p.is_dir())


def test_every_steps_saves_on_multiples_once(tmp_path):
    value = torch.zeros(2)
    with Checkpointer(tmp_path, keep_last=10, every_steps=3) as ckpt:
        saved = [s for s in range(0, 10) if ckpt.maybe_save(s, {"v": value}).is_saved]
        # A second call at the same step (another phase boundary) does not save it again.
        assert not ckpt.maybe_save(9, {"v": value}).is_saved
    assert saved == [3, 6, 9]
    assert committed(tmp_path) == [3, 6, 9]


def test_phases_restrict_where_saves_happen(tmp_path):
    value = torch.zeros(2)
    with Checkpointer(tmp_path, keep_last=10, every_steps=2, phases=("train",)) as ckpt:
        calls = []
        for step in range(1, 5):
            for phase in ("rollout", "train", None):
                if ckpt.maybe_save(step, {"v": value}, phase=phase).is_saved:
                    calls.append((step, phase))
    assert calls == [(2, "train"), (4, "train")]


def test_every_seconds_saves_when_interval_passed(tmp_path):
    value = torch.zeros(2)
    with Checkpointer(tmp_path, keep_last=10, every_seconds=0.3) as ckpt:
        assert not ckpt.maybe_save(1, {"v": value}).is_saved
        time.sleep(0.35)
        assert ckpt.maybe_save(2, {"v": value}).is_saved
        assert not ckpt.maybe_save(3, {"v": value}).is_saved  # the clock restarted at step 2
        time.sleep(0.35)
        assert ckpt.maybe_save(4, {"v": value}).is_saved
    assert committed(tmp_path) == [2, 4]


def test_no_schedule_never_saves(tmp_path):
    with Checkpointer(tmp_path) as ckpt:
        assert not any(ckpt.maybe_save(s, {"v": torch.zeros(1)}).is_saved for s in range(5))
    assert committed(tmp_path) == []


# Exit statuses a shell reports for a process killed by the signal (128 + its Linux number).
@pytest.mark.parametrize(
    ("signum", "exit_code"),
    [(signal.SIGTERM, 143), (signal.SIGUSR1, 138), (signal.SIGINT, 130)],
    ids=["SIGTERM", "SIGUSR1", "SIGINT"],
)
def test_signal_triggers_final_blocking_save(tmp_path, signum, exit_code):
    value = torch.zeros(2)
    previous = signal.getsignal(signum)
    with Checkpointer(tmp_path, every_steps=100) as ckpt:
        ckpt.install_signal_handlers()  # the defaults include all three
        decision = ckpt.maybe_save(1, {"v": value})
        assert not decision.is_saved and not decision.should_stop
        assert decision.stop_signal is None and decision.exit_code == 0
        assert ckpt.stop_signal is None
        value.fill_(5.0)
        os.kill(os.getpid(), signum)  # the handler only sets a flag: the process keeps running
        decision = ckpt.maybe_save(7, {"v": value}, extra={"why": "preempted"})
        assert decision.is_saved and decision.should_stop
        assert decision.stop_signal == signum and ckpt.stop_signal == signum
        assert decision.exit_code == exit_code == exit_code_for_signal(signum)
        # Blocking: the checkpoint is committed when maybe_save returns.
        assert ckpt.latest() == 7
        assert ckpt.verify(7).step == 7
        target = torch.zeros(2)
        assert ckpt.load({"v": target}) == {"why": "preempted"}
        assert torch.equal(target, torch.full((2,), 5.0))
    assert signal.getsignal(signum) == previous, "close() restores the previous handler"


def test_a_second_ctrl_c_aborts_at_once_and_the_first_signal_is_reported(tmp_path):
    previous = signal.getsignal(signal.SIGINT)
    with Checkpointer(tmp_path, phases=("train",)) as ckpt:
        ckpt.install_signal_handlers()
        os.kill(os.getpid(), signal.SIGTERM)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # a stop is already requested: abort now
            for _ in range(1000):  # the handler runs between bytecodes
                time.sleep(0.001)
        assert ckpt.stop_signal == signal.SIGTERM  # the first one is the reason
    assert committed(tmp_path) == []  # no save happened: the user chose not to wait
    assert signal.getsignal(signal.SIGINT) == previous


def test_signal_waits_for_an_eligible_phase(tmp_path):
    with Checkpointer(tmp_path, phases=("train",)) as ckpt:
        ckpt.install_signal_handlers()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert not ckpt.maybe_save(3, {"v": torch.zeros(1)}, phase="rollout").should_stop
        assert ckpt.maybe_save(3, {"v": torch.zeros(1)}, phase="train").should_stop
    assert committed(tmp_path) == [3]


def test_defer_moves_a_due_save_past_a_busy_writer(tmp_path, monkeypatch):
    import yatt.ckpt._checkpointer as checkpointer_module

    release = threading.Event()
    write = checkpointer_module.write_and_commit

    def slow_write(*args, **kwargs):
        assert release.wait(30), "the test never released the writer"
        write(*args, **kwargs)

    monkeypatch.setattr(checkpointer_module, "write_and_commit", slow_write)
    value = torch.zeros(2)
    with Checkpointer(tmp_path, keep_last=10, every_steps=2, when_busy="defer") as ckpt:
        assert ckpt.maybe_save(2, {"v": value}).is_saved  # its write now hangs
        assert ckpt.is_writing()
        assert ckpt.maybe_save(3, {"v": value}) == SaveDecision(is_saved=False, should_stop=False)
        # Due, but the writer is busy: deferred, and the loop did not stall.
        started = time.monotonic()
        assert ckpt.maybe_save(4, {"v": value}).is_deferred
        assert ckpt.maybe_save(5, {"v": value}).is_deferred  # still busy: still deferred
        assert time.monotonic() - started < 5
        release.set()
        while ckpt.is_writing():
            time.sleep(0.01)
        # The first call that finds the writer free takes the deferred save, due or not.
        assert ckpt.maybe_save(5, {"v": value}).is_saved
        ckpt.wait()
        assert ckpt.maybe_save(6, {"v": value}).is_saved  # the schedule goes on as before
        assert not ckpt.maybe_save(7, {"v": value}).is_saved
        assert ckpt.num_deferred_saves == 2
    assert committed(tmp_path) == [2, 5, 6]


def test_wait_is_the_default_and_other_values_are_refused(tmp_path):
    assert CkptConfig().when_busy == "wait"
    with pytest.raises(ValueError, match=r"when_busy='skip'.*'defer'"):
        Checkpointer(tmp_path, when_busy="skip")


class _CountedExtra:
    """extra=lambda: ...: records each call (step, thread) and returns that step's value."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, str]] = []

    def at(self, step: int):
        def build() -> dict:
            self.calls.append((step, threading.current_thread().name))
            return {"step": step, "ids": [step] * 3}

        return build


def test_a_callable_extra_is_built_once_per_save_and_never_on_other_steps(tmp_path):
    value = torch.zeros(2)
    extra = _CountedExtra()
    with Checkpointer(tmp_path, keep_last=10, every_steps=3) as ckpt:  # async (the default)
        saved = [
            s for s in range(10) if ckpt.maybe_save(s, {"v": value}, extra=extra.at(s)).is_saved
        ]
        assert not ckpt.maybe_save(9, {"v": value}, extra=extra.at(9)).is_saved  # saved already
    # every_steps=3 saves steps 3, 6, 9; each built once, on the caller's thread
    assert saved == [3, 6, 9]
    here = threading.current_thread().name
    assert extra.calls == [(3, here), (6, here), (9, here)]
    with Checkpointer(tmp_path, read_only=True) as ckpt:
        for step in (3, 6, 9):
            assert ckpt.load({"v": torch.zeros(2)}, step=step) == {"step": step, "ids": [step] * 3}


def test_a_callable_extra_is_built_once_for_a_stop_signals_save_and_not_for_a_deferred_one(
    tmp_path, monkeypatch
):
    import yatt.ckpt._checkpointer as checkpointer_module

    release = threading.Event()
    write = checkpointer_module.write_and_commit

    def slow_write(*args, **kwargs):
        assert release.wait(30), "the test never released the writer"
        write(*args, **kwargs)

    monkeypatch.setattr(checkpointer_module, "write_and_commit", slow_write)
    value = torch.zeros(2)
    extra = _CountedExtra()
    with Checkpointer(tmp_path, keep_last=10, every_steps=2, when_busy="defer") as ckpt:
        assert ckpt.maybe_save(2, {"v": value}, extra=extra.at(2)).is_saved  # write hangs
        assert ckpt.maybe_save(4, {"v": value}, extra=extra.at(4)).is_deferred
        release.set()
        ckpt.wait()
        ckpt.install_signal_handlers()
        os.kill(os.getpid(), signal.SIGTERM)
        assert ckpt.maybe_save(5, {"v": value}, extra=extra.at(5)).should_stop
        assert ckpt.load({"v": torch.zeros(2)}, step=5) == {"step": 5, "ids": [5] * 3}
    assert [step for step, _ in extra.calls] == [2, 5]
