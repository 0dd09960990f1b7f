"""CUDA state: async staging through pinned memory, and CUDA RNG restore. Skipped on CPU."""

NUM_GPUS = 1

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from yatt.ckpt import Checkpointer
from yatt.ckpt._staging import HostStager

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.cuda
def test_cuda_state_snapshot_and_round_trip(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)).cuda()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 64, device="cuda")).sum().backward()
    optim.step()
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"model": model, "optim": optim})
        # Kernels queued right after save() returns must not leak into the checkpoint.
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-2.0)
        ckpt.wait()
        torch.manual_seed(1)
        fresh = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)).cuda()
        fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
        ckpt.load({"model": fresh, "optim": fresh_optim})
    for key, value in fresh.state_dict().items():
        assert value.is_cuda
        assert torch.equal(value, snapshot[key]), key
    want = optim.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(fresh_optim.state_dict()["state"][0]["exp_avg"], want)


@pytest.mark.cuda
def test_cuda_rng_restored(tmp_path):
    torch.cuda.manual_seed_all(5)
    counter = torch.zeros(1, device="cuda")
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"counter": counter})
        want = torch.rand(4, device="cuda")
        torch.cuda.manual_seed_all(99)
        ckpt.load({"counter": counter})
        got = torch.rand(4, device="cuda")
    assert torch.equal(got, want)


@pytest.mark.cuda
def test_cuda_repeated_async_saves_reuse_pinned_buffers(tmp_path):
    stager = HostStager(pin_memory=True)
    weight = torch.randn(512, 512, device="cuda")
    first = stager.stage({"w": weight})
    assert first["w"].is_pinned()
    pointer = first["w"].data_ptr()
    weight.mul_(2.0)
    assert stager.stage({"w": weight})["w"].data_ptr() == pointer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)).cuda()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    snapshots = {}
    with Checkpointer(tmp_path, keep_last=3) as ckpt:
        for step in range(3):
            model(torch.randn(4, 64, device="cuda")).sum().backward()
            optim.step()
            optim.zero_grad()
            snapshots[step] = {k: v.clone() for k, v in model.state_dict().items()}
            ckpt.save(step, {"model": model, "optim": optim})
            with torch.no_grad():  # queued right after save() returns: must not leak in
                for p in model.parameters():
                    p.mul_(-2.0)
        for step, want in snapshots.items():
            ckpt.load({"model": model, "optim": optim}, step=step)
            for key, value in model.state_dict().items():
                assert torch.equal(value, want[key]), (step, key)


def _leaf(tree, path):
    for key in path:
        tree = tree[key]
    return tree


@pytest.mark.cuda
# A failed cudaHostRegister only warns (staging goes on unpinned); here it fails with its code.
@pytest.mark.filterwarnings("error:cudaHostRegister")
def test_cuda_process_writer_round_trip_with_page_locked_shared_buffers(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)).cuda()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    snapshots = {}
    with Checkpointer(tmp_path, keep_last=3, writer="process") as ckpt:
        for step in range(2):
            model(torch.randn(4, 64, device="cuda")).sum().backward()
            optim.step()
            optim.zero_grad()
            snapshots[step] = (
                {k: v.clone() for k, v in model.state_dict().items()},
                optim.state_dict()["state"][0]["exp_avg"].clone(),
            )
            live = {
                "model": get_model_state_dict(model),
                "optim": get_optimizer_state_dict(model, optim),
            }
            ckpt.save(step, {"model": model, "optim": optim})
            with torch.no_grad():  # queued right after save() returns: must not leak in
                for p in model.parameters():
                    p.mul_(-2.0)
            # One buffer is both: shared with the writer process, and page-locked in place, so
            # the device-to-host copy runs at full speed straight into what the writer reads.
            # Only buffers of CUDA tensors are pinned: AdamW keeps its step counters on the CPU
            # (neither fused nor capturable), and a host-to-host copy gains nothing from it.
            buffers = ckpt._stager._buffers
            from_cuda = {path for path in buffers if _leaf(live, path).is_cuda}
            assert len(from_cuda) == 2 * 4 + 4  # weights and biases, two AdamW moments each
            assert any(path[-1] == "step" for path in buffers.keys() - from_cuda)
            registered = set(ckpt._stager._registered)
            for path, buffer in buffers.items():
                should_pin = path in from_cuda
                state = (buffer.is_shared(), buffer.is_pinned())
                assert state == (True, should_pin), (path, "(is_shared, is_pinned)", state)
                ptr = buffer.untyped_storage().data_ptr()
                assert (ptr in registered) == should_pin, (path, "registered", ptr in registered)
        ckpt.wait()
        for step, (want_model, want_exp_avg) in snapshots.items():
            ckpt.load({"model": model, "optim": optim}, step=step)
            for key, value in model.state_dict().items():
                assert value.is_cuda and torch.equal(value, want_model[key]), (step, key)
            assert torch.equal(optim.state_dict()["state"][0]["exp_avg"], want_exp_avg), step
    assert ckpt._stager is None  # close() unregistered and dropped the buffers


@pytest.mark.cuda
def test_cuda_shared_stager_registers_and_unregisters(tmp_path):
    stager = HostStager(pin_memory=True, share_memory=True)
    first = stager.stage({"w": torch.randn(256, 256, device="cuda")})["w"]
    assert first.is_shared() and first.is_pinned()
    pointer = first.untyped_storage().data_ptr()
    # A new shape drops the old buffer: it must be unregistered, the new one registered.
    second = stager.stage({"w": torch.randn(128, device="cuda")})["w"]
    assert second.is_pinned() and list(stager._registered) == [second.untyped_storage().data_ptr()]
    assert pointer not in stager._registered
    stager.close()
    assert not stager._registered and not second.is_pinned()
