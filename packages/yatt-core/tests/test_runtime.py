"""Runtime in a single process, metric reduction, and config building."""

from dataclasses import dataclass, field
from typing import Literal

import pytest
import torch
import torch.distributed as dist

from yatt.core import PolicyLoss, config_from_dict, init_runtime, reduce_metrics
from yatt.testing import native_threads

NUM_GPUS = 0


@pytest.fixture(autouse=True)
def _no_torchrun_env(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)


def test_single_process_runtime_has_a_world_of_one():
    with init_runtime(seed=5, device="cpu") as rt:
        assert dist.is_initialized()
        assert (rt.rank, rt.world_size, rt.dp_rank, rt.dp_size, rt.tp_size) == (0, 1, 0, 1, 1)
        assert rt.device == torch.device("cpu") and rt.backend == "gloo"
        assert rt.mesh.mesh_dim_names == ("dp", "tp")
        first = torch.rand(3)
        # Collectives run unchanged in a world of one.
        assert reduce_metrics({"x": 2.0}, group=rt.dp_group) == {"x": 2.0}
    assert not dist.is_initialized()
    with init_runtime(seed=5, device="cpu"):
        assert torch.equal(torch.rand(3), first)  # seeding is deterministic


def test_process_group_is_destroyed_when_the_body_raises():
    with pytest.raises(RuntimeError, match="boom"), init_runtime(device="cpu"):
        raise RuntimeError("boom")
    assert not dist.is_initialized()


@pytest.mark.skipif(native_threads() is None, reason="lists threads through Linux /proc")
def test_shutdown_stops_the_process_groups_threads_while_the_mesh_is_still_referenced():
    # gloo's worker threads left to interpreter exit can abort a finished process
    # ("terminate called without an active exception"); DTensor's caches keep meshes alive.
    before = set(native_threads())
    with init_runtime(device="cpu") as rt:
        started = set(native_threads()) - before
        assert reduce_metrics({"x": 2.0}, group=rt.dp_group) == {"x": 2.0}
        mesh_held_elsewhere = rt.mesh
    assert started, "gloo started no threads: this test would check nothing"
    assert not (set(native_threads()) & started)
    assert mesh_held_elsewhere is not None
    with pytest.raises(RuntimeError, match="shut down"):
        _ = rt.dp_rank


def test_shutdown_hooks_run_last_first_once_and_a_failing_one_still_ends_the_group(caplog):
    calls = []

    def failing():
        calls.append("failing")
        raise RuntimeError("hook broke")

    with init_runtime(device="cpu") as rt:
        rt.on_shutdown(lambda: calls.append(("first", dist.is_initialized())))
        rt.on_shutdown(failing)
        rt.on_shutdown(lambda: calls.append(("last", dist.is_initialized())))
    # Before the groups go (each saw the world alive), the last added first.
    assert calls == [("last", True), "failing", ("first", True)]
    assert "hook broke" in caplog.text
    assert not dist.is_initialized()
    rt.shutdown()
    assert len(calls) == 3  # once


def test_existing_process_group_is_reused_and_kept():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with init_runtime(device="cpu") as rt:
            assert rt.world_size == 1
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("kwargs", "env", "match"),
    [
        pytest.param({"tp_size": 2}, {}, "tp_size", id="tp-does-not-divide"),
        pytest.param({"tp_size": 0}, {}, "tp_size", id="tp-zero"),
        pytest.param({}, {"RANK": "0", "WORLD_SIZE": "1"}, "torchrun", id="partial-env"),
        pytest.param(
            {},
            {
                "RANK": "x",
                "WORLD_SIZE": "1",
                "LOCAL_RANK": "0",
                "MASTER_ADDR": "h",
                "MASTER_PORT": "1",
            },
            "RANK",
            id="non-int-rank",
        ),
    ],
)
def test_bad_runtime_requests_raise_before_joining(monkeypatch, kwargs, env, match):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=match):
        init_runtime(device="cpu", **kwargs)
    assert not dist.is_initialized()


def test_cuda_device_without_cuda_is_an_error():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ValueError, match="CUDA is not available"):
        init_runtime(device="cuda")


def test_reduce_metrics_validates_ops():
    with pytest.raises(ValueError, match="not a reduction"):
        reduce_metrics({"a": 1.0}, ops={"a": "median"})
    with pytest.raises(ValueError, match="not in metrics"):
        reduce_metrics({"a": 1.0}, ops={"b": "sum"})
    assert reduce_metrics({"a": torch.tensor(3.0), "b": 2}) == {"a": 3.0, "b": 2.0}


@dataclass(kw_only=True)
class _Inner:
    lr: float = 1.0


@dataclass(kw_only=True)
class _Outer:
    name: str = "x"
    inner: _Inner = field(default_factory=_Inner)


