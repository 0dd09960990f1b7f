"""The advisory run lock: one holder per folder, the contender told who holds it, released by
release(), by the context manager and by the kernel when the holder dies."""

NUM_GPUS = 0

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from yatt.ckpt import RunLockedError, acquire_run_lock

_HOLDER = textwrap.dedent(
    """
    import sys, time
    from yatt.ckpt import acquire_run_lock
    lock = acquire_run_lock(sys.argv[1], purpose="export")
    print("held", flush=True)
    time.sleep(600)
    """
)


def _start_holder(folder) -> subprocess.Popen:
    child = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(folder)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert child.stdout.readline().strip() == "held"
    return child


def test_a_second_process_is_refused_with_the_holder_named_and_wins_after_a_crash(tmp_path):
    child = _start_holder(tmp_path)
    try:
        with pytest.raises(RunLockedError) as info:
            acquire_run_lock(tmp_path, purpose="train")
        message = str(info.value)
        assert f"pid {child.pid}" in message
        assert socket.gethostname() in message
        assert "export" in message
        assert info.value.holder.pid == child.pid
        assert info.value.holder.purpose == "export"
        assert isinstance(info.value, RuntimeError)
    finally:
        child.send_signal(signal.SIGKILL)  # no release(): the kernel must drop the flock
        child.wait()
    with acquire_run_lock(tmp_path, purpose="train") as lock:
        assert lock.is_held
        record = json.loads(lock.path.read_text())
        assert record["pid"] == os.getpid() and record["purpose"] == "train"


def test_one_process_cannot_take_a_held_lock_twice_and_release_frees_it(tmp_path):
    first = acquire_run_lock(tmp_path / "run")  # the folder is created
    with pytest.raises(RunLockedError, match=f"pid {os.getpid()}"):
        acquire_run_lock(tmp_path / "run", purpose="export")
    first.release()
    first.release()  # idempotent
    assert not first.is_held
    second = acquire_run_lock(tmp_path / "run", purpose="export")
    with pytest.raises(RunLockedError, match=r"\(export, since"):
        acquire_run_lock(tmp_path / "run")
    second.release()


def test_locks_of_different_folders_are_independent(tmp_path):
    with acquire_run_lock(tmp_path / "a"), acquire_run_lock(tmp_path / "b"):
        pass


@pytest.mark.parametrize("purpose", ["", "  ", None], ids=["empty", "blank", "none"])
def test_purpose_must_be_a_name(tmp_path, purpose):
    with pytest.raises(ValueError, match="purpose="):
        acquire_run_lock(tmp_path, purpose=purpose)
