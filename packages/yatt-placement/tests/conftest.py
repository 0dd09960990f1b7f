import pytest

from yatt.placement import _regions
from yatt.placement._backends import CpuBookkeepingBackend


@pytest.fixture
def cpu_regions(monkeypatch: pytest.MonkeyPatch) -> _regions._Registry:
    """A fresh registry on the bookkeeping backend, so tests share no tags (even on a GPU host)."""
    registry = _regions._Registry(CpuBookkeepingBackend())
    monkeypatch.setattr(_regions, "_REGISTRY", registry)
    return registry


@pytest.fixture
def fresh_regions(monkeypatch: pytest.MonkeyPatch) -> _regions._Registry:
    """A fresh registry that picks its backend as a user's would (CUDA when available)."""
    registry = _regions._Registry()
    monkeypatch.setattr(_regions, "_REGISTRY", registry)
    return registry
