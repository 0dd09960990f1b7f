"""The CUDA backend on a real GPU: memory comes back to the device, contents survive.

Run on a GPU machine with `yatt-placement[cuda,test]` installed:
    pytest packages/yatt-placement/tests/test_cuda.py -v
"""

import copy
import gc
import logging
import os
import subprocess
import sys
import time

import pytest
import torch

from yatt.placement import (
    FitConfig,
    Plan,
    RegionRole,
    TrainerRole,
    is_paused,
    offload,
    offloaded_bytes,
    onload,
    pause,
    region,
    release,
    resident_bytes,
    resume,
)
from yatt.placement import _offload as placement_offload
from yatt.placement._fit import CudaPeakGrowth, read_cuda_free_bytes
from yatt.placement._offload import tensor_bytes
from yatt.placement.testing import RecordingRole

NUM_GPUS = 1

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("fresh_regions"),
]

MIB = 1 << 20


@pytest.fixture(autouse=True)
def _empty_allocator_cache():
    """Each test starts from the caching allocator of a fresh process.

    Large temporaries an earlier test freed stay cached, and the next test's tensors are carved
    out of those segments together with whatever else it allocates; a test of that situation
    sets it up itself (test_offload_after_onload_frees_segments_shared_with_live_tensors).
    """
    gc.collect()
    torch.cuda.empty_cache()
    yield
    gc.collect()
    torch.cuda.empty_cache()


def _used_bytes() -> int:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free


