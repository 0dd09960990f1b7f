"""A save that would not fit on its disk: refused before anything is written (save), skipped
and counted on the schedule (maybe_save), and a write that failed with no errno on a full disk
named as such."""

NUM_GPUS = 0

import collections
import shutil

import pytest
import torch

from yatt.ckpt import Checkpointer, CheckpointError, CheckpointSpaceError, _space, _writer

MiB = 2**20
_Usage = collections.namedtuple("_Usage", "total used free")


def _disk_with_free(monkeypatch, free: int) -> None:
    monkeypatch.setattr(shutil, "disk_usage", lambda path: _Usage(2**40, 2**40 - free, free))


def _state() -> dict:
    # 2**20 float32 (4 MiB) and 8 bfloat16 (16 bytes): 4 MiB + 16 bytes of tensors
    return {"weights": torch.zeros(2**20), "bias": torch.zeros(8, dtype=torch.bfloat16)}


NEED = 4 * MiB + 16


def test_state_bytes_are_its_tensors_bytes():
    assert _space.state_nbytes(_state()) == NEED
    nested = {"a": [torch.zeros(3, dtype=torch.float64)], "b": {"c": torch.zeros(2, 5)}, "n": 7}
    assert _space.state_nbytes(nested) == 3 * 8 + 10 * 4


def test_a_save_that_does_not_fit_is_refused_before_it_writes(tmp_path, monkeypatch):
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        _disk_with_free(monkeypatch, NEED + _space.SPACE_MARGIN_BYTES - 1)  # one byte short
        with pytest.raises(CheckpointSpaceError, match=r"step 5 needs ~0\.00 GiB .* free") as e:
            ckpt.save(5, _state())
        assert isinstance(e.value, CheckpointError)  # callers catching the old error still do
        assert not list(tmp_path.glob("step-*"))  # nothing written, no leftover folder
        _disk_with_free(monkeypatch, NEED + _space.SPACE_MARGIN_BYTES)  # exactly enough
        ckpt.save(5, _state())
        assert ckpt.latest() == 5


def test_ranks_on_one_host_need_their_shards_together(tmp_path, monkeypatch):
    # torchrun's LOCAL_WORLD_SIZE = 4: four ranks write their shards to this disk
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        _disk_with_free(monkeypatch, 2 * NEED + _space.SPACE_MARGIN_BYTES)  # room for two only
        with pytest.raises(CheckpointSpaceError):
            ckpt.save(0, _state())
        _disk_with_free(monkeypatch, 4 * NEED + _space.SPACE_MARGIN_BYTES)
        ckpt.save(0, _state())


@pytest.mark.parametrize("async_save", [False, True])
def test_a_scheduled_save_without_room_is_skipped_counted_and_retried(
    tmp_path, monkeypatch, caplog, async_save
):
    with Checkpointer(tmp_path, every_steps=2, async_save=async_save) as ckpt:
        _disk_with_free(monkeypatch, MiB)
        decision = ckpt.maybe_save(2, _state())
        assert decision.is_skipped and not decision.is_saved and not decision.should_stop
        assert ckpt.num_skipped_saves == 1
        assert "step 2 needs" in ckpt.last_skip_reason
        assert "checkpoint skipped (1 so far)" in caplog.text
        assert not ckpt.maybe_save(3, _state()).is_saved  # not due: no second try at 3
        _disk_with_free(monkeypatch, 2**30)  # space freed: the next due save commits
        decision = ckpt.maybe_save(4, _state())
        assert decision.is_saved and not decision.is_skipped
        ckpt.wait()
        assert ckpt.latest() == 4 and ckpt.num_skipped_saves == 1


def test_a_failed_write_on_a_full_disk_is_named_even_without_an_errno(tmp_path, monkeypatch):
    def short_write() -> None:  # what torch.save's zip writer raised on a full disk
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    _disk_with_free(monkeypatch, 3 * MiB)
    text = _writer.describe_failure(short_write, path=tmp_path / "step-00000002.tmp")
    assert text.startswith("probably no space left on the device (3 MiB free under")
    assert "unexpected pos 704 vs 598" in text
    _disk_with_free(monkeypatch, 2**30)  # room on the disk: no cause made up
    assert _writer.describe_failure(short_write, path=tmp_path).startswith("RuntimeError:")
