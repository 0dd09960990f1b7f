"""What the roles that sleep hold in host memory is checked against the host before anything
moves (issue 27: a 7B trainer's offloaded weights and AdamW state, and the engines' weight
backups, are pinned host RAM)."""

import pytest
import torch

from yatt.placement import (
    FitConfig,
    HostNeed,
    MemoryFitError,
    Plan,
    RegionRole,
    TrainerRole,
    read_host_available_bytes,
    region,
)
from yatt.placement.testing import RecordingRole

NUM_GPUS = 0
GIB = 1 << 30


@pytest.fixture(autouse=True)
def _no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _roles(log, *, train_host, judge_host, rollout_host=None):
    settings = {"optimizer": "TorchPolicyConfig.parallel='fsdp2' over more GPUs"}
    return dict(
        rollout=RecordingRole("rollout", log, {"weights": 100, "kv_cache": 300}, host=rollout_host),
        genrm=RecordingRole("genrm", log, {"weights": 50, "kv_cache": 150}, host=judge_host),
        train=RecordingRole(
            "train", log, {"weights": 200, "optimizer": 200}, host=train_host, settings=settings
        ),
    )


def _fit(available: int, headroom: int = 0) -> FitConfig:
    return FitConfig(host_available_bytes=lambda: available, host_headroom_bytes=headroom)


@pytest.mark.parametrize("offload", ["always", "auto"])
@pytest.mark.parametrize("layout", ["full", "partial"])
def test_roles_that_would_pin_more_than_the_host_has_are_refused_before_anything_moves(
    offload, layout
):
    log: list = []
    # GiB, as in a 7B step: the trainer's float32 weights and AdamW state, both engines' weight
    # backups, 4 headroom: 117 needed, 110 available.
    roles = _roles(
        log,
        train_host={"weights": 28 * GIB, "optimizer": 57 * GIB},
        judge_host={"weights": 14 * GIB},
        rollout_host={"weights": 14 * GIB},
    )
    make = Plan.full_colocation if layout == "full" else Plan.partial_colocation
    plan = make(**roles, offload=offload, fit=_fit(110 * GIB, headroom=4 * GIB))
    with pytest.raises(MemoryFitError) as error:
        plan.switch_to("rollout")
    assert str(error.value).startswith(
        "host memory: the roles that sleep hold 117.0 GiB in host RAM while asleep"
    )
    assert log == []  # nothing slept or woke


@pytest.mark.parametrize("offload", ["always", "auto"])
def test_the_host_need_is_the_sum_of_what_sleeping_roles_pin_plus_headroom(offload):
    log: list = []
    roles = _roles(
        log,
        train_host={"weights": 28 * GIB, "optimizer": 57 * GIB},
        judge_host={"weights": 14 * GIB},
        rollout_host={"weights": 0},
    )
    plan = Plan.full_colocation(**roles, offload=offload, fit=_fit(104 * GIB, headroom=4 * GIB))
    report = plan.host_fit_report()
    assert report.need_bytes == (28 + 57 + 14 + 0 + 4) * GIB  # 103 GiB
    assert report.fits
    with plan.phase("rollout"):  # the first switch checks, and passes
        pass
    tight = Plan.full_colocation(
        **_roles(
            [],
            train_host={"weights": 28 * GIB, "optimizer": 57 * GIB},
            judge_host={"weights": 14 * GIB},
            rollout_host={"weights": 0},
        ),
        offload=offload,
        fit=_fit(102 * GIB, headroom=4 * GIB),
    )
    with pytest.raises(MemoryFitError) as error:
        tight.switch_to("rollout")
    lines = str(error.value).splitlines()
    assert "103.0 GiB" in lines[0] and "102.0 GiB available" in lines[0]
    assert "1.0 GiB too many" in lines[0]
    # Largest part first, with the setting that shrinks it.
    assert lines[1] == (
        "  train optimizer: 57.0 GiB; change TorchPolicyConfig.parallel='fsdp2' over more GPUs"
    )


def test_check_fit_includes_the_host_and_separate_gpus_pin_nothing():
    roles = _roles([], train_host={"weights": 10 * GIB}, judge_host={"weights": 10 * GIB})
    plan = Plan.full_colocation(**roles, fit=_fit(5 * GIB))
    with pytest.raises(MemoryFitError, match="host memory"):
        plan.check_fit()
    # Every role awake in every phase: none sleeps, so none pins anything.
    roles = _roles([], train_host={"weights": 10 * GIB}, judge_host={"weights": 10 * GIB})
    separate = Plan.separate(**roles)
    assert separate.host_fit_report() is None


def test_roles_without_a_report_or_an_unreadable_host_check_nothing():
    plan = Plan.full_colocation(**_roles([], train_host=None, judge_host=None), fit=_fit(0))
    assert plan.host_fit_report() is None
    roles = _roles([], train_host={"weights": 10 * GIB}, judge_host=None)
    unknown = Plan.full_colocation(**roles, fit=FitConfig(host_available_bytes=lambda: None))
    assert unknown.host_fit_report() is None


def test_mem_available_is_read_from_meminfo(tmp_path, monkeypatch):
    monkeypatch.delenv("YATT_HOST_MEMORY_BYTES", raising=False)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       33554432 kB\nMemAvailable:   29360128 kB\n")
    assert read_host_available_bytes(str(meminfo)) == 28 * GIB
    assert read_host_available_bytes(str(tmp_path / "missing")) is None
    # A VM whose MemTotal (32 GiB here) grows toward its 128 GiB limit: 4 GiB in use.
    monkeypatch.setenv("YATT_HOST_MEMORY_BYTES", str(128 * GIB))
    assert read_host_available_bytes(str(meminfo)) == 124 * GIB
    monkeypatch.setenv("YATT_HOST_MEMORY_BYTES", "128G")
    with pytest.raises(ValueError, match="YATT_HOST_MEMORY_BYTES='128G'"):
        read_host_available_bytes(str(meminfo))


def test_trainer_role_reports_its_packed_host_copies():
    model = torch.nn.Linear(4, 3)  # weight 48 bytes, bias 12
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    role = TrainerRole(model, optimizer)
    # Each copy starts on a 512-byte boundary in a power-of-two slab: 2 x 512 -> 1 KiB; two
    # moments and a step count per parameter, not made yet: 6 x 512 -> 4 KiB.
    assert role.host_need().parts == {"weights": 1024, "optimizer": 4096}
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    role.sleep()
    # Made and offloaded: what the estimate said.
    assert role.host_need().parts == {"weights": 1024, "optimizer": 4096}


def test_region_role_reports_only_tags_with_cpu_backup(cpu_regions):
    with region("judge/weights", enable_cpu_backup=True):
        weights = torch.zeros(100)  # 400 bytes
    with region("judge/kv_cache"):
        cache = torch.zeros(300)
    role = RegionRole({"weights": ("judge/weights",), "kv_cache": ("judge/kv_cache",)})
    assert role.host_need() == HostNeed(parts={"weights": 400, "kv_cache": 0})
    del weights, cache
