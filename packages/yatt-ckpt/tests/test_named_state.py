"""Named stateful objects saved and restored by the Checkpointer, stop signals (SIGHUP too), a
full disk or a file-size limit named in a save's error, and ClosingStack's close rules."""

NUM_GPUS = 0

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from yatt.ckpt import DEFAULT_STOP_SIGNALS, Checkpointer, CheckpointError, ClosingStack


class _Counter:
    """A stateful object: a position that moves as the run goes."""

    def __init__(self) -> None:
        self.position = 0
        self.loaded: list[dict] = []

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.loaded.append(state)
        self.position = state["position"]


def _state() -> dict:
    torch.manual_seed(0)
    return {"model": nn.Linear(3, 2)}


def test_tracked_objects_are_saved_with_every_save_and_restored_on_load(tmp_path):
    loader, sampler = _Counter(), _Counter()
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.track("loader", loader)
        ckpt.track("sampler", sampler)
        loader.position, sampler.position = 7, 3
        ckpt.save(0, _state(), extra={"step": 0})
        loader.position, sampler.position = 9, 4  # moved on after the save
    loader2, sampler2 = _Counter(), _Counter()
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.track("loader", loader2)
        ckpt.track("sampler", sampler2)
        extra = ckpt.load(_state())
        assert ckpt.missing_on_load == []
    assert (loader2.position, sampler2.position) == (7, 3)  # the saved ones, not 9 and 4
    # the layout an old trainer wrote by hand: one extra, the objects under their names
    assert extra == {"step": 0, "loader": {"position": 7}, "sampler": {"position": 3}}


def test_a_checkpoint_written_before_an_object_was_tracked_leaves_it_as_it_is(tmp_path):
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(0, _state(), extra={"step": 0, "loader": {"position": 5}})  # by hand, old
    loader, partials = _Counter(), _Counter()
    partials.position = 11
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.track("loader", loader)
        ckpt.track("partials", partials)
        ckpt.load(_state())
        assert ckpt.missing_on_load == ["partials"]
    assert loader.position == 5 and partials.position == 11 and partials.loaded == []


@pytest.mark.parametrize(
    ("name", "obj", "match"),
    [
        ("", _Counter(), "non-empty string"),
        ("loader", object(), "has no state_dict"),
    ],
)
def test_a_bad_tracked_object_is_refused_by_name(tmp_path, name, obj, match):
    with Checkpointer(tmp_path, async_save=False) as ckpt, pytest.raises(ValueError, match=match):
        ckpt.track(name, obj)


def test_extra_that_cannot_hold_the_tracked_objects_is_refused(tmp_path):
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.track("loader", _Counter())
        with pytest.raises(ValueError, match="already tracked"):
            ckpt.track("loader", _Counter())
        with pytest.raises(ValueError, match="extra must be a dict"):
            ckpt.save(0, _state(), extra=[1, 2])
        with pytest.raises(ValueError, match=r"keys \['loader'\]"):
            ckpt.save(0, _state(), extra={"loader": 1})


def test_sighup_is_a_stop_signal_that_saves(tmp_path):
    assert signal.SIGHUP in DEFAULT_STOP_SIGNALS
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.install_signal_handlers()
        os.kill(os.getpid(), signal.SIGHUP)  # the default action would end this process
        decision = ckpt.maybe_save(4, _state())
        assert decision.is_saved and decision.should_stop
        assert decision.stop_signal == signal.SIGHUP
        assert ckpt.latest() == 4


def test_a_full_disk_during_a_save_is_named(tmp_path, monkeypatch):
    import yatt.ckpt._writer as writer

    def full_disk(path, record):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(writer, "write_rank_record_durable", full_disk)
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        with pytest.raises(CheckpointError, match=r"no space left on the device \(ENOSPC\)"):
            ckpt.save(0, _state())
        assert ckpt.latest() is None


def test_a_file_size_limit_during_a_save_is_named_through_dcp(tmp_path):
    # A real EFBIG: the child's file-size limit is below the tensors' file, SIGXFSZ ignored so
    # the write fails with the errno instead of killing the process. DCP wraps it.
    script = textwrap.dedent(
        f"""
        import resource, signal, json
        import torch
        from yatt.ckpt import Checkpointer, CheckpointError
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        with Checkpointer({str(tmp_path)!r}, async_save=False) as ckpt:
            resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
            try:
                ckpt.save(0, {{"w": torch.zeros(64, 1024)}})
            except CheckpointError as e:
                print(json.dumps(str(e)))
        """
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stderr
    message = json.loads(result.stdout.strip().splitlines()[-1])
    assert "file-size limit (EFBIG" in message


class _Closeable:
    def __init__(self, name, closed, error=None) -> None:
        self.name, self.closed, self.error = name, closed, error

    def close(self) -> None:
        self.closed.append(self.name)
        if self.error is not None:
            raise self.error


def test_a_close_error_is_logged_and_never_hides_the_runs_own(caplog):
    closed: list[str] = []
    with pytest.raises(KeyError, match="the run's"), ClosingStack() as resources:
        resources.close_later(_Closeable("ckpt", closed))
        resources.close_later(_Closeable("engine", closed, OSError("disk gone")))
        resources.close_later(_Closeable("judge", closed))
        raise KeyError("the run's")
    assert closed == ["judge", "engine", "ckpt"]  # last opened first, all of them
    assert "closing _Closeable failed" in caplog.text


def test_after_a_good_run_the_first_close_error_is_raised(caplog):
    closed: list[str] = []
    with (
        caplog.at_level(logging.ERROR, logger="yatt.ckpt"),
        pytest.raises(OSError, match="a"),
        ClosingStack() as resources,
    ):
        resources.close_later(_Closeable("b", closed, OSError("b")))
        resources.close_later(_Closeable("a", closed, OSError("a")))
    assert closed == ["a", "b"] and caplog.text.count("closing _Closeable failed") == 2


def test_the_config_is_stored_with_each_save_and_a_watched_change_is_reported_once(
    tmp_path, caplog
):
    saved = {"loss": {"objective": "dapo", "kl": 0.0}, "data": {"path": "a.jsonl"}}
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.keep_config(saved, watched=("loss.objective", "data.path"))
        ckpt.save(0, _state(), extra={"step": 0})
    now = {"loss": {"objective": "gspo", "kl": 0.5}, "data": {"path": "a.jsonl"}}
    with Checkpointer(tmp_path, async_save=False) as ckpt, caplog.at_level(logging.WARNING):
        ckpt.keep_config(now, watched=("loss.objective", "data.path"))
        extra = ckpt.load(_state())
    assert extra["config"] == saved
    assert ckpt.config_changes == [("loss.objective", "dapo", "gspo")]  # kl is not watched
    assert caplog.text.count("resuming with changed settings") == 1


def test_a_checkpoint_without_a_config_reports_no_change(tmp_path):
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(0, _state(), extra={"step": 0})
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.keep_config({"loss": {"objective": "gspo"}}, watched=("loss.objective",))
        ckpt.load(_state())
        assert ckpt.config_changes == []
        with pytest.raises(ValueError, match="not JSON-able"):
            ckpt.keep_config({"x": object()})
