"""One writer per root: a reader (read_only=True) changes nothing on disk, so it can open the
root beside a live writer; a second writer is refused instead of deleting the first one's save
in progress."""

NUM_GPUS = 0

import os
import threading

import pytest
import torch

from yatt.ckpt import Checkpointer, CheckpointError, RunLockedError
from yatt.ckpt import _writer as writer_impl


def test_reader_beside_a_writer_mid_save_deletes_nothing_and_loads(tmp_path, monkeypatch):
    value = torch.arange(4.0)
    entered, release = threading.Event(), threading.Event()
    real_commit = writer_impl.commit

    def held_commit(root, tmp, step):
        if step == 2:  # step 2's files are written; hold it as a .tmp folder
            entered.set()
            assert release.wait(30)
        real_commit(root, tmp, step)

    monkeypatch.setattr(writer_impl, "commit", held_commit)
    writer = Checkpointer(tmp_path)
    try:
        writer.save(1, {"value": value})
        writer.wait()
        writer.save(2, {"value": value + 1})
        assert entered.wait(30)
        in_flight = tmp_path / "step-00000002.tmp"
        assert in_flight.is_dir()
        before = sorted(os.listdir(tmp_path))

        with Checkpointer(tmp_path, read_only=True) as reader:
            assert reader.latest() == 1
            target = torch.zeros(4)
            reader.load({"value": target})
            assert torch.equal(target, value)
            assert reader.step_path(1).is_dir()
            reader.verify(1)
        assert sorted(os.listdir(tmp_path)) == before  # the writer's save is untouched

        # A second writer would clean up .tmp folders: refused, naming the first.
        with pytest.raises(RunLockedError, match=rf"pid {os.getpid()}.*checkpoint writer"):
            Checkpointer(tmp_path)
        assert in_flight.is_dir()
        release.set()
        writer.wait()  # the first writer's save still commits
        assert writer.latest() == 2
    finally:
        release.set()
        writer.close()
    with Checkpointer(tmp_path) as again:  # close() released the lock
        assert again.latest() == 2


def test_reader_refuses_to_save_and_touches_no_missing_root(tmp_path):
    root = tmp_path / "never-written"
    with Checkpointer(root, read_only=True) as reader:
        assert reader.latest() is None
        with pytest.raises(CheckpointError, match="no committed checkpoint"):
            reader.load({"value": torch.zeros(1)})
        for call in (
            lambda: reader.save(1, {"value": torch.zeros(1)}),
            lambda: reader.maybe_save(1, {"value": torch.zeros(1)}),
            lambda: reader.install_signal_handlers(),
        ):
            with pytest.raises(ValueError, match="read_only=True"):
                call()
    assert not root.exists()


def test_reader_leaves_a_killed_saves_leftover_for_the_writer(tmp_path):
    with Checkpointer(tmp_path, async_save=False) as writer:
        writer.save(1, {"value": torch.ones(2)})
    leftover = tmp_path / "step-00000002.tmp"
    leftover.mkdir()
    Checkpointer(tmp_path, read_only=True).close()
    assert leftover.is_dir()
    Checkpointer(tmp_path).close()
    assert not leftover.exists()
