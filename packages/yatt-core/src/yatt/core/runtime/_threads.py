"""How many threads torch's CPU kernels use in this process: the CPUs it may run on, shared
among the ranks of its node.

torch's default is every core of the machine, per process: eight ranks on a 64-core host start
512 threads, and on a 2-core machine shared with other processes a train step took 2,352 ms
with the default and 266 ms with one thread (issue 46). The CPUs this process may use are the
fewer of its CPU affinity (taskset, a scheduler's cpuset) and its cgroup's CPU quota (a
container limited to 2 CPUs still sees every core of the host); torchrun's LOCAL_WORLD_SIZE
ranks share them. OMP_NUM_THREADS, when set, is the user's choice and is left alone.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import torch

logger = logging.getLogger("yatt.core")

_CGROUP_V2_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")
_CGROUP_V1_QUOTA = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")
_CGROUP_V1_PERIOD = Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us")
_has_logged = False


def count_usable_cpus(*, cpu_max: Path | None = None, v1_quota: Path | None = None) -> int:
    """CPUs this process may use: its affinity, bounded by a cgroup CPU quota (rounded up).
    cpu_max, v1_quota: the cgroup files (default: this process's, v2 then v1)."""
    cpu_max = _CGROUP_V2_CPU_MAX if cpu_max is None else cpu_max
    v1_quota = _CGROUP_V1_QUOTA if v1_quota is None else v1_quota
    try:
        num_cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        num_cpus = os.cpu_count() or 1
    quota = _cgroup_quota(cpu_max, v1_quota)
    if quota is not None:
        num_cpus = min(num_cpus, max(1, math.ceil(quota)))
    return max(1, num_cpus)


def _cgroup_quota(cpu_max: Path, v1_quota: Path) -> float | None:
    """The cgroup's CPU quota in CPUs, or None without one ("max", or no cgroup file)."""
    try:
        quota, period = cpu_max.read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int(v1_quota.read_text())
        period_us = int(v1_quota.with_name(_CGROUP_V1_PERIOD.name).read_text())
    except (OSError, ValueError):
        return None
    return None if quota_us <= 0 else quota_us / period_us


def choose_num_threads(num_cpus: int, num_local_ranks: int) -> int:
    """Threads per rank: the usable CPUs shared evenly among the node's ranks, at least 1."""
    return max(1, num_cpus // max(1, num_local_ranks))


def size_torch_threads() -> int | None:
    """Set torch's intra-op threads for this rank (see the module docstring); the number set,
    or None when OMP_NUM_THREADS chose it. Logged once per process."""
    global _has_logged
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    num_cpus = count_usable_cpus()
    num_local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    num_threads = choose_num_threads(num_cpus, num_local_ranks)
    torch.set_num_threads(num_threads)
    if not _has_logged:
        _has_logged = True
        logger.info(
            "torch CPU threads: %d per rank (%d usable CPUs, %d ranks on this node); set "
            "OMP_NUM_THREADS to choose",
            num_threads,
            num_cpus,
            num_local_ranks,
        )
    return num_threads
