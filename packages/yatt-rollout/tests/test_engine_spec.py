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


@pytest.mark.parametrize("backend", ["builtin", "vllm", "sglang"])
def test_every_engine_takes_the_four_sampling_knobs(backend):
    knobs = {"top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1}
    assert _Rollout(backend=backend).sampling_kwargs(**knobs) == knobs
    # What it returns builds the engines' SamplingParams as is.
    sampling = rollout.SamplingParams(n=2, **_Rollout(backend=backend).sampling_kwargs(**knobs))
    assert (sampling.min_p, sampling.repetition_penalty) == (0.05, 1.1)


def test_sampling_kwargs_default_to_every_knob_off():
    assert _Rollout().sampling_kwargs() == {
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
    }


@pytest.mark.parametrize(
    ("knobs", "match"),
    [
        ({"top_p": 0.0}, r"rollout\.top_p=0\.0: must be in \(0, 1\]"),
        ({"top_k": -1}, r"rollout\.top_k=-1: must be an int >= 0"),
        ({"top_k": 2.5}, r"rollout\.top_k=2\.5: must be an int"),
        ({"min_p": 1.5}, r"rollout\.min_p=1\.5: must be in \[0, 1\]"),
        ({"repetition_penalty": 0.0}, r"rollout\.repetition_penalty=0\.0: must be a finite"),
        ({"repetition_penalty": float("nan")}, r"rollout\.repetition_penalty=nan"),
        ({"repetition_penalty": 12.0}, r"rollout\.repetition_penalty=12\.0: must be <= 10"),
    ],
    ids=["top_p", "top_k", "top_k-float", "min_p", "penalty-0", "penalty-nan", "penalty-big"],
)
def test_sampling_kwargs_out_of_range_name_the_trainers_field(knobs, match):
    with pytest.raises(ValueError, match=match):
        _Rollout().sampling_kwargs(**knobs)


def test_sglang_takes_a_repetition_penalty_up_to_its_own_limit():
    # SGLang's SamplingParams.verify: repetition_penalty in [0, 2].
    assert _Rollout(backend="sglang").sampling_kwargs(repetition_penalty=2.0)
    with pytest.raises(ValueError, match=r"rollout\.repetition_penalty=2\.5: .*'sglang' takes at"):
        _Rollout(backend="sglang").sampling_kwargs(repetition_penalty=2.5)
    assert _Rollout(backend="vllm").sampling_kwargs(repetition_penalty=2.5)


def test_sampling_knobs_an_engine_lacks_are_refused_by_name(monkeypatch):
    # An engine without min_p (none of today's three): a set value is refused by name, the
    # off value passes.
    monkeypatch.setitem(_engine_spec.SAMPLING_KNOBS, "sglang", ("top_p", "top_k"))
    spec = _Rollout(backend="sglang")
    assert spec.sampling_kwargs(top_p=0.9, top_k=20, min_p=0.0)["top_k"] == 20
    with pytest.raises(ValueError, match=r"rollout\.min_p=0\.05: rollout\.backend='sglang'"):
        spec.sampling_kwargs(min_p=0.05)
    with pytest.raises(ValueError, match=r"does not take repetition_penalty"):
        spec.sampling_kwargs(repetition_penalty=1.2)


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
