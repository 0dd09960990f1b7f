import sys
import threading
import types

import pytest
import torch

from yatt.placement import (
    _backends,
    configure_regions,
    is_paused,
    pause,
    region,
    region_tags,
    release,
    resident_bytes,
    resume,
)
from yatt.placement._regions import _Registry

NUM_GPUS = 0

pytestmark = pytest.mark.usefixtures("cpu_regions")


def test_bytes_are_counted_per_tag_and_zero_while_paused():
    with region("w", enable_cpu_backup=True):
        weights = torch.empty(1000, dtype=torch.float32)
        view = weights[:10]  # a view allocates nothing
        view.add_(1)  # nor does an in-place op
    with region("kv"):
        kv = torch.empty(300, dtype=torch.bfloat16)
    outside = torch.empty(5000)
    assert resident_bytes("w") == 4000
    assert resident_bytes("kv") == 600
    pause("kv")
    assert (resident_bytes("w"), resident_bytes("kv")) == (4000, 0)
    assert is_paused("kv") and not is_paused("w")
    resume("kv")
    assert resident_bytes("kv") == 600
    del weights, view, kv, outside


def test_freed_tensors_leave_the_books():
    with region("tmp"):
        a = torch.empty(100)
        b = torch.empty(50)
    del a
    assert resident_bytes("tmp") == 200
    del b
    assert resident_bytes("tmp") == 0


def test_cpu_backup_keeps_contents_and_no_backup_poisons_them():
    with region("w", enable_cpu_backup=True):
        model = torch.nn.Linear(8, 8)
    with region("kv"):
        cache = torch.arange(16, dtype=torch.float32)
    weight = model.weight.detach().clone()
    pause("w", "kv")
    # Reading paused memory is a bug; on CPU it reads NaN instead of faulting.
    assert torch.isnan(model.weight).all()
    resume("w", "kv")
    assert torch.equal(model.weight, weight)
    assert torch.isnan(cache).all()


def test_nested_regions_belong_to_the_innermost_tag():
    with region("outer"):
        a = torch.empty(10)
        with region("inner"):
            b = torch.empty(20)
        c = torch.empty(30)
    assert resident_bytes("outer") == 4 * (10 + 30)
    assert resident_bytes("inner") == 4 * 20
    del a, b, c


def test_module_built_in_a_region_counts_its_parameters():
    with region("m", enable_cpu_backup=True):
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    expected = sum(p.nbytes for p in model.parameters())
    assert resident_bytes("m") == expected


def test_allocations_in_other_threads_are_not_claimed():
    out = {}
    with region("t"):
        thread = threading.Thread(target=lambda: out.setdefault("x", torch.empty(100)))
        thread.start()
        thread.join()
        mine = torch.empty(10)
    assert resident_bytes("t") == 40
    del mine


def test_pause_errors_leave_everything_as_it_was():
    with region("a"):
        a = torch.empty(10)
    with region("b"):
        b = torch.empty(10)
    with pytest.raises(ValueError, match="'nope' has no region"):
        pause("a", "nope")
    assert not is_paused("a")
    pause("b")
    with pytest.raises(RuntimeError, match="already paused"):
        pause("a", "b")
    assert not is_paused("a")
    with pytest.raises(RuntimeError, match="not paused"):
        resume("a")
    with pytest.raises(ValueError, match="repeated"):
        resume("b", "b")
    with pytest.raises(ValueError, match="at least one tag"):
        pause()
    del a, b


def test_region_rules():
    with region("w", enable_cpu_backup=True):
        pass
    with pytest.raises(ValueError, match="enable_cpu_backup"), region("w"):
        pass
    with pytest.raises(ValueError, match="non-empty string"), region(""):
        pass
    pause("w")
    with pytest.raises(RuntimeError, match="paused"), region("w", enable_cpu_backup=True):
        pass
    resume("w")
    with region("w", enable_cpu_backup=True), pytest.raises(RuntimeError, match="own open region"):
        pause("w")
    assert region_tags() == ("w",)


def test_a_released_paused_tag_stays_paused_until_a_new_owner_opens_it():
    # An owner (an engine) pauses its tag, frees its tensors and releases the tag on close.
    with region("kv"):
        cache = torch.empty(100)
    pause("kv")
    del cache
    release("kv")
    assert is_paused("kv")  # its memory stays given back while nobody owns it
    with region("kv"):  # a new owner: resumed first, then allocated in
        cache = torch.arange(4, dtype=torch.float32)
    assert not is_paused("kv")
    assert resident_bytes("kv") == 16
    pause("kv")
    assert torch.isnan(cache).all()  # the tag is live again: a pause reaches the new tensors
    resume("kv")
    del cache


