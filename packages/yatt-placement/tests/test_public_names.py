"""The public names of yatt.placement and its public submodules, frozen: adding, renaming or removing
one is a deliberate edit of PUBLIC_NAMES below (and of the README), never a side effect.

A module's public names are its `__all__` (else every name in dir() without a leading "_").
A new public submodule must be listed too.
"""

NUM_GPUS = 0

import pytest

from yatt.testing import check_public_modules, check_public_names

PUBLIC_NAMES: dict[str, list[str]] = {
    "yatt.placement": [
        "FitConfig",
        "HostFit",
        "HostNeed",
        "InMemoryRegions",
        "MeasuresResidentBytes",
        "MemoryFitError",
        "MemoryNeed",
        "MemorySplit",
        "MemoryTagged",
        "PeakGrowth",
        "PendingLoad",
        "PhaseFit",
        "PhaseRecord",
        "Plan",
        "RegionRole",
        "ReportsHostNeed",
        "ReportsMemoryNeed",
        "ResizableMemory",
        "ResizesWhileAwake",
        "Role",
        "TrainerRole",
        "__version__",
        "backup_bytes",
        "capturing",
        "configure_regions",
        "empty_cache",
        "host_bytes_of",
        "is_offload_placeholder",
        "is_offloaded",
        "is_paused",
        "may_sync",
        "offload",
        "offloaded_bytes",
        "offloaded_named_parameters",
        "onload",
        "pause",
        "pinned_host_bytes",
        "plan_host_slabs",
        "read_cuda_free_bytes",
        "read_host_available_bytes",
        "region",
        "region_tags",
        "release",
        "resident_bytes",
        "resume",
        "synchronize",
    ],
    "yatt.placement.testing": [
        "FakeDevice",
        "FakeOutOfMemory",
        "RecordingRole",
    ],
}


@pytest.mark.parametrize("module_name", sorted(PUBLIC_NAMES))
def test_public_names_are_frozen(module_name):
    check_public_names(module_name, PUBLIC_NAMES[module_name], __file__)


def test_every_public_submodule_is_frozen():
    check_public_modules("yatt.placement", PUBLIC_NAMES, __file__)
