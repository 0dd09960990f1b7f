"""A LoRA adapter synced to vLLM and SGLang: the wire format as PEFT's (checked by PEFT itself on
a tiny local model), each sync replacing the served adapter, and the refusals (no GPU: the
engines are the fakes of yatt.rollout.testing, which mirror vLLM 0.26.0 and SGLang 0.5.17)."""

NUM_GPUS = 0

import copy
import json
import sys
from pathlib import Path

import pytest
import torch

from yatt.rollout import Request, SamplingParams, SGLangConfig, SGLangEngine, VLLMConfig, VLLMEngine
from yatt.rollout._engine_lora import (
    AdapterFolders,
    lora_engine_options,
    peft_adapter,
)
from yatt.rollout.testing import sglang_modules, vllm_modules

RANK, SCALING = 4, 2.0  # lora_alpha = 8
TARGETS = ("q_proj", "v_proj")


@pytest.fixture
def fakes(monkeypatch):
    for name, module in {**vllm_modules(), **sglang_modules()}.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
    )
    return LlamaForCausalLM(config).eval()


def wire_adapter(model, seed: int = 1) -> list[tuple[str, torch.Tensor]]:
    """yatt.core's sync format, hand-built: random A [r, in] and B [out, r] per target."""
    generator = torch.Generator().manual_seed(seed)
    pairs = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in TARGETS:
            a = torch.randn(RANK, module.in_features, generator=generator)
            b = torch.randn(module.out_features, RANK, generator=generator)
            pairs += [
                (f"{name}.lora_A", a),
                (f"{name}.lora_B", b),
                (f"{name}.lora_scaling", torch.tensor(SCALING)),
            ]
    return pairs


def test_peft_reloads_the_converted_adapter_as_the_merged_weights(tmp_path):
    """PEFT loading the written folder into the base computes what W + scaling B A does."""
    import peft

    base = tiny_llama()
    pairs = wire_adapter(base)
    adapter = peft_adapter(pairs, "vLLM")
    assert adapter.config["r"] == RANK and adapter.config["lora_alpha"] == 8
    assert adapter.config["target_modules"] == sorted(TARGETS)
    folder = AdapterFolders(tmp_path).write(adapter, "v1")
    assert sorted(p.name for p in folder.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]

    merged = copy.deepcopy(base)
    by_name = dict(pairs)
    with torch.no_grad():
        for name, module in merged.named_modules():
            if name.rsplit(".", 1)[-1] in TARGETS:
                delta = by_name[f"{name}.lora_B"] @ by_name[f"{name}.lora_A"]
                module.weight += SCALING * delta
    served = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(folder)).eval()
    ids = torch.tensor([[1, 5, 7, 3, 9, 2]])
    with torch.no_grad():
        expected = merged(ids).logits
        got = served(ids).logits
        plain = base(ids).logits
    assert not torch.allclose(plain, expected, atol=1e-3)  # the adapter changes the output
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_conversion_names_are_peft_s(tmp_path):
    pairs = [
        ("model.layers.0.self_attn.q_proj.lora_A", torch.ones(2, 8)),
        ("model.layers.0.self_attn.q_proj.lora_B", torch.ones(6, 2)),
        ("model.layers.0.self_attn.q_proj.lora_scaling", torch.tensor(0.75)),
    ]
    adapter = peft_adapter(pairs, "SGLang")
    assert sorted(adapter.tensors) == [
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight",
    ]
    assert adapter.config["lora_alpha"] == 1.5 and adapter.module_names == [
        "model.layers.0.self_attn.q_proj"
    ]


@pytest.mark.parametrize(
    "pairs, match",
    [
        ([("lm_head.weight.lora_saved", torch.zeros(4, 4))], "modules_to_save"),
        ([("model.embed_tokens.weight", torch.zeros(4, 4))], "a full weight in an adapter"),
        ([("m.q_proj.lora_A", torch.zeros(2, 4))], r"lacks \['.lora_B', '.lora_scaling'\]"),
        (
            [
                ("m.q_proj.lora_A", torch.zeros(2, 4)),
                ("m.q_proj.lora_B", torch.zeros(4, 3)),
                ("m.q_proj.lora_scaling", torch.tensor(1.0)),
            ],
            r"expected \[r, in\] and \[out, r\]",
        ),
        (
            [
                ("a.q_proj.lora_A", torch.zeros(2, 4)),
                ("a.q_proj.lora_B", torch.zeros(4, 2)),
                ("a.q_proj.lora_scaling", torch.tensor(1.0)),
                ("a.v_proj.lora_A", torch.zeros(2, 4)),
                ("a.v_proj.lora_B", torch.zeros(4, 2)),
                ("a.v_proj.lora_scaling", torch.tensor(2.0)),
            ],
            "differ in rank or scale",
        ),
    ],
    ids=["module-to-save", "full-weight", "missing-part", "shapes", "two-scales"],
)
def test_conversion_refusals(pairs, match):
    with pytest.raises(ValueError, match=match):
        peft_adapter(pairs, "vLLM")


