"""EngineSpec: an engine chosen and configured as a config section, checked when built, and
build_engine making it."""

NUM_GPUS = 0

from dataclasses import dataclass
from typing import ClassVar

import pytest

from yatt import rollout
from yatt.rollout import _engine_spec


@dataclass(kw_only=True)
class _Rollout(rollout.EngineSpec):
    section: ClassVar[str] = "rollout"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"backend": "tgi"}, r"rollout\.backend='tgi': use 'builtin', 'vllm' or 'sglang'"),
        ({"backend_options": {"x": 1}}, r"rollout\.backend_options=\{'x': 1\}: only for"),
        ({"backend": "vllm", "backend_options": {"gpu_mem": 0.3}}, r"rollout\.backend_options="),
        (
            {"engine": rollout.EngineConfig(max_batch_size=100_000_000)},
            r"rollout\.engine\.max_batch_size=100000000: must be <= 16384",
        ),
    ],
)
def test_bad_values_name_the_trainers_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _Rollout(**kwargs)


def test_the_package_class_names_itself():
    with pytest.raises(ValueError, match=r"EngineSpec\.backend='tgi'"):
        rollout.EngineSpec(backend="tgi")


def test_a_missing_served_engine_names_the_extra(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else find_spec(name)
    )
    with pytest.raises(ValueError, match=r"rollout\.backend='sglang' needs sglang: .*\[sglang\]"):
        _Rollout(backend="sglang").check_installed()
    _Rollout().check_installed()  # the built-in engine is always there


def test_sampling_knobs_an_engine_lacks_are_refused_by_name():
    _Rollout().check_sampling({"top_p": 0.9, "top_k": 20})
    with pytest.raises(ValueError, match=r"rollout\.min_p=0\.05: rollout\.backend='builtin'"):
        _Rollout().check_sampling({"min_p": 0.05})


def test_build_engine_passes_the_policys_tp_size_to_served_engines(monkeypatch):
    made = []
    monkeypatch.setitem(
        _engine_spec._ENGINE_CLASSES, "vllm", lambda model_dir, **kwargs: made.append(kwargs)
    )
    spec = _Rollout(backend="vllm", backend_options={"gpu_memory_utilization": 0.3})
    rollout.build_engine(spec, "model", device="cuda:0", policy_tp_size=2)
    assert made[0]["policy_tp_size"] == 2
    assert made[0]["config"] == rollout.VLLMConfig(gpu_memory_utilization=0.3)


def test_build_engine_builds_the_builtin_engine_on_the_device(tiny_model_dir):
    spec = _Rollout(engine=rollout.EngineConfig(max_seq_len=32, region_prefix="spec"))
    engine = rollout.build_engine(spec, str(tiny_model_dir), device="cpu")
    try:
        assert isinstance(engine, rollout.BuiltinEngine)
        completions = engine.generate(
            [rollout.Request(prompt_ids=[1, 2, 3])], rollout.SamplingParams(max_new_tokens=2)
        )
        assert len(completions[0].response_ids) <= 2
    finally:
        engine.close()