def test_pause_returns_the_region_memory_and_resume_restores_it():
    size = 1024 * MIB
    with region("test/weights", enable_cpu_backup=True):
        weights = torch.arange(size // 4, dtype=torch.int32, device="cuda")
    with region("test/kv"):
        kv = torch.ones(size // 2, dtype=torch.bfloat16, device="cuda")
    address = weights.data_ptr()
    assert resident_bytes("test/weights") >= size
    assert resident_bytes("test/kv") >= size

    before = _used_bytes()
    pause("test/kv", "test/weights")
    released = before - _used_bytes()
    assert released >= 0.95 * 2 * size, f"released {released / MIB:.0f} MiB of {2 * size / MIB:.0f}"
    assert resident_bytes("test/weights") == 0

    resume("test/weights", "test/kv")
    restored = _used_bytes() - (before - released)
    assert restored >= 0.95 * 2 * size
    assert weights.data_ptr() == address
    assert torch.equal(weights, torch.arange(size // 4, dtype=torch.int32, device="cuda"))
    # Without backup the contents are undefined, but the memory is usable again.
    kv.fill_(3.0)
    assert kv.float().sum().item() == 3.0 * kv.numel()


def test_a_released_paused_tag_serves_a_new_owner():
    # An engine closed asleep: its tensors freed while paused (their blocks stay in the tag's
    # pool, unmapped), the tag released. A new owner's tensors may get those blocks: the tag
    # must be resumed before they are touched, or the process faults.
    size = 256 * MIB
    with region("test/old"):
        old = torch.ones(size // 4, dtype=torch.float32, device="cuda")
    pause("test/old")
    del old
    release("test/old")
    with region("test/old"):
        new = torch.full((size // 4,), 2.0, device="cuda")
    assert not is_paused("test/old")
    assert new.sum().item() == 2.0 * new.numel()
    pause("test/old")  # the tag is an ordinary one again
    resume("test/old")
    new.fill_(3.0)
    assert new.sum().item() == 3.0 * new.numel()


def test_region_books_match_what_a_pause_releases():
    with region("books/a"):
        a = torch.empty(300 * MIB, dtype=torch.uint8, device="cuda")
    before = _used_bytes()
    pause("books/a")
    released = before - _used_bytes()
    resume("books/a")
    booked = resident_bytes("books/a")
    assert abs(booked - released) <= 0.05 * booked + 2 * MIB, (booked, released)
    del a


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(2048, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 2048)
    ).cuda()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(64, 2048, device="cuda", generator=generator)
    optimizer.zero_grad(set_to_none=False)
    model(x).square().mean().backward()
    optimizer.step()


def test_offload_frees_trainer_memory_and_training_continues_identically():
    model, optimizer = _model_and_optimizer()
    twin = copy.deepcopy(model)
    twin_optimizer = torch.optim.AdamW(twin.parameters(), lr=1e-3)
    _step(model, optimizer, 1)
    _step(twin, twin_optimizer, 1)
    gc.collect()
    torch.cuda.empty_cache()
    on_device = tensor_bytes(model) + tensor_bytes(optimizer)

    before = _used_bytes()
    offload(model)
    offload(optimizer)
    freed = before - _used_bytes()
    assert freed >= 0.95 * on_device, f"freed {freed / MIB:.0f} MiB of {on_device / MIB:.0f}"
    # Offloaded CUDA tensors keep an empty placeholder on their device (see _offload's docs);
    # their contents wait in pinned host memory.
    assert all(p.is_cuda and p.numel() == 0 for p in model.parameters())
    assert all(h.is_pinned() for h in placement_offload._OFFLOADED[model].hosts)

    onload(model)
    onload(optimizer)
    assert before - _used_bytes() <= 0.05 * on_device
    assert all(p.is_cuda and p.grad.is_cuda for p in model.parameters())
    for seed in (2, 3):
        _step(model, optimizer, seed)
        _step(twin, twin_optimizer, seed)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)


def test_offload_after_onload_frees_segments_shared_with_live_tensors(caplog):
    # A large tensor freed just before the trainer is built leaves one cached segment; the model,
    # its twin and both optimizers' states are all carved out of it, so the twin pins it.
    scratch = torch.empty(1024 * MIB, dtype=torch.uint8, device="cuda")
    del scratch
    model, optimizer = _model_and_optimizer()
    twin = copy.deepcopy(model)
    twin_optimizer = torch.optim.AdamW(twin.parameters(), lr=1e-3)
    _step(model, optimizer, 1)
    _step(twin, twin_optimizer, 1)
    on_device = tensor_bytes(model) + tensor_bytes(optimizer)

    with caplog.at_level(logging.WARNING, logger="yatt.placement._offload"):
        offload(model)
        offload(optimizer)
    assert "returned only" in caplog.text  # the first offload cannot free a pinned segment
    onload(model)
    onload(optimizer)

    gc.collect()
    before = _used_bytes()
    offload(model)
    offload(optimizer)
    freed = before - _used_bytes()
    assert freed >= 0.95 * on_device, f"freed {freed / MIB:.0f} MiB of {on_device / MIB:.0f}"
    onload(model)
    onload(optimizer)
    for seed in (2, 3):
        _step(model, optimizer, seed)
        _step(twin, twin_optimizer, seed)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)


def test_plan_switches_of_a_small_trainer_log_no_release_warning(caplog):
    # A trainer of under a MiB lives in the caching allocator's 2 MiB small-block segments
    # beside other live tensors, so its first offload returns nothing to the device. That is
    # rounding, not memory held back; it was logged as "offload moved 0 MiB to host but the
    # caching allocator returned only 0 MiB".
    neighbour = torch.ones(16, device="cuda")  # keeps the small-block segment alive
    model = torch.nn.Linear(64, 64, device="cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = RecordingRole("engine", [], {"weights": MIB, "kv_cache": MIB})
    plan = Plan.full_colocation(rollout=engine, train=TrainerRole(model, optimizer))
    with caplog.at_level(logging.WARNING, logger="yatt.placement._offload"):
        for _ in range(2):
            with plan.phase("train"):
                model(torch.randn(8, 64, device="cuda")).square().mean().backward()
                optimizer.step()
            with plan.phase("rollout"):
                pass
    assert 0 < offloaded_bytes(model) + offloaded_bytes(optimizer) < MIB  # the trainer sleeps
    assert "returned only" not in caplog.text, caplog.text
    assert neighbour.sum().item() == 16


def test_process_exits_cleanly_with_freed_region_tensors():
    # The freed block stays cached in the tag's pool until shutdown frees it.
    code = (
        "import torch\n"
        "from yatt.placement import region\n"
        "with region('exit/kv'):\n"
        "    kv = torch.empty(64 << 20, dtype=torch.uint8, device='cuda')\n"
        "del kv\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=os.environ
    )
    assert result.returncode == 0, result.stderr[-2000:]


def test_full_colocation_plan_swaps_engine_and_trainer():
    with region("plan/weights", enable_cpu_backup=True):
        engine = torch.nn.Linear(4096, 4096, device="cuda")
    with region("plan/kv"):
        kv = torch.zeros(512 * MIB // 2, dtype=torch.bfloat16, device="cuda")
    engine_role = RegionRole({"weights": ("plan/weights",), "kv_cache": ("plan/kv",)})
    model, optimizer = _model_and_optimizer()
    _step(model, optimizer, 1)
    weight = engine.weight.detach().clone()
    plan = Plan.full_colocation(rollout=engine_role, train=TrainerRole(model, optimizer))

    with plan.phase("rollout") as record:
        assert record.released_bytes >= 0.95 * (tensor_bytes(model) + tensor_bytes(optimizer))
    with plan.phase("train") as record:
        assert record.released_bytes >= 0.95 * (512 * MIB + engine.weight.nbytes)
        _step(model, optimizer, 2)
    with plan.phase("sync"):
        pass
    with plan.phase("rollout"):
        assert torch.equal(engine.weight, weight)
    metrics = plan.metrics()
    assert metrics["placement/train/switch_s"] > 0.0
    del kv


def test_offload_keeps_grad_accumulator_hooks():
    # DDP all-reduces gradients from hooks on each parameter's grad accumulator; moving `.data`
    # to another device would reset the accumulator and silently drop those hooks.
    model = torch.nn.Linear(64, 64, device="cuda")
    fired, accumulators = [], []  # a param holds its accumulator weakly; DDP keeps them alive
    for param in model.parameters():
        accumulators.append(param.view_as(param).grad_fn.next_functions[0][0])
        accumulators[-1].register_hook(lambda *_: fired.append(1))
    offload(model)
    assert all(p.numel() == 0 and p.is_cuda for p in model.parameters())
    onload(model)
    model(torch.randn(8, 64, device="cuda")).sum().backward()
    assert len(fired) == 2, "a grad-accumulator hook was lost across offload/onload"


def test_fsdp2_offload_frees_the_sharded_storage_and_training_continues(tmp_path, fsdp2):
    # FSDP2 keeps padded shard storage behind each DTensor parameter; offload moves the module
    # with .to() so that storage leaves the GPU too (see _offload_dtensor).
    one_rank_group, sharded_model_and_optimizer, train_step = fsdp2
    with one_rank_group(tmp_path, backend="nccl"):
        model, optimizer = sharded_model_and_optimizer("cuda", width=4096)
        twin, twin_optimizer = sharded_model_and_optimizer("cuda", width=4096)
        train_step(model, optimizer, 1)
        train_step(twin, twin_optimizer, 1)
        gc.collect()
        torch.cuda.empty_cache()
        local = sum(p.to_local().nbytes for p in model.parameters())

        before = _used_bytes()
        TrainerRole(model, optimizer).sleep()
        freed = before - _used_bytes()
        # Weights and both AdamW moments, float32.
        assert freed >= 0.9 * 3 * local, f"freed {freed / MIB:.0f} MiB of {3 * local / MIB:.0f}"
        TrainerRole(model, optimizer).wake_up()
        assert all(p.to_local().is_cuda for p in model.parameters())
        for seed in (2, 3):
            train_step(model, optimizer, seed)
            train_step(twin, twin_optimizer, seed)
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            assert torch.equal(p.full_tensor(), q.full_tensor())


# -- switches made cheap: retained CPU backups, cached pinned buffers, offload="auto" ----------
def _needs_default_retention() -> None:
    if os.environ.get("TMS_RETAIN_CPU_BACKUP") is not None:
        pytest.skip("TMS_RETAIN_CPU_BACKUP is set: the environment decides retention")


def test_retained_cpu_backup_restores_weights_updated_between_pauses():
    from torch_memory_saver import torch_memory_saver

    _needs_default_retention()
    with region("retain/weights", enable_cpu_backup=True):
        weights = torch.randn(64 * MIB // 4, device="cuda")
    assert torch_memory_saver.retain_cpu_backup  # the backend turns it on by default
    generator = torch.Generator(device="cuda").manual_seed(0)
    for cycle in range(4):
        # As update_weights does between pauses: a retained shadow must be refilled each pause.
        weights.add_(torch.randn(weights.shape, device="cuda", generator=generator))
        expected = weights.clone()
        pause("retain/weights")
        resume("retain/weights")
        assert torch.equal(weights.view(torch.int32), expected.view(torch.int32)), cycle
        assert torch_memory_saver.get_cpu_backup(weights) is not None  # kept while awake


def _pause_resume_seconds(tag: str) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    pause(tag)
    resume(tag)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def test_retained_backup_is_reused_so_later_cycles_skip_the_pinned_allocation():
    from torch_memory_saver import torch_memory_saver

    _needs_default_retention()
    with region("retain/big", enable_cpu_backup=True):
        big = torch.full((1024 * MIB,), 7, dtype=torch.uint8, device="cuda")
    retained, shadows = [], []
    for _ in range(3):
        retained.append(_pause_resume_seconds("retain/big"))
        shadows.append(torch_memory_saver.get_cpu_backup(big, zero_copy=True).data_ptr())
    torch_memory_saver.retain_cpu_backup = False
    try:
        dropped = [_pause_resume_seconds("retain/big") for _ in range(3)]
        assert torch_memory_saver.get_cpu_backup(big) is None  # freed at resume
    finally:
        torch_memory_saver.retain_cpu_backup = True
    timings = f"retained {retained}, not retained {dropped} (s per 1 GiB pause+resume)"
    print(timings)
    assert shadows[0] == shadows[1] == shadows[2], "the pinned shadow was re-allocated"
    assert retained[1] < retained[0], timings
    assert max(retained[1:]) < min(dropped[1:]), timings
    assert torch.equal(big[:: 1 << 20].cpu(), torch.full((1024,), 7, dtype=torch.uint8))


def test_offload_cycles_allocate_pinned_host_memory_once():
    model, optimizer = _model_and_optimizer()
    _step(model, optimizer, 1)
    trainer = TrainerRole(model, optimizer)
    trainer.sleep()
    trainer.wake_up()
    stats = torch.cuda.host_memory_stats()
    if "num_host_alloc" not in stats:
        pytest.skip("this torch's host_memory_stats has no num_host_alloc")
    first = stats["num_host_alloc"]
    for seed in (2, 3, 4):
        _step(model, optimizer, seed)
        trainer.sleep()
        trainer.wake_up()
    # torch's caching host allocator hands the freed pinned blocks back to the next offload.
    assert torch.cuda.host_memory_stats()["num_host_alloc"] == first


def test_free_reading_counts_the_default_pool_cache_only():
    scratch = torch.empty(512 * MIB, dtype=torch.uint8, device="cuda")
    del scratch  # cached in the default pool: a phase's tensors can reuse it
    with region("free/kv"):
        kv = torch.empty(512 * MIB, dtype=torch.uint8, device="cuda")
    del kv  # cached in the tag's pool; the pause below releases it from the device
    pause("free/kv")
    torch.cuda.synchronize()
    counted = read_cuda_free_bytes() - torch.cuda.mem_get_info()[0]
    resume("free/kv")
    assert 512 * MIB <= counted < 1024 * MIB, counted / MIB


def test_auto_offload_keeps_roles_awake_after_step_one_and_sleeps_for_a_large_peak():
    with region("auto/a", enable_cpu_backup=True):
        a = torch.randn(64 * MIB // 4, device="cuda")
    with region("auto/b", enable_cpu_backup=True):
        b = torch.randn(64 * MIB // 4, device="cuda")
    expected_a, expected_b = a.clone(), b.clone()
    roles = {"a": RegionRole({"weights": ("auto/a",)}), "b": RegionRole({"weights": ("auto/b",)})}
    extra = [0]  # a fake peak added to the measured one
    measured = CudaPeakGrowth()
    plan = Plan(
        roles=roles,
        phases={"a": ["a"], "b": ["b"]},
        offload="auto",
        fit=FitConfig(peak_growth=lambda: measured().in_use + extra[0]),
    )

    def run(phase: str) -> tuple[str, ...]:
        with plan.phase(phase) as record:
            activations = torch.ones(256 * MIB, dtype=torch.uint8, device="cuda")
            del activations
        return record.kept_awake

    assert [run("a"), run("b")] == [(), ()]  # step 1: nothing measured, both sleep
    assert [run("a"), run("b")] == [("b",), ("a",)]
    assert not is_paused("auto/a") and not is_paused("auto/b")
    assert plan.metrics()["placement/a/peak_growth_bytes"] >= 256 * MIB
    extra[0] = torch.cuda.mem_get_info()[1]  # phase b's next reading: more than the device
    assert run("a") == ("b",)
    assert run("b") == ()  # b's peak no longer fits beside a: a sleeps
    assert is_paused("auto/a")
    assert torch.equal(b, expected_b)
    run("a")  # the peaks stay large (the window keeps the largest): b sleeps in turn
    assert is_paused("auto/b")
    assert torch.equal(a, expected_a)
    roles["b"].wake_up()  # leave nothing paused
    assert torch.equal(b, expected_b)


def test_a_switch_that_wakes_returns_the_allocator_cache_first():
    # Issue 27: a phase's freed activations stay in torch's cache, which a region's resume
    # cannot use; a switch that wakes something must hand them back to the driver first.
    with region("cache/engine", enable_cpu_backup=True):
        engine = torch.ones(64 * MIB, dtype=torch.uint8, device="cuda")
    plan = Plan(
        roles={"engine": RegionRole({"weights": ("cache/engine",)})},
        phases={"idle": [], "run": ["engine"]},
        # Either mode releases the cache before a wake; "always" makes "idle" sleep the engine
        # (with the device's room, "auto" keeps a 64 MiB engine awake and nothing would wake).
        offload="always",
    )
    plan.switch_to("idle")
    assert is_paused("cache/engine"), "the engine did not sleep: no wake to test"
    activations = torch.ones(512 * MIB, dtype=torch.uint8, device="cuda")
    del activations
    cached = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    assert cached >= 512 * MIB
    plan.switch_to("run")
    assert not is_paused("cache/engine")
    after = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    assert after < cached - 256 * MIB, f"cache {cached} -> {after} bytes across the wake"
    assert torch.equal(engine, torch.ones_like(engine))
