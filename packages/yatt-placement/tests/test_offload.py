import copy
import itertools

import pytest
import torch

from yatt.placement import (
    is_offload_placeholder,
    is_offloaded,
    offload,
    offloaded_bytes,
    offloaded_named_parameters,
    onload,
)
from yatt.placement._offload import (
    host_bytes_of,
    offload_all,
    pinned_host_bytes,
    plan_host_slabs,
    tensor_bytes,
)

NUM_GPUS = 0


def _model_and_optimizer(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 2)
    )
    model.register_buffer("scale", torch.full((2,), 0.5))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 8, generator=generator)
    loss = (model(x) * model.scale).square().mean()
    optimizer.zero_grad(set_to_none=False)
    loss.backward()
    optimizer.step()


def test_training_after_offload_and_onload_matches_training_without():
    model, optimizer = _model_and_optimizer()
    twin = copy.deepcopy(model)
    twin_optimizer = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    _train_step(model, optimizer, seed=1)
    _train_step(twin, twin_optimizer, seed=1)

    for obj in (model, optimizer):
        offload(obj)
    for obj in (model, optimizer):
        onload(obj)

    for seed in (2, 3):
        _train_step(model, optimizer, seed=seed)
        _train_step(twin, twin_optimizer, seed=seed)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizer.state[p][key], twin_optimizer.state[q][key])


def test_objects_stay_the_same_and_memory_moves():
    model, optimizer = _model_and_optimizer()
    _train_step(model, optimizer, seed=1)
    params = list(model.parameters())
    grads = [p.grad for p in params]
    moments = [optimizer.state[p]["exp_avg"] for p in params]
    values = [p.detach().clone() for p in params]
    pointers = [p.data_ptr() for p in params] + [m.data_ptr() for m in moments]

    offload(model)
    offload(optimizer)
    moved = [p.data_ptr() for p in params] + [m.data_ptr() for m in moments]
    assert all(a != b for a, b in zip(pointers, moved, strict=True))
    onload(optimizer)
    onload(model)

    assert list(model.parameters()) == params
    assert all(p.grad is g for p, g in zip(params, grads, strict=True))
    assert all(optimizer.state[p]["exp_avg"] is m for p, m in zip(params, moments, strict=True))
    assert all(torch.equal(p, v) for p, v in zip(params, values, strict=True))


def test_bytes_and_state_bookkeeping():
    model, optimizer = _model_and_optimizer()
    _train_step(model, optimizer, seed=1)
    num_params = sum(p.numel() for p in model.parameters())
    # params + grads (fp32) + buffer; AdamW: two moments per param + one step scalar each.
    model_bytes = 4 * (2 * num_params + 2)
    assert tensor_bytes(model) == model_bytes
    assert offloaded_bytes(model) == 0 and not is_offloaded(model)

    assert offload(model) == model_bytes
    assert is_offloaded(model) and offloaded_bytes(model) == model_bytes
    optimizer_bytes = offload(optimizer)
    assert optimizer_bytes == 4 * 2 * num_params + sum(
        s["step"].nbytes for s in optimizer.state.values()
    )
    with pytest.raises(RuntimeError, match="already offloaded"):
        offload(model)
    assert onload(model) == model_bytes
    assert not is_offloaded(model) and offloaded_bytes(model) == 0
    with pytest.raises(RuntimeError, match="not offloaded"):
        onload(model)
    onload(optimizer)


def test_tied_weights_move_once():
    embed = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = embed.weight
    model = torch.nn.ModuleDict({"embed": embed, "head": head})
    assert offload(model) == 10 * 4 * 4
    onload(model)
    assert model["head"].weight is model["embed"].weight


def test_rejects_other_objects():
    with pytest.raises(TypeError, match=r"Module or torch\.optim\.Optimizer"):
        offload(torch.zeros(3))


def test_offload_all_moves_nothing_when_one_is_already_offloaded():
    model, optimizer = _model_and_optimizer()
    _train_step(model, optimizer, seed=1)
    offload(optimizer)
    with pytest.raises(RuntimeError, match="already offloaded"):
        offload_all([model, optimizer])
    assert not is_offloaded(model)
    assert offload_all([model]) == tensor_bytes(model)
    assert is_offloaded(model)


def _leave_placeholders(model: torch.nn.Module) -> None:
    """What offload does on CUDA, done on the CPU: each offloaded parameter keeps an empty
    tensor (on CUDA: on its device) while its values wait in offload's host copy."""
    for param in model.parameters():
        param.data = torch.empty(0, dtype=param.dtype)


