"""GPU memory regions that pause and resume, offload/onload, and placement plans for RL steps."""

from yatt.placement._capabilities import (
    InMemoryRegions,
    MeasuresResidentBytes,
    MemoryTagged,
    ResizableMemory,
    ResizesWhileAwake,
)
from yatt.placement._capture_guard import capturing, empty_cache, may_sync, synchronize
from yatt.placement._fit import FitConfig, PeakGrowth, read_cuda_free_bytes
from yatt.placement._needs import (
    HostFit,
    HostNeed,
    MemoryFitError,
    MemoryNeed,
    PhaseFit,
    ReportsHostNeed,
    ReportsMemoryNeed,
    read_host_available_bytes,
)
from yatt.placement._offload import (
    host_bytes_of,
    is_offload_placeholder,
    is_offloaded,
    offload,
    offloaded_bytes,
    offloaded_named_parameters,
    onload,
    pinned_host_bytes,
    plan_host_slabs,
)
from yatt.placement._plan import Plan
from yatt.placement._records import PhaseRecord
from yatt.placement._regions import (
    backup_bytes,
    configure_regions,
    is_paused,
    pause,
    region,
    region_tags,
    release,
    resident_bytes,
    resume,
)
from yatt.placement._roles import RegionRole, Role, TrainerRole
from yatt.placement._split import MemorySplit, PendingLoad
from yatt.placement._version import __version__

__all__ = [
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
]
