"""`--profile`: one extra step after the timed ones under torch.profiler (bench/step/step.py).

Writes a text file per rank 0 and mix: the step's phases (record_function "phase:<name>" ranges,
wall time each), the CUDA kernels by device time and the host operators by CPU time, so the
next GPU run shows where a step's time goes without a second run. `--profile-phase NAME`
profiles that phase alone, so its kernel table is not mixed with the other phases'.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def device_seconds(call: Callable[[], object]) -> float:
    """Wall time of call() with the device work it enqueued: a part of a phase (no profiler
    range of its own, so a profile still lists the step's phases only)."""
    t0 = time.perf_counter()
    call()
    _sync()
    return time.perf_counter() - t0


@contextlib.contextmanager
def timed(phases: dict[str, float], name: str) -> Iterator[None]:
    """Add the body's wall time to phases[name], as a named profiler range."""
    t0 = time.perf_counter()
    with phase_range(name):
        yield
        _sync()  # device work enqueued in the phase belongs to it
    phases[name] = phases.get(name, 0.0) + time.perf_counter() - t0


# (phase, path) while maybe_profile(path, phase=...) runs: phase_range profiles that phase.
_only_phase: tuple[str, Path] | None = None


@contextlib.contextmanager
def phase_range(name: str) -> Iterator[None]:
    """A named range in the profile (costs nothing when no profiler runs)."""
    if _only_phase is not None and _only_phase[0] == name:
        with _profile(_only_phase[1]), torch.profiler.record_function(f"phase:{name}"):
            yield
        return
    with torch.profiler.record_function(f"phase:{name}"):
        yield


@contextlib.contextmanager
def maybe_profile(path: Path | None, phase: str | None = None) -> Iterator[None]:
    """Profile the body into `path` (None: run it plainly); only `phase`'s range if given."""
    global _only_phase
    if path is None:
        yield
        return
    if phase is not None:
        _only_phase = (phase, path)
        try:
            yield
        finally:
            _only_phase = None
        return
    with _profile(path):
        yield


@contextlib.contextmanager
def _profile(path: Path) -> Iterator[None]:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        yield
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tables(prof))
    print(f"wrote {path}", flush=True)


def tables(prof) -> str:
    events = prof.key_averages()
    phases = sorted(
        (e for e in events if e.key.startswith("phase:")), key=lambda e: -e.cpu_time_total
    )
    lines = ["# phases (wall time of each range, ms)"]
    lines += [f"{e.key[6:]:<16} {e.cpu_time_total / 1e3:10.1f}" for e in phases]
    device_sort = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    lines += ["", f"# top kernels/operators by {device_sort}"]
    lines.append(events.table(sort_by=device_sort, row_limit=30, max_name_column_width=70))
    lines += ["", "# top host operators by self_cpu_time_total"]
    lines.append(
        events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70)
    )
    return "\n".join(lines) + "\n"