def small_adapter(seed: int, module: str = "model.layers.0.self_attn.q_proj", rank: int = 4):
    generator = torch.Generator().manual_seed(seed)
    return [
        (f"{module}.lora_A", torch.randn(rank, 8, generator=generator)),
        (f"{module}.lora_B", torch.randn(8, rank, generator=generator)),
        (f"{module}.lora_scaling", torch.tensor(2.0)),
    ]


def test_vllm_each_sync_replaces_the_adapter_and_later_requests_carry_it(fakes, tmp_path):
    engine = VLLMEngine(
        "/models/x", config=VLLMConfig(enable_lora=True, lora_adapter_dir=str(tmp_path))
    )
    llm_engine = engine._llm.llm_engine
    assert engine._llm.kwargs["enable_lora"] and engine._llm.kwargs["max_loras"] == 1
    requests = [Request(prompt_ids=[3, 4]), Request(prompt_ids=[5], use_adapter=False)]
    sampling = SamplingParams(max_new_tokens=2)
    engine.generate(requests, sampling)  # before any sync: the base
    assert set(llm_engine.seen_loras.values()) == {None}
    for version in (1, 2):
        engine.update_weights(small_adapter(seed=version))
        assert llm_engine.list_loras() == {version}  # the old one removed
        folders = [p for p in Path(engine._folders.root).iterdir() if not p.name.startswith(".")]
        assert [p.name for p in folders] == [f"yatt-{engine._engine_tag}-v{version}"]
        llm_engine.seen_loras.clear()
        engine.generate(requests, sampling)
        loras = {rid.rsplit("-", 2)[-2]: lora for rid, lora in llm_engine.seen_loras.items()}
        assert loras["0"].lora_int_id == version and loras["1"] is None
        _, tensors, config = llm_engine.loras[version]
        expected = dict(small_adapter(seed=version))
        torch.testing.assert_close(
            tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"],
            expected["model.layers.0.self_attn.q_proj.lora_B"],
        )
        assert config["lora_alpha"] == 8
    assert llm_engine.lazy_loads == []  # registered by the sync, never loaded by a request
    assert engine._llm.calls[-1] == ("reset_prefix_cache",)
    root = engine._folders.root
    engine.close()
    assert not root.exists()


def test_sglang_each_sync_replaces_the_adapter_from_memory(fakes):
    engine = SGLangEngine("/models/x", config=SGLangConfig(enable_lora=True, max_lora_rank=8))
    fake = engine._engine
    assert fake.kwargs["enable_lora"] and fake.kwargs["lora_target_modules"] == ["all"]
    requests = [Request(prompt_ids=[3, 4]), Request(prompt_ids=[5], use_adapter=False)]
    sampling = SamplingParams(max_new_tokens=2)
    for version in (1, 2):
        engine.update_weights(small_adapter(seed=version))
        assert list(fake.loras) == [f"yatt-lora-v{version}"]
        fake.seen_loras.clear()
        engine.generate(requests, sampling)
        assert sorted(fake.seen_loras, key=str) == [None, f"yatt-lora-v{version}"]
    assert [c[0] for c in fake.calls if "lora" in c[0]] == [
        "load_lora_from_tensors",
        "unload_lora",
        "load_lora_from_tensors",
    ]
    assert fake.calls[-1] == ("flush",)
    engine.close()


def test_sglang_without_the_from_tensors_call_loads_a_tmpfs_folder(fakes, tmp_path):
    config = SGLangConfig(enable_lora=True, lora_adapter_dir=str(tmp_path))
    engine = SGLangEngine("/models/x", config=config)
    engine._engine.load_lora_adapter_from_tensors = None  # an SGLang without it
    engine.update_weights(small_adapter(seed=1))
    engine.update_weights(small_adapter(seed=2))
    loads = [c for c in engine._engine.calls if c[0] == "load_lora"]
    assert [c[1] for c in loads] == ["yatt-lora-v1", "yatt-lora-v2"]
    assert not Path(loads[0][2]).exists() and Path(loads[1][2]).exists()  # the old removed
    config_json = json.loads((Path(loads[1][2]) / "adapter_config.json").read_text())
    assert config_json["r"] == 4
    root = engine._folders.root
    engine.close()
    assert not root.exists()


