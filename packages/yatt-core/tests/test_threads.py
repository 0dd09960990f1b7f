"""torch's CPU threads are sized to this rank's share of the CPUs it may use (affinity, cgroup
quota, ranks on the node), unless OMP_NUM_THREADS chose them."""

NUM_GPUS = 0

import logging

import pytest
import torch

from yatt.core import init_runtime
from yatt.core.runtime import _threads


@pytest.fixture
def threads(monkeypatch, tmp_path):
    """torch's thread count restored after the test; no cgroup quota; 4 CPUs of affinity."""
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(_threads, "_CGROUP_V2_CPU_MAX", tmp_path / "none")
    monkeypatch.setattr(_threads, "_CGROUP_V1_QUOTA", tmp_path / "none_v1")
    monkeypatch.setattr(_threads.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(_threads, "_has_logged", False)
    monkeypatch.setattr(_threads, "count_idle_cpus", lambda: 4.0)  # an idle machine
    yield monkeypatch
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("num_cpus", "num_local_ranks", "want"),
    [(2, 1, 2), (2, 2, 1), (1, 8, 1), (64, 8, 8), (7, 2, 3)],
)
def test_each_rank_gets_its_share_of_the_cpus(num_cpus, num_local_ranks, want):
    assert _threads.choose_num_threads(num_cpus, num_local_ranks) == want


@pytest.mark.parametrize(
    ("cpu_max", "want"), [("150000 100000\n", 2), ("max 100000\n", 4), ("50000 100000\n", 1)]
)
def test_a_cgroup_quota_bounds_the_usable_cpus(threads, tmp_path, cpu_max, want):
    (tmp_path / "cpu.max").write_text(cpu_max)
    assert _threads.count_usable_cpus(cpu_max=tmp_path / "cpu.max") == want


def test_a_cgroup_v1_quota_bounds_the_usable_cpus(threads, tmp_path):
    (tmp_path / "cpu.cfs_quota_us").write_text("200000\n")
    (tmp_path / "cpu.cfs_period_us").write_text("100000\n")
    got = _threads.count_usable_cpus(
        cpu_max=tmp_path / "none", v1_quota=tmp_path / "cpu.cfs_quota_us"
    )
    assert got == 2


def test_init_runtime_sizes_torch_threads_and_logs_once(threads, caplog):
    threads.setenv("LOCAL_WORLD_SIZE", "2")
    torch.set_num_threads(3)
    with caplog.at_level(logging.INFO, logger="yatt.core"):
        with init_runtime(device="cpu"):
            assert torch.get_num_threads() == 2  # 4 CPUs, 2 ranks on the node
        with init_runtime(device="cpu"):
            pass
    assert sum("torch CPU threads: 2 per rank" in r.message for r in caplog.records) == 1


def test_omp_num_threads_is_the_users_choice(threads):
    threads.setenv("OMP_NUM_THREADS", "3")
    torch.set_num_threads(3)
    with init_runtime(device="cpu"):
        assert torch.get_num_threads() == 3


def _stat(idle_by_cpu: dict[int, int], busy_by_cpu: dict[int, int]) -> str:
    """A /proc/stat with the aggregate line and one line per CPU (user nice system idle iowait
    irq softirq steal guest guest_nice)."""
    lines = ["cpu  1 2 3 4 5 6 7 8 9 10"]
    for cpu in sorted(idle_by_cpu):
        lines.append(f"cpu{cpu} {busy_by_cpu[cpu]} 0 0 {idle_by_cpu[cpu]} 0 0 0 0 0 0")
    return "\n".join([*lines, "intr 1 2 3", "ctxt 5"]) + "\n"


def test_idle_cpus_are_counted_over_the_affinity_from_proc_stat(tmp_path, monkeypatch):
    # Over the window: cpu0 idle the whole time, cpu1 busy, cpu2 half idle, cpu3 idle but not
    # in the affinity: 1 + 0 + 0.5 = 1.5 idle CPUs.
    stat = tmp_path / "stat"
    snapshots = iter(
        [
            _stat({0: 100, 1: 100, 2: 100, 3: 100}, {0: 50, 1: 50, 2: 50, 3: 50}),
            _stat({0: 200, 1: 100, 2: 150, 3: 200}, {0: 50, 1: 150, 2: 100, 3: 50}),
        ]
    )
    stat.write_text(next(snapshots))
    monkeypatch.setattr(_threads.time, "sleep", lambda s: stat.write_text(next(snapshots)))
    got = _threads.count_idle_cpus(stat=stat, cpus={0, 1, 2})
    assert got == pytest.approx(1.5)
    assert _threads.count_idle_cpus(stat=tmp_path / "missing", cpus={0}) is None


@pytest.mark.parametrize(("num_idle", "want"), [(4.0, 4), (1.6, 2), (0.2, 1), (None, 4)])
def test_one_rank_takes_no_more_threads_than_idle_cpus(threads, num_idle, want):
    threads.setattr(_threads, "count_idle_cpus", lambda: num_idle)
    with init_runtime(device="cpu"):
        assert torch.get_num_threads() == want


def test_ranks_of_one_node_do_not_count_each_other_as_busy(threads):
    threads.setenv("LOCAL_WORLD_SIZE", "2")
    threads.setattr(_threads, "count_idle_cpus", lambda: 0.0)  # the other rank is loading
    with init_runtime(device="cpu"):
        assert torch.get_num_threads() == 2
