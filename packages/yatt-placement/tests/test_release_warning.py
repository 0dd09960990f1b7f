"""The offload release warning: only for memory really held back, not for allocator rounding."""

NUM_GPUS = 0

import logging

import pytest

from yatt.placement import _offload


@pytest.fixture
def reserved(monkeypatch):
    """Device memory reserved after empty_cache, set by the test (no GPU needed)."""
    state = {"after": 0}
    monkeypatch.setattr(_offload.torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(_offload, "_reserved_bytes", lambda devices: state["after"])
    return state


@pytest.mark.parametrize(
    ("moved", "before", "after", "should_warn"),
    [
        pytest.param(0, 0, 0, False, id="nothing-moved"),
        pytest.param(300_000, 2**20, 2**20, False, id="under-a-mib-kept"),
        pytest.param(64 * 2**20, 64 * 2**20, 0, False, id="all-returned"),
        pytest.param(64 * 2**20, 64 * 2**20, 32 * 2**20, True, id="half-kept"),
    ],
)
def test_warns_only_when_a_mib_or_more_is_held_back(
    reserved, caplog, moved, before, after, should_warn
):
    reserved["after"] = after
    with caplog.at_level(logging.WARNING):
        _offload._release_device_memory([], moved_bytes=moved, before=before)
    assert ("returned only" in caplog.text) == should_warn, caplog.text
    if should_warn:
        assert "64.0 MiB to host" in caplog.text and "only 32.0 MiB" in caplog.text
