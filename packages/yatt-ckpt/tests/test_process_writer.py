"""writer="process": round trips, save ordering, errors, shared buffers, process lifetime."""

NUM_GPUS = 0

import os
import signal
import time

import pytest
import torch
from torch import nn

from yatt.ckpt import Checkpointer, CheckpointError, CkptConfig


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3))
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    model(torch.randn(4, 6)).pow(2).mean().backward()
    optim.step()
    optim.zero_grad()
    return model, optim


def is_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def wait_until_gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while is_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_round_trip_is_exact_and_snapshots_at_call_time(tmp_path, writer):
    model, optim = build(0)
    counter = torch.arange(5, dtype=torch.int64)
    want_model = {k: v.clone() for k, v in model.state_dict().items()}
    want_exp_avg = optim.state_dict()["state"][0]["exp_avg"].clone()
    with Checkpointer(tmp_path, writer=writer) as ckpt:
        ckpt.save(1, {"model": model, "optim": optim, "counter": counter}, extra={"k": [1, 2]})
        with torch.no_grad():  # the trainer may change its tensors once save() returns
            for p in model.parameters():
                p.mul_(-3.0)
        counter.add_(10)
        ckpt.wait()
    fresh, fresh_optim = build(1)
    fresh_counter = torch.zeros(5, dtype=torch.int64)
    with Checkpointer(tmp_path) as ckpt:
        extra = ckpt.load({"model": fresh, "optim": fresh_optim, "counter": fresh_counter})
    assert extra == {"k": [1, 2]}
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, want_model[key]), key
    assert torch.equal(fresh_optim.state_dict()["state"][0]["exp_avg"], want_exp_avg)
    assert torch.equal(fresh_counter, torch.arange(5))


def test_process_saves_in_a_row_reuse_shared_buffers(tmp_path):
    model, _ = build(0)
    snapshots = {}
    with Checkpointer(tmp_path, keep_last=5, writer="process") as ckpt:
        for step in range(1, 4):
            snapshots[step] = {k: v.clone() for k, v in model.state_dict().items()}
            ckpt.save(step, {"model": model})  # waits for the previous write first
            if step == 1:
                writer = ckpt._process_writer
                pid, sent = writer.pid, dict(writer._sent)
                assert sent and all(s.is_shared() for s in sent.values())
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
        # The same storages every save: later saves send keys and views only, no new handles.
        assert writer.pid == pid and writer._sent.keys() == sent.keys()
        ckpt.wait()
        assert [ckpt.latest()] == [3]
        for step, want in snapshots.items():
            ckpt.load({"model": model}, step=step)
            for key, value in model.state_dict().items():
                assert torch.equal(value, want[key]), (step, key)
    assert wait_until_gone(pid, 10), "close() must stop the writer process"


def test_process_writer_stages_host_state_into_shared_unpinned_buffers(tmp_path):
    # The CPU path of test_cuda.py's page-locked buffers: shared with the writer, and without
    # CUDA tensors nothing to page-lock (nothing is registered with CUDA, on any machine).
    model, optim = build(0)
    with Checkpointer(tmp_path, writer="process") as ckpt:
        ckpt.save(1, {"model": model, "optim": optim})
        stager = ckpt._stager
        buffers = list(stager._buffers.values())
        assert len(buffers) == 4 + 3 * 4  # 4 parameters; AdamW: step and two moments each
        assert all(b.is_shared() and not b.is_pinned() for b in buffers)
        assert not stager._registered
        ckpt.wait()
    assert ckpt._stager is None


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_error_in_background_write_surfaces_at_wait_and_next_save_works(tmp_path, writer):
    model, _ = build(0)
    with Checkpointer(tmp_path, writer=writer) as ckpt:
        # A file where the save's .tmp folder goes: rank 0's fresh-folder step fails.
        (tmp_path / "step-00000001.tmp").write_text("in the way")
        ckpt.save(1, {"model": model})
        with pytest.raises(CheckpointError, match=r"saving step 1 .* failed: .*NotADirectory"):
            ckpt.wait()
        ckpt.wait()  # the error is raised once
        ckpt.save(2, {"model": model})
        ckpt.wait()
        assert ckpt.latest() == 2


def test_killed_writer_process_raises_at_wait_and_close_cleans_up(tmp_path):
    model, _ = build(0)
    ckpt = Checkpointer(tmp_path, writer="process")
    ckpt.save(1, {"model": model})
    ckpt.wait()
    pid = ckpt._process_writer.pid
    os.kill(pid, signal.SIGKILL)
    assert wait_until_gone(pid, 10)
    ckpt.save(2, {"model": model})
    with pytest.raises(CheckpointError, match=r"saving step 2 .*writer process"):
        ckpt.wait()
    ckpt.close()
    assert ckpt.latest() == 1


def test_bad_writer_names_the_field(tmp_path):
    with pytest.raises(ValueError, match="writer='fork'"):
        CkptConfig(writer="fork")
    with pytest.raises(ValueError, match="writer="):
        Checkpointer(tmp_path, writer="threads")


def test_defer_sees_a_busy_writer_process_without_taking_its_result(tmp_path):
    model, _ = build(0)
    with Checkpointer(
        tmp_path, keep_last=5, writer="process", every_steps=1, when_busy="defer"
    ) as ckpt:
        assert ckpt.maybe_save(1, {"model": model}).is_saved
        ckpt.wait()
        pid = ckpt._process_writer.pid
        os.kill(pid, signal.SIGSTOP)  # a writer that cannot finish until the test says so
        try:
            assert ckpt.maybe_save(2, {"model": model}).is_saved
            assert ckpt.is_writing()
            assert ckpt.maybe_save(3, {"model": model}).is_deferred
        finally:
            os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while ckpt.is_writing():
            assert time.monotonic() < deadline, "the writer process never finished step 2"
            time.sleep(0.02)
        assert ckpt.latest() == 2
        ckpt.wait()  # the result is still there to collect (is_writing only peeked)
        assert ckpt.maybe_save(4, {"model": model}).is_saved
    assert sorted(int(p.name.split("-")[1]) for p in tmp_path.glob("step-*")) == [1, 2, 4]
