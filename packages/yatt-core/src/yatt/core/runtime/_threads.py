"""How many threads torch's CPU kernels use in this process: the CPUs it may run on, shared
among the ranks of its node.

torch's default is every core of the machine, per process: eight ranks on a 64-core host start
512 threads, and on a 2-core machine shared with other processes a train step took 2,352 ms
with the default and 266 ms with one thread (issue 46). The CPUs this process may use are the
fewer of its CPU affinity (taskset, a scheduler's cpuset) and its cgroup's CPU quota (a
container limited to 2 CPUs still sees every core of the host); torchrun's LOCAL_WORLD_SIZE
ranks share them. OMP_NUM_THREADS, when set, is the user's choice and is left alone.

A single rank also counts the CPUs that are idle now (sampled from /proc/stat over a quarter of
a second at start) and takes no more threads than that, at least one: beside other CPU-bound
processes, torch's threads that wait for each other at every kernel's barrier while the
scheduler runs the others were worse than fewer threads (the demo beside two spinning
processes on a 2-core machine: 3.67x its idle time with 2 threads, bench/results/
busy_machine_cpu.md). Ranks of one node start together and would count each other as busy,
so several ranks take only their share of the usable CPUs.
"""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path

import torch

logger = logging.getLogger("yatt.core")

_CGROUP_V2_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")
_CGROUP_V1_QUOTA = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")
_CGROUP_V1_PERIOD = Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us")
_PROC_STAT = Path("/proc/stat")
IDLE_SAMPLE_S = 0.25  # how long the idle CPUs are sampled at start
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


def _cpu_times(stat: Path) -> dict[int, tuple[int, int]]:
    """Per CPU number: (idle + iowait jiffies, all jiffies) from /proc/stat."""
    times = {}
    for line in stat.read_text().splitlines():
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu":
            continue
        jiffies = [int(field) for field in fields[:8]]  # user nice system idle iowait irq ...
        times[int(name[3:])] = (jiffies[3] + jiffies[4], sum(jiffies))
    return times


def count_idle_cpus(
    *, sample_s: float = IDLE_SAMPLE_S, stat: Path | None = None, cpus: set[int] | None = None
) -> float | None:
    """How many of this process's CPUs (its affinity, or `cpus`) were idle over the next
    `sample_s` seconds, from /proc/stat (or `stat`); None where it cannot be read."""
    stat = _PROC_STAT if stat is None else stat
    try:
        cpus = set(os.sched_getaffinity(0)) if cpus is None else cpus
        before = _cpu_times(stat)
        time.sleep(sample_s)
        after = _cpu_times(stat)
    except (AttributeError, OSError, ValueError, IndexError):
        return None
    idle = 0.0
    for cpu in cpus & before.keys() & after.keys():
        total = after[cpu][1] - before[cpu][1]
        idle += (after[cpu][0] - before[cpu][0]) / total if total > 0 else 1.0
    return idle


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
    num_idle = count_idle_cpus() if num_local_ranks == 1 and num_cpus > 1 else None
    if num_idle is not None:
        num_cpus = min(num_cpus, max(1, round(num_idle)))
    num_threads = choose_num_threads(num_cpus, num_local_ranks)
    torch.set_num_threads(num_threads)
    if not _has_logged:
        _has_logged = True
        logger.info(
            "torch CPU threads: %d per rank (%d usable CPUs%s, %d ranks on this node); set "
            "OMP_NUM_THREADS to choose",
            num_threads,
            count_usable_cpus(),
            "" if num_idle is None else f", {num_idle:.1f} idle at start",
            num_local_ranks,
        )
    return num_threads