def test_offloaded_named_parameters_read_the_host_copies_behind_placeholders():
    model, optimizer = _model_and_optimizer()
    _train_step(model, optimizer, seed=1)
    want = {name: p.detach().clone() for name, p in model.named_parameters()}
    offload(model)
    _leave_placeholders(model)
    assert all(p.numel() == 0 for p in model.parameters())

    got = list(offloaded_named_parameters(model))
    assert [name for name, _ in got] == list(want)
    for name, tensor in got:
        assert torch.equal(tensor, want[name]), name
    assert all(is_offload_placeholder(p) for p in model.parameters())
    assert not is_offload_placeholder(got[0][1])  # the host copy itself

    onload(model)  # from the host copies, as on CUDA
    for name, param in model.named_parameters():
        assert torch.equal(param, want[name]), name
        assert not is_offload_placeholder(param)


def test_offloaded_named_parameters_of_an_onloaded_or_cpu_offloaded_module():
    model, _ = _model_and_optimizer()
    params = list(model.parameters())
    # Onloaded (Plan(offload="auto") may keep a trainer awake): the parameters themselves.
    assert [t for _, t in offloaded_named_parameters(model)] == params
    # Offloaded on a CPU-only machine: the host copies are the parameters' data.
    offload(model)
    got = [t for _, t in offloaded_named_parameters(model)]
    assert all(t.data_ptr() == p.data_ptr() for t, p in zip(got, params, strict=True))
    assert not any(is_offload_placeholder(p) for p in params)  # not empty: nothing to tell
    onload(model)
    with pytest.raises(TypeError, match=r"takes a torch\.nn\.Module"):
        offloaded_named_parameters(torch.optim.SGD(params, lr=0.1))


def test_a_tensor_that_is_empty_for_real_is_no_placeholder():
    model = torch.nn.ParameterDict(
        {"empty": torch.nn.Parameter(torch.empty(3, 0)), "full": torch.nn.Parameter(torch.ones(3))}
    )
    offload(model)
    _leave_placeholders(model)
    assert not is_offload_placeholder(model["empty"])  # its host copy is empty too
    assert is_offload_placeholder(model["full"])
    assert not is_offload_placeholder(torch.empty(0))  # not offloaded at all
    onload(model)


def _qwen25_7b_fp32_sizes() -> list[int]:
    """Bytes of each float32 tensor of Qwen2.5-7B (hidden 3584, MLP 18944, 28 layers, 4 KV
    heads of 128, vocabulary 152064, untied head), from its published shapes."""
    h, i, kv, vocab = 3584, 18944, 4 * 128, 152064
    layer = [h * h, h, kv * h, kv, kv * h, kv, h * h, i * h, i * h, h * i, h, h]
    return [4 * n for n in [vocab * h, vocab * h, h, *layer * 28]]


def test_host_slabs_are_powers_of_two_that_hold_every_tensor_apart():
    sizes = [700, 3, 5000, 512, 1, 4096]
    slabs = plan_host_slabs(sizes)
    assert all(size & (size - 1) == 0 for size in slabs.sizes)
    spans = {}
    for size, (k, offset) in zip(sizes, slabs.places, strict=True):
        assert offset % 512 == 0  # any dtype's alignment
        assert offset + size <= slabs.sizes[k]
        spans.setdefault(k, []).append((offset, offset + size))
    for ranges in spans.values():  # no two copies overlap within a slab
        ranges.sort()
        assert all(end <= start for (_, end), (start, _) in itertools.pairwise(ranges))


def test_host_slabs_of_a_7b_model_pin_about_what_they_hold():
    sizes = _qwen25_7b_fp32_sizes()
    held = sum(sizes)
    assert 28.3 * 2**30 < held < 28.5 * 2**30  # 7.6B parameters x 4 bytes
    # One power-of-two block per tensor (torch's pinned allocator) would pin 54 GiB.
    assert sum(1 << (s - 1).bit_length() for s in sizes) > 1.8 * held
    assert pinned_host_bytes(sizes) < held * 1.03


def test_offloaded_copies_share_slabs_and_come_back_bit_exact():
    model, optimizer = _model_and_optimizer()
    _train_step(model, optimizer, seed=1)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    offload(model)
    hosts = dict(offloaded_named_parameters(model))
    storages = {h.untyped_storage().data_ptr() for h in hosts.values()}
    assert len(storages) < len(hosts)  # packed, not one block per tensor
    # Parameters, their gradients (the step left them) and the 2-float buffer.
    sizes = [4 * p.numel() for p in model.parameters()] * 2 + [8]
    assert host_bytes_of(model) == pinned_host_bytes(sizes)
    onload(model)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name])
    _train_step(model, optimizer, seed=2)  # trains on after the round trip


def test_host_bytes_of_an_onloaded_object_is_what_its_offload_will_hold():
    model, optimizer = _model_and_optimizer()
    _train_step(model, optimizer, seed=1)
    expected = host_bytes_of(optimizer)
    assert expected > 0
    offload(optimizer)
    assert host_bytes_of(optimizer) == expected
    onload(optimizer)
