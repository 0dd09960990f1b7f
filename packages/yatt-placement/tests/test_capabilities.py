"""Each role class satisfies the capability protocols of the members its docstring lists
(yatt.placement.MemoryTagged, MeasuresResidentBytes, ...), and a plan reads a role through
them (tests/test_plan.py: a role without a member gets the plan's default for it)."""

NUM_GPUS = 0

import types

import torch

from yatt.placement import (
    InMemoryRegions,
    MeasuresResidentBytes,
    MemoryTagged,
    RegionRole,
    ReportsHostNeed,
    ReportsMemoryNeed,
    ResizableMemory,
    ResizesWhileAwake,
    Role,
    TrainerRole,
)
from yatt.placement.testing import RecordingRole

PROTOCOLS = (
    MemoryTagged,
    InMemoryRegions,
    MeasuresResidentBytes,
    ResizableMemory,
    ResizesWhileAwake,
    ReportsMemoryNeed,
    ReportsHostNeed,
)


def _capabilities(role):
    return {p.__name__ for p in PROTOCOLS if isinstance(role, p)}


def test_trainer_role():
    model = torch.nn.Linear(4, 4)
    role = TrainerRole(model, torch.optim.AdamW(model.parameters()))
    # memory_tags ("weights", "optimizer"), resident_bytes(), host_need(), memory_need().
    assert isinstance(role, Role)
    assert _capabilities(role) == {
        "MemoryTagged",
        "MeasuresResidentBytes",
        "ReportsHostNeed",
        "ReportsMemoryNeed",
    }


def test_region_role():
    role = RegionRole({"weights": ("caps/weights",), "kv_cache": ("caps/kv",)})
    # memory_tags and memory_regions from its tags, resident_bytes(), host_need().
    assert _capabilities(role) == {
        "MemoryTagged",
        "InMemoryRegions",
        "MeasuresResidentBytes",
        "ReportsHostNeed",
    }
    assert tuple(role.memory_tags) == ("weights", "kv_cache")


def test_recording_role_of_the_testing_module():
    role = RecordingRole("engine", [], {"weights": 10, "kv_cache": 20})
    assert _capabilities(role) == {
        "MemoryTagged",
        "MeasuresResidentBytes",
        "ResizableMemory",
        "ReportsMemoryNeed",
        "ReportsHostNeed",
    }


def test_a_bare_role_has_only_sleep_and_wake_up():
    bare = types.SimpleNamespace(sleep=lambda: None, wake_up=lambda tags=None: None)
    assert isinstance(bare, Role) and _capabilities(bare) == set()
    # A member set to None is no member (as getattr(..., None) read it before).
    assert not isinstance(types.SimpleNamespace(memory_need=None), ReportsMemoryNeed)
