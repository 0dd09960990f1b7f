"""yatt.placement's capture guard: a CUDA-graph capture never overlaps another thread's
device-wide synchronisation (the rule from the CUDA programming guide's stream-capture section:
synchronising the device while any stream captures invalidates the capture). Threads on CPU;
the order of events is the behaviour."""

from __future__ import annotations

import threading

import pytest

from yatt.placement import _capture_guard
from yatt.placement._capture_guard import CaptureGuard

WAIT_S = 5.0


def _start(target) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def _section(guard: CaptureGuard, kind: str):
    return guard.capturing() if kind == "capture" else guard.may_sync()


@pytest.mark.parametrize(
    ("held", "waiting"),
    [("sync", "capture"), ("capture", "sync")],
    ids=["capture_waits_for_a_sync", "sync_waits_for_a_capture"],
)
def test_a_section_of_one_thread_waits_for_the_other_kind_held_elsewhere(held, waiting):
    guard, events = CaptureGuard(), []
    inside, release = threading.Event(), threading.Event()

    def hold():
        with _section(guard, held):
            events.append(f"{held} begins")
            inside.set()
            release.wait(WAIT_S)
            events.append(f"{held} ends")

    def wait():
        with _section(guard, waiting):
            events.append(waiting)

    holder = _start(hold)
    assert inside.wait(WAIT_S)
    waiter = _start(wait)
    waiter.join(0.2)
    assert waiter.is_alive(), f"a {waiting} ran beside another thread's open {held}"
    release.set()
    waiter.join(WAIT_S)
    holder.join(WAIT_S)
    assert events == [f"{held} begins", f"{held} ends", waiting]


def test_sync_sections_of_two_threads_run_side_by_side():
    guard = CaptureGuard()
    both_inside = threading.Barrier(2, timeout=WAIT_S)

    def syncing():
        with guard.may_sync():
            both_inside.wait()  # breaks (raises) if the second thread cannot enter

    threads = [_start(syncing) for _ in range(2)]
    for thread in threads:
        thread.join(WAIT_S)
    assert not both_inside.broken


def test_a_waiting_capture_holds_back_new_sync_sections():
    """Writer preference: a stream of short syncs cannot starve a capture."""
    guard, events = CaptureGuard(), []
    in_sync, release_sync = threading.Event(), threading.Event()

    def first_sync():
        with guard.may_sync():
            in_sync.set()
            release_sync.wait(WAIT_S)
            events.append("first sync ends")

    def capture():
        with guard.capturing():
            events.append("capture")

    def late_sync():
        with guard.may_sync():
            events.append("late sync")

    first = _start(first_sync)
    assert in_sync.wait(WAIT_S)
    capturer = _start(capture)
    capturer.join(0.1)  # now waiting for the first sync
    late = _start(late_sync)
    late.join(0.2)
    assert late.is_alive(), "a new sync section entered while a capture waited"
    release_sync.set()
    for thread in (first, capturer, late):
        thread.join(WAIT_S)
    assert events == ["first sync ends", "capture", "late sync"]


def test_the_capturing_thread_may_sync_and_nest():
    """A capture's warm-up runs compiled code (a may_sync section) in the capturing thread."""
    guard = CaptureGuard()
    done = []

    def capture():
        with guard.capturing(), guard.may_sync(), guard.capturing():
            done.append(True)

    thread = _start(capture)
    thread.join(WAIT_S)
    assert done == [True]


def test_a_thread_inside_its_own_sync_section_may_capture_and_sync_again():
    guard, done = CaptureGuard(), []

    def nested():
        with guard.may_sync(), guard.capturing(), guard.may_sync():
            done.append(True)

    thread = _start(nested)
    thread.join(WAIT_S)
    assert done == [True]


def test_an_exception_releases_the_guard():
    guard = CaptureGuard()
    with pytest.raises(RuntimeError), guard.capturing():
        raise RuntimeError("capture failed")
    with pytest.raises(RuntimeError), guard.may_sync():
        raise RuntimeError("sync failed")
    entered = []

    def other():
        with guard.capturing(), guard.may_sync():
            entered.append(True)

    thread = _start(other)
    thread.join(WAIT_S)
    assert entered == [True]


def test_placement_sync_points_go_through_the_guard(monkeypatch):
    """Plan switches, offload and the fit's cache release synchronise through the guard: with a
    capture held by another thread they wait (CPU: the guard is entered even without CUDA)."""
    from yatt.placement import _capture_guard

    entered = []

    class Recording(CaptureGuard):
        def may_sync(self):
            entered.append(threading.get_ident())
            return super().may_sync()

    monkeypatch.setattr(_capture_guard, "_GUARD", Recording())
    monkeypatch.setattr(_capture_guard.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_capture_guard.torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(_capture_guard.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(_capture_guard.torch.cuda, "empty_cache", lambda: None)
    from yatt.placement import _fit, _offload, _plan

    _plan._synchronize()
    _offload._synchronize_all()
    _fit.release_cuda_cache()
    assert len(entered) == 3


@pytest.mark.parametrize("holder", ["capture", "sync"])
def test_guard_waits_are_logged_when_long(monkeypatch, caplog, holder):
    # A wait past the threshold is logged (what waits, who captures), then waits on: a stuck
    # guard shows in the run's log instead of a silent hang.
    monkeypatch.setattr(_capture_guard, "_SLOW_WAIT_S", 0.05)
    guard = CaptureGuard()
    inside, release = threading.Event(), threading.Event()

    def hold():
        with _section(guard, holder):
            inside.set()
            release.wait(5)

    holder_thread = threading.Thread(target=hold, daemon=True)
    holder_thread.start()
    assert inside.wait(5)
    timer = threading.Timer(0.3, release.set)
    timer.start()
    waiting = _section(guard, "sync" if holder == "capture" else "capture")
    with caplog.at_level("WARNING", logger=_capture_guard.__name__), waiting:
        pass
    holder_thread.join(5)
    waited = "a device synchronisation" if holder == "capture" else "a CUDA-graph capture"
    assert any(f"{waited} has waited" in r.getMessage() for r in caplog.records)