def test_engines_refuse_an_adapter_they_cannot_serve(fakes, tmp_path):
    vllm_engine = VLLMEngine(
        "/models/x",
        config=VLLMConfig(enable_lora=True, max_lora_rank=8, lora_adapter_dir=str(tmp_path)),
    )
    sglang_engine = SGLangEngine(
        "/models/x", config=SGLangConfig(enable_lora=True, max_lora_rank=8)
    )
    for engine, name in ((vllm_engine, "VLLMConfig"), (sglang_engine, "SGLangConfig")):
        with pytest.raises(ValueError, match=rf"rank 16 is over {name}.max_lora_rank=8"):
            engine.update_weights(small_adapter(seed=1, rank=16))
        with pytest.raises(ValueError, match=r"does not adapt \['visual.blocks.0.attn.qkv'\]"):
            engine.update_weights(small_adapter(seed=1, module="visual.blocks.0.attn.qkv"))
        with pytest.raises(ValueError, match="modules_to_save"):
            engine.update_weights(
                [*small_adapter(seed=1), ("lm_head.weight.lora_saved", torch.zeros(2))]
            )
    assert vllm_engine._llm.llm_engine.list_loras() == set()
    assert sglang_engine._engine.loras == {}
    vllm_engine.close()
    sglang_engine.close()
    with pytest.raises(ValueError, match=r"VLLMConfig.lora_adapter_dir='/no/such/dir'"):
        VLLMEngine(
            "/models/x", config=VLLMConfig(enable_lora=True, lora_adapter_dir="/no/such/dir")
        )
    with pytest.raises(ValueError, match=r"VLLMConfig.max_lora_rank=12: vLLM takes one of"):
        VLLMConfig(enable_lora=True, max_lora_rank=12)


def options(backend, given=None, **lora):
    values = {"rank": 8, "target_modules": "all-linear", "modules_to_save": (), **lora}
    return lora_engine_options(
        backend,
        given or {},
        **values,
        options_field="rollout.backend_options",
        lora_field="policy.lora",
    )


def test_lora_engine_options_fill_what_the_engine_needs():
    assert options("vllm", rank=12) == {"enable_lora": True, "max_lora_rank": 16}
    assert options("vllm", {"max_lora_rank": 64}) == {"enable_lora": True, "max_lora_rank": 64}
    assert options("sglang", rank=12, target_modules=("q_proj", "model.layers.0.mlp.up_proj")) == {
        "enable_lora": True,
        "max_lora_rank": 12,
        "lora_target_modules": ["q_proj", "up_proj"],
    }
    assert options("sglang")["lora_target_modules"] == ["all"]
    VLLMConfig(**options("vllm", rank=3))  # what it fills, the config takes
    SGLangConfig(**options("sglang", rank=3))


@pytest.mark.parametrize(
    "backend, given, lora, match",
    [
        (
            "vllm",
            None,
            {"modules_to_save": ("lm_head",)},
            r"policy.lora.modules_to_save=\['lm_head'\]",
        ),
        ("sglang", None, {"modules_to_save": ("lm_head",)}, "modules_to_save"),
        (
            "vllm",
            {"max_lora_rank": 8},
            {"rank": 16},
            r"max_lora_rank=8 is below policy.lora.rank=16",
        ),
        ("vllm", None, {"rank": 1024}, "vLLM serves LoRA ranks up to 512"),
        ("vllm", {"max_lora_rank": 24}, {}, r"max_lora_rank=24: vLLM takes one of"),
        ("sglang", {"enable_lora": False}, {}, r"rollout.backend_options.enable_lora=False"),
        ("sglang", None, {"target_modules": ("qkv", "fc1")}, r"does not adapt \['qkv', 'fc1'\]"),
    ],
    ids=[
        "vllm-saved",
        "sglang-saved",
        "rank-over-max",
        "vllm-rank",
        "vllm-odd-max",
        "off",
        "names",
    ],
)
def test_lora_engine_options_refusals(backend, given, lora, match):
    with pytest.raises(ValueError, match=match):
        options(backend, given, **lora)