def test_config_from_dict_builds_nested_and_rejects_unknown_keys():
    cfg = config_from_dict(_Outer, {"name": "y", "inner": {"lr": 0.5}})
    assert cfg == _Outer(name="y", inner=_Inner(lr=0.5))
    with pytest.raises(ValueError, match=r"unknown config key 'inner.lrr'.*did you mean 'lr'"):
        config_from_dict(_Outer, {"inner": {"lrr": 0.5}})
    with pytest.raises(ValueError, match="unknown config key 'zzz'"):
        config_from_dict(_Outer, {"zzz": 1})
    # The dataclass's own validation still runs; in a nested section its error names the
    # dotted path the user typed, not the class.
    with pytest.raises(ValueError, match=r"^PolicyLoss\.clip_low=-0\.1"):
        config_from_dict(PolicyLoss, {"clip_low": -0.1})

    @dataclass(kw_only=True)
    class _Run:
        loss: PolicyLoss = field(default_factory=PolicyLoss)

    with pytest.raises(ValueError, match=r"^loss\.clip_low=-0\.1: must be"):
        config_from_dict(_Run, {"loss": {"clip_low": -0.1}})


@dataclass(kw_only=True)
class _Typed:
    steps: int = 1
    lr: float = 0.1
    name: str = ""
    is_on: bool = False
    limit: int | None = None
    inner: _Inner = field(default_factory=_Inner)


@dataclass(kw_only=True)
class _Engine:
    max_seq_len: int = 64
    region: str = "rollout"
    inner: _Inner = field(default_factory=_Inner)

    def __post_init__(self) -> None:
        if self.max_seq_len < 1:
            raise ValueError("max_seq_len must be >= 1")


@dataclass(kw_only=True)
class _Judge:
    # The parent's own default for its nested section differs from the section's class defaults.
    engine: _Engine = field(
        default_factory=lambda: _Engine(max_seq_len=96, region="genrm", inner=_Inner(lr=3.0))
    )


def test_a_nested_section_is_laid_over_the_fields_own_default():
    """Setting one key of a nested section keeps the rest of the parent's default for it (a
    judge engine given only max_seq_len stayed a "rollout" region and shared its memory)."""
    cfg = config_from_dict(_Judge, {"engine": {"max_seq_len": 16}})
    assert cfg.engine == _Engine(max_seq_len=16, region="genrm", inner=_Inner(lr=3.0))
    deeper = config_from_dict(_Judge, {"engine": {"inner": {}}})
    assert deeper.engine.inner == _Inner(lr=3.0) and deeper.engine.region == "genrm"
    assert config_from_dict(_Judge, {}).engine.max_seq_len == 96
    with pytest.raises(ValueError, match="max_seq_len must be >= 1"):  # checked after the merge
        config_from_dict(_Judge, {"engine": {"max_seq_len": 0}})


def test_config_from_dict_coerces_exact_scalars():
    # YAML reads 1e-3 (no dot) as a string; 3.0 for an int field is exact.
    cfg = config_from_dict(_Typed, {"steps": "3", "lr": "1e-3", "limit": None, "inner": {"lr": 2}})
    assert cfg == _Typed(steps=3, lr=0.001, limit=None, inner=_Inner(lr=2.0))
    assert isinstance(cfg.inner.lr, float) and config_from_dict(_Typed, {"steps": 3.0}).steps == 3


@pytest.mark.parametrize(
    ("values", "match"),
    [
        pytest.param({"steps": "abc"}, r"steps='abc': must be an int", id="word-for-int"),
        pytest.param({"steps": 2.5}, r"steps=2.5: must be an int", id="fraction-for-int"),
        pytest.param({"steps": True}, r"steps=True: must be an int", id="bool-for-int"),
        pytest.param({"inner": {"lr": "fast"}}, r"inner.lr='fast': must be a float", id="nested"),
        pytest.param({"is_on": 1}, r"is_on=1: must be a bool", id="int-for-bool"),
        pytest.param({"name": 7}, r"name=7: must be a str", id="int-for-str"),
        pytest.param({"steps": None}, r"steps: a value is required", id="none-for-int"),
        pytest.param({"inner": None}, r"section 'inner' is empty", id="empty-section"),
    ],
)
def test_config_from_dict_names_the_field_of_a_wrong_type(values, match):
    with pytest.raises(ValueError, match=match):
        config_from_dict(_Typed, values)


@dataclass(kw_only=True)
class _Documented:
    """A config.

    mode: a docstring paragraph naming a field that has a comment: the comment wins.

    kind: the docstring's doc of a field without a comment, e.g. ("a", "b"). Only the first
    sentence is shown.
    """

    steps: int = 3  # optimizer steps
    inner: _Inner = field(default_factory=lambda: _Inner(lr=0.5))
    path: str  # where it goes
    # How often to save. Only the first sentence is shown.
    every: int = 5
    # A long comment block above a field that goes on and on, well past what one line of help
    # should hold, so it is cut at a word
    mode: str = "fast"
    kind: str = "a"
    order: Literal["up", "down"] = "up"


def test_describe_config_lists_leaf_fields_with_defaults_and_comments():
    from yatt.core import describe_config

    assert describe_config(_Documented) == [
        "steps = 3  # optimizer steps",
        "inner.lr = 0.5",  # the factory's value, not the nested class's default
        "path = (required)  # where it goes",
        "every = 5  # How often to save",
        "mode = 'fast'  # A long comment block above a field that goes on and on, well past what one"
        " line of help should...",
        'kind = \'a\'  # the docstring\'s doc of a field without a comment, e.g. ("a", "b")',
        "order = 'up'  # one of 'up', 'down'",
    ]
