"""HostStager: host copies that are independent of the live state, reuse of buffers across
saves, and non-tensor leaves of any kind (torch 2.11's DefaultStager failed on its second save)."""

NUM_GPUS = 0

import torch
from torch import nn

from yatt.ckpt import Checkpointer
from yatt.ckpt._staging import HostStager


class Marker:
    """A class object as a leaf: deep-copied atomically, as a reduce-based copier must not."""


def _state() -> dict:
    shared = torch.arange(6.0)
    return {
        "w": torch.randn(3, 4),
        "groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["w"], "kind": Marker}],
        "tied_a": shared,
        "tied_b": shared,
        "step": torch.tensor(5.0),
        "name": "adamw",
        "nothing": None,
    }


def test_staged_copy_is_independent_and_keeps_non_tensor_leaves():
    live = _state()
    staged = HostStager(pin_memory=False).stage(live)
    want = live["w"].clone()
    live["w"].mul_(-1)
    live["groups"][0]["lr"] = 0.5
    assert torch.equal(staged["w"], want)
    assert staged["groups"] == [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["w"], "kind": Marker}]
    assert staged["groups"][0]["kind"] is Marker
    assert staged["tied_a"] is staged["tied_b"]  # one tensor in the input, one in the copy
    assert staged["name"] == "adamw" and staged["nothing"] is None
    assert staged["step"].shape == () and staged["step"].item() == 5.0


def test_second_stage_reuses_buffers_and_sees_new_values():
    stager = HostStager(pin_memory=False)
    live = _state()
    first = stager.stage(live)
    pointer = first["w"].data_ptr()
    live["w"].add_(1.0)
    second = stager.stage(live)  # torch 2.11's DefaultStager raised KeyError here
    assert second["w"].data_ptr() == pointer
    assert torch.equal(second["w"], live["w"])
    assert second["groups"][0]["kind"] is Marker


def test_a_leaf_that_changes_shape_or_dtype_gets_a_new_buffer():
    stager = HostStager(pin_memory=False)
    first = stager.stage({"w": torch.zeros(4)})
    second = stager.stage({"w": torch.ones(2, 3)})
    third = stager.stage({"w": torch.ones(2, 3, dtype=torch.float64)})
    assert second["w"].shape == (2, 3) and torch.equal(second["w"], torch.ones(2, 3))
    assert third["w"].dtype == torch.float64
    assert first["w"].shape == (4,)  # an earlier copy is never resized under its reader


def test_host_leaves_get_shared_buffers_that_are_never_page_locked(monkeypatch):
    # Page-locking speeds up device-to-host copies only: host leaves (AdamW's step counters)
    # stay unpinned even with pin_memory=True, and CUDA is never asked to register them.
    def no_cuda():
        raise AssertionError("cudaHostRegister for a host leaf")

    monkeypatch.setattr(torch.cuda, "cudart", no_cuda)
    stager = HostStager(pin_memory=True, share_memory=True)
    live = _state()
    staged = stager.stage(live)
    buffers = stager._buffers.values()
    assert buffers and all(b.is_shared() and not b.is_pinned() for b in buffers)
    assert not stager._registered
    assert torch.equal(staged["w"], live["w"]) and staged["step"].item() == 5.0
    stager.close()


def test_repeated_async_saves_of_model_and_adamw_load_the_last(tmp_path):
    num_saves = 3
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with Checkpointer(tmp_path, keep_last=1) as ckpt:
        for step in range(num_saves):
            model(torch.randn(4, 8)).square().mean().backward()
            optim.step()
            optim.zero_grad()
            ckpt.save(step, {"model": model, "optim": optim})
        ckpt.wait()
        want = {k: v.clone() for k, v in model.state_dict().items()}
        torch.manual_seed(1)
        fresh = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 2))
        fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        ckpt.load({"model": fresh, "optim": fresh_optim})
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, want[key]), key
    assert fresh_optim.state_dict()["state"][0]["step"].item() == num_saves