def test_a_tag_that_is_not_released_still_refuses_a_region_while_paused():
    # Released, then taken by a new owner: the next pause is an ordinary one again.
    with region("kv"):
        pass
    release("kv")
    with region("kv"):
        pass
    pause("kv")
    with pytest.raises(RuntimeError, match="paused"), region("kv"):
        pass
    resume("kv")
    with region("kv"), pytest.raises(RuntimeError, match="own open region"):
        release("kv")
    with pytest.raises(ValueError, match="has no region"):
        release("nope")


def test_configure_after_first_region_must_not_change_settings():
    registry = _Registry()
    registry.configure("cpu", "torch")
    with registry.region("x", False):
        pass
    assert registry.backend().name == "cpu"
    registry.configure("cpu", "torch")  # same settings: fine
    with pytest.raises(RuntimeError, match="before the first region"):
        registry.configure("cuda", "torch")
    with pytest.raises(ValueError, match="hook_mode='ld'"):
        configure_regions(hook_mode="ld")
    with pytest.raises(ValueError, match="backend='gpu'"):
        configure_regions(backend="gpu")


def test_auto_backend_follows_cuda_availability():
    registry = _Registry()
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert registry.backend().name == expected


class _FakeSaver:
    """torch_memory_saver's singleton, as far as the CUDA backend touches it."""

    def __init__(self) -> None:
        self._impl = None
        self.hook_mode_set: str | None = None
        self.retain_sets: list[bool] = []

    @property
    def hook_mode(self):
        raise AttributeError

    @hook_mode.setter
    def hook_mode(self, value: str) -> None:
        self.hook_mode_set = value

    @property
    def retain_cpu_backup(self) -> bool:
        return bool(self.retain_sets and self.retain_sets[-1])

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, value: bool) -> None:
        # The real setter initialises the singleton: the hook mode must be chosen before.
        assert self.hook_mode_set is not None
        self.retain_sets.append(value)


@pytest.fixture
def fake_saver(monkeypatch: pytest.MonkeyPatch) -> _FakeSaver:
    saver = _FakeSaver()
    module = types.ModuleType("torch_memory_saver")
    module.torch_memory_saver = saver
    monkeypatch.setitem(sys.modules, "torch_memory_saver", module)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.delenv("TMS_RETAIN_CPU_BACKUP", raising=False)
    # Keep the process's real exit hook (a GPU run registers one) away from the fake.
    monkeypatch.setattr(_backends.atexit, "register", lambda *args: None)
    monkeypatch.setattr(_backends.atexit, "unregister", lambda *args: None)
    return saver


@pytest.mark.parametrize(
    ("retain", "env", "expected"),
    [
        (None, None, [True]),
        (True, None, [True]),
        (False, None, [False]),
        (False, "1", [False]),
        (None, "0", []),
        (True, "0", [True]),
    ],
    ids=["default-on", "on", "off", "off-over-env", "env-decides", "on-over-env"],
)
def test_cuda_backend_retains_cpu_backups_unless_told_not_to(
    fake_saver, monkeypatch, retain, env, expected
):
    if env is not None:
        monkeypatch.setenv("TMS_RETAIN_CPU_BACKUP", env)
    registry = _Registry()
    registry.configure("cuda", "torch", retain_cpu_backup=retain)
    assert registry.backend().name == "cuda"
    assert fake_saver.hook_mode_set == "torch"
    assert fake_saver.retain_sets == expected
    # Retention is on exactly when asked for, or by default without the variable.
    assert fake_saver.retain_cpu_backup is (retain is True or (retain is None and env is None))


def test_retain_cpu_backup_is_left_alone_off_cuda_and_checked(fake_saver, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)  # a ROCm or XPU build
    monkeypatch.setattr(torch.version, "hip", "6.2")
    registry = _Registry()
    registry.configure("cuda", "torch", retain_cpu_backup=True)
    registry.backend()
    assert fake_saver.retain_sets == []
    with pytest.raises(ValueError, match="retain_cpu_backup='yes'"):
        configure_regions(retain_cpu_backup="yes")
