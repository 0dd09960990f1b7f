"""Each engine satisfies the capability protocols it has (yatt.rollout.Abortable,
AcceptsImages, SupportsLabelLogprobs), so callers check isinstance instead of getattr.

Expected per engine, from what each documents (and, as placement roles, yatt.placement's
protocols): all three abort in-flight requests; all three
fill label_logprobs (the built-in engine from its own logits, vLLM through a probe request,
SGLang through token_ids_logprob); the built-in engine says whether its model takes images
(a text model: no, a Qwen2-VL: yes). The vLLM and SGLang adapters say it as `is_multimodal`,
not `accepts_images`, so they do not declare AcceptsImages (a caller keeps its default).
"""

from __future__ import annotations

import sys
import types

import pytest

from yatt import placement
from yatt.rollout import (
    Abortable,
    AcceptsImages,
    BuiltinEngine,
    EngineConfig,
    RolloutEngine,
    SGLangEngine,
    SupportsLabelLogprobs,
    VLLMEngine,
)
from yatt.rollout.testing import sglang_modules, vllm_modules

NUM_GPUS = 0


@pytest.fixture
def fake_backends(monkeypatch):
    for name, module in {**vllm_modules(), **sglang_modules()}.items():
        monkeypatch.setitem(sys.modules, name, module)
    for name in ("RANK", "WORLD_SIZE", "VLLM_ENABLE_V1_MULTIPROCESSING"):
        monkeypatch.delenv(name, raising=False)


def test_builtin_engine_has_every_capability(tiny_model_dir):
    engine = BuiltinEngine(
        tiny_model_dir, config=EngineConfig(max_batch_size=2, max_seq_len=64, region_prefix="cap")
    )
    try:
        assert isinstance(engine, RolloutEngine)
        assert isinstance(engine, Abortable)
        assert isinstance(engine, SupportsLabelLogprobs) and engine.supports_label_logprobs is True
        assert isinstance(engine, AcceptsImages) and engine.accepts_images is False  # text model
        # As a placement role: tagged wake-ups, its own regions and byte count, a KV-cache share
        # it applies by itself while awake, its host need.
        for capability in (
            placement.MemoryTagged,
            placement.InMemoryRegions,
            placement.MeasuresResidentBytes,
            placement.ResizableMemory,
            placement.ResizesWhileAwake,
            placement.ReportsHostNeed,
        ):
            assert isinstance(engine, capability), capability.__name__
        assert engine.resizes_while_awake is True
    finally:
        engine.close()


def test_builtin_engine_on_a_vision_model_accepts_images(tmp_path):
    pytest.importorskip("PIL", reason="make_tiny_vlm needs Pillow")
    from yatt.testing import make_tiny_vlm

    make_tiny_vlm(tmp_path, arch="qwen2_vl")
    engine = BuiltinEngine(
        tmp_path, config=EngineConfig(max_batch_size=2, max_seq_len=256, region_prefix="capvl")
    )
    try:
        assert isinstance(engine, AcceptsImages) and engine.accepts_images is True
    finally:
        engine.close()


@pytest.mark.parametrize("engine_cls", [VLLMEngine, SGLangEngine])
def test_adapters_abort_and_report_label_logprobs(fake_backends, engine_cls):
    engine = engine_cls("/models/x")
    try:
        assert isinstance(engine, RolloutEngine)
        assert isinstance(engine, Abortable)
        assert isinstance(engine, SupportsLabelLogprobs) and engine.supports_label_logprobs is True
        # Images follow the served model (the fakes serve a text model): is_multimodal.
        assert isinstance(engine, AcceptsImages)
        assert engine.accepts_images is engine.is_multimodal is False
        # As a placement role: a device need from their own settings, no byte count of their own.
        assert isinstance(engine, placement.ReportsMemoryNeed)
        assert not isinstance(engine, placement.MeasuresResidentBytes)
    finally:
        engine.close()


def test_objects_without_the_members_are_not_capable():
    plain = types.SimpleNamespace(generate=lambda *a: [])
    assert not isinstance(plain, Abortable)
    assert not isinstance(plain, AcceptsImages)
    assert not isinstance(plain, SupportsLabelLogprobs)
    # A member set to None blocks a method protocol, as typing documents.
    assert not isinstance(types.SimpleNamespace(abort=None), Abortable)
    assert isinstance(types.SimpleNamespace(abort=lambda: None), Abortable)
    assert isinstance(types.SimpleNamespace(accepts_images=False), AcceptsImages)
