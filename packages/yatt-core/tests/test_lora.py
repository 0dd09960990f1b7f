"""TorchPolicy with LoRA (policy.lora, through PEFT) in one process: only the adapter trains
and holds optimizer state; the merged full weights and the adapter tensors describe the same
model; the reference is the base; the checkpoint holds the adapter alone and resumes exactly;
bad settings are ValueErrors naming the field before a model loads."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from yatt.core import (
    Batch,
    LoraConfig,
    PolicyLoss,
    TorchPolicy,
    TorchPolicyConfig,
    compute_grpo_advantages,
    policy_config_from_dict,
)
from yatt.core.policy import _lora

NUM_GPUS = 0
RANK, ALPHA = 4, 8.0  # scaling alpha / rank = 2


def _config(model_dir, /, **overrides):
    base = {
        "model_dir": str(model_dir),
        "lr": 1e-2,
        "dtype": "float32",
        "parallel": "none",
        "grad_clip": None,
        "lora": LoraConfig(rank=RANK, alpha=ALPHA),
    }
    return TorchPolicyConfig(**{**base, **overrides})


def _batch(lengths=(6, 13, 4, 9), seed=0):
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for i, length in enumerate(lengths):
        mask = torch.zeros(length, dtype=torch.int64)
        mask[2:] = 1
        ids = torch.randint(5, 200, (length,), generator=gen)
        rows.append({"input_ids": ids, "loss_mask": mask, "group_id": i // 2, "reward": float(i)})
    batch = Batch.from_samples(rows, token_keys=["input_ids", "loss_mask"])
    batch.samples["advantages"] = compute_grpo_advantages(batch["reward"], batch["group_id"])
    return batch


def _step(policy, seed=0):
    batch = _batch(seed=seed)
    batch.tokens["old_logprobs"] = policy.logprobs(batch)
    metrics = policy.train_step(batch, PolicyLoss())
    assert metrics["is_skipped"] == 0.0
    return metrics


def _hf_logprobs(model, batch):
    """[B, T] logprobs of each input token (0 at t = 0, and on padding) from a plain forward."""
    out = torch.zeros(batch["input_ids"].shape)
    for i, length in enumerate(batch.lengths.tolist()):
        ids = batch["input_ids"][i : i + 1, :length]
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1].float()
        out[i, 1:length] = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
    return out


def _is_adapter(name):
    return ".lora_A." in name or ".lora_B." in name


@pytest.fixture
def policy(tiny_model_dir):
    """A float32 TorchPolicy with the rank-4 adapter (_config's defaults), one per test (each
    trains, saves or sleeps it)."""
    return TorchPolicy(_config(tiny_model_dir))


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any model load fails the test: a config check must come before it."""

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the check")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_loading)


def test_only_the_adapter_gets_gradients_and_optimizer_state(policy):
    base = {n: p.detach().clone() for n, p in policy.module.named_parameters()}
    seen_grads = {}

    def remember(name):
        return lambda grad: seen_grads.__setitem__(name, grad.abs().sum().item())

    for name, param in policy.module.named_parameters():
        if param.requires_grad:
            param.register_hook(remember(name))
    _step(policy)
    trainable = {n for n, p in policy.module.named_parameters() if p.requires_grad}
    # all-linear on the tiny llama: q, k, v, o, gate, up, down per layer, each an A and a B.
    assert trainable and all(_is_adapter(n) for n in trainable)
    assert len(trainable) == 2 * 7 * 2
    assert set(seen_grads) == trainable
    # B starts at zero, so A's first gradient is zero too (d/dA = B^T ...); B's is not.
    assert all(seen_grads[n] > 0 for n in trainable if ".lora_B." in n)
    names = {id(p): n for n, p in policy.module.named_parameters()}
    held = {names[id(p)] for group in policy.optimizer.param_groups for p in group["params"]}
    assert held == trainable
    assert {names[id(p)] for p in policy.optimizer.state} == trainable
    for name, param in policy.module.named_parameters():
        if not _is_adapter(name):
            assert torch.equal(param, base[name]), name  # the base is frozen
    assert any(not torch.equal(p, base[n]) for n, p in policy.module.named_parameters())


def test_merged_weights_are_the_trained_function_and_name_the_hf_model(tiny_model_dir, policy):
    _step(policy)
    _step(policy, seed=1)  # A and B both moved
    # compared on the CPU, where the reference model is (the policy is on CUDA on a GPU host)
    merged = {name: tensor.cpu() for name, tensor in policy.named_weights()}
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert list(merged) == [n for n, _ in hf.named_parameters()]
    # Hand-merged from the adapter's own tensors: W + (alpha / rank) B A.
    adapter = {name: tensor.cpu() for name, tensor in policy.named_adapter_weights()}
    name = "model.layers.1.mlp.down_proj"
    assert adapter[name + ".lora_scaling"].item() == ALPHA / RANK
    expected = hf.get_parameter(name + ".weight") + (ALPHA / RANK) * (
        adapter[name + ".lora_B"] @ adapter[name + ".lora_A"]
    )
    torch.testing.assert_close(merged[name + ".weight"], expected, atol=1e-6, rtol=1e-6)
    hf.load_state_dict(merged)
    batch = _batch(seed=3)
    # float32 forward of the same function, two factorings of one matmul: a few ulps apart.
    torch.testing.assert_close(
        policy.logprobs(batch).cpu(),
        _hf_logprobs(hf, batch) * batch["attention_mask"],
        atol=1e-5,
        rtol=0,
    )


def test_reference_logprobs_are_the_base_models(tiny_model_dir, policy):
    _step(policy)
    _step(policy, seed=1)
    batch = _batch(seed=3)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    expected = _hf_logprobs(base, batch) * batch["attention_mask"]
    torch.testing.assert_close(policy.reference_logprobs(batch), expected, atol=1e-5, rtol=0)
    # The adapter is back on afterwards, and it changed the function (not a vacuous check).
    trained = policy.logprobs(batch)
    assert (trained - expected).abs().max() > 1e-3
    assert all(p.requires_grad for n, p in policy.module.named_parameters() if _is_adapter(n))


def test_reference_logprobs_need_lora(tiny_model_dir):
    policy = TorchPolicy(_config(tiny_model_dir, lora=None))
    with pytest.raises(ValueError, match="lora is None"):
        policy.reference_logprobs(_batch())
    with pytest.raises(ValueError, match="lora is None"):
        next(policy.named_adapter_weights())


def test_checkpoint_holds_the_adapter_only_and_resumes_exactly(tiny_model_dir, tmp_path, policy):
    ckpt = pytest.importorskip("yatt.ckpt")  # a sibling: installed beside yatt-core
    from yatt.ckpt._state import collect_state_dict, flatten_tensors, validate_state

    _step(policy)
    state = policy.state()
    saved = flatten_tensors(collect_state_dict(state, validate_state(state)))
    model_keys = [k for k in saved if k.startswith("model.")]
    optimizer_keys = [k for k in saved if k.startswith("optimizer.state.")]
    assert model_keys and all(_is_adapter(k) for k in model_keys)
    assert optimizer_keys and all(_is_adapter(k) for k in optimizer_keys)
    num_saved = sum(saved[k].numel() for k in model_keys)
    num_adapter = sum(p.numel() for n, p in policy.module.named_parameters() if _is_adapter(n))
    assert num_saved == num_adapter
    with ckpt.Checkpointer(tmp_path / "ckpts", async_save=False) as checkpointer:
        checkpointer.save(1, policy.state(), extra={"step": 1})
        _step(policy, seed=1)
        resumed = TorchPolicy(_config(tiny_model_dir))
        assert checkpointer.load(resumed.state()) == {"step": 1}
    _step(resumed, seed=1)
    assert resumed.num_steps == policy.num_steps == 2
    for (name, a), (_, b) in zip(
        policy.module.named_parameters(), resumed.module.named_parameters(), strict=True
    ):
        assert torch.equal(a, b), name


def test_resume_on_another_base_names_the_model_dir(tmp_path, policy):
    ckpt = pytest.importorskip("yatt.ckpt")
    from yatt.testing import make_tiny_causal_lm

    other = tmp_path / "other-base"
    make_tiny_causal_lm(other, arch="llama", max_position_embeddings=64, seed=1)
    with ckpt.Checkpointer(tmp_path / "ckpts", async_save=False) as checkpointer:
        checkpointer.save(1, policy.state(), extra={"step": 1})
        elsewhere = TorchPolicy(_config(other))  # same shapes, other weights
        with pytest.raises(ValueError, match=r"policy\.model_dir=.*other-base.*not the base"):
            checkpointer.load(elsewhere.state())


def test_fingerprint_follows_config_and_weights_not_formatting(tiny_model_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    fingerprint = _lora.compute_base_fingerprint(tiny_model_dir, model)
    assert fingerprint.dtype == torch.uint8 and fingerprint.shape == (32,)
    copy = tmp_path / "reformatted"
    copy.mkdir()
    config = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(config, indent=7))
    assert torch.equal(_lora.compute_base_fingerprint(str(copy), model), fingerprint)
    with torch.no_grad():
        model.model.embed_tokens.weight[0, 0] += 1.0
    assert not torch.equal(_lora.compute_base_fingerprint(tiny_model_dir, model), fingerprint)


def test_yaml_mapping_becomes_a_lora_config(tiny_model_dir):
    config = policy_config_from_dict(
        "torch",
        {
            "model_dir": tiny_model_dir,
            "parallel": "none",
            "lora": {"rank": 8, "target_modules": ["q_proj", "v_proj"]},
        },
    )
    assert config.lora == LoraConfig(rank=8, target_modules=("q_proj", "v_proj"))
    policy = TorchPolicy(config)
    targets = {n.rsplit(".", 1)[-1] for n in policy.lora_scalings}
    assert targets == {"q_proj", "v_proj"}


@pytest.mark.parametrize(
    ("lora", "match"),
    [
        pytest.param({"rank": 0}, r"policy\.lora\.rank=0", id="rank-0"),
        pytest.param({"alpha": 0.0}, r"policy\.lora\.alpha=0\.0", id="alpha-0"),
        pytest.param({"alpha": -2.0}, r"policy\.lora\.alpha=-2\.0", id="alpha-negative"),
        pytest.param({"dropout": 1.0}, r"policy\.lora\.dropout=1\.0", id="dropout-1"),
        pytest.param({"target_modules": []}, r"policy\.lora\.target_modules", id="no-targets"),
        pytest.param(
            {"target_modules": ["q_proj", ""]}, r"policy\.lora\.target_modules", id="empty-name"
        ),
        pytest.param({"modules_to_save": [""]}, r"policy\.lora\.modules_to_save", id="empty-saved"),
        pytest.param(
            {"target_modules": ["q_proj", "qkv_proj"]},
            r"policy\.lora\.target_modules: 'qkv_proj' matches no module.*q_proj",
            id="unmatched-name",
        ),
        pytest.param(
            {"target_modules": "model\\.nothing\\..*"},
            r"policy\.lora\.target_modules: .* matches no module",
            id="unmatched-regex",
        ),
        pytest.param(
            {"target_modules": ["lm_head"]}, r"policy\.lora\.target_modules: .*LM head", id="head"
        ),
        pytest.param({"rank": 8, "rnak": 2}, r"policy\.lora\.rnak.*'rank'", id="unknown-key"),
    ],
)
def test_bad_lora_settings_name_the_field_before_a_model_loads(
    tiny_model_dir, lora, match, no_model_loads
):
    with pytest.raises(ValueError, match=match):
        policy_config_from_dict("torch", {"model_dir": tiny_model_dir, "lora": lora})


def test_rank_one_is_an_adapter_like_any_other():
    # rank >= 1 (issue 45): the smallest adapter is valid, its scale alpha / rank
    assert LoraConfig(rank=1, alpha=2.0).scaling == 2.0


def test_lora_conflicts_and_the_megatron_backend_are_refused(tiny_model_dir):
    with pytest.raises(ValueError, match=r"TorchPolicyConfig\.lora with is_reference"):
        _config(tiny_model_dir, is_reference=True)
    with pytest.raises(ValueError, match=r"TorchPolicyConfig\.lora with should_train_vision"):
        _config(tiny_model_dir, should_train_vision=True)
    with pytest.raises(ValueError, match=r"policy\.lora: LoRA runs on the torch backend only"):
        policy_config_from_dict("megatron", {"model_dir": tiny_model_dir, "lora": {"rank": 8}})


def test_the_policys_adapter_sync_serves_its_merged_weights(tiny_model_dir, policy):
    rollout = pytest.importorskip("yatt.rollout")  # a sibling: installed beside yatt-core
    engines = [
        rollout.BuiltinEngine(
            tiny_model_dir,
            config=rollout.EngineConfig(max_batch_size=2, max_seq_len=64, region_prefix=prefix),
        )
        for prefix in ("policy-lora-adapter", "policy-lora-full")
    ]
    for seed in (0, 1):  # two steps, two syncs: the second replaces the first adapter
        _step(policy, seed=seed)
        engines[0].update_weights(policy.named_adapter_weights())
        engines[1].update_weights(policy.named_weights())
        served = [dict(e.model.named_parameters()) for e in engines]
        for name, tensor in served[1].items():
            assert torch.equal(served[0][name], tensor), (seed, name)
    for engine in engines:
        engine.close()


def test_the_policys_live_adapter_bound_to_an_engine_serves_each_step(tiny_model_dir, policy):
    """named_adapter_weights(live=True) yields the trained parameters themselves: an engine
    binds them once (lora_mode="beside") and each refresh after an optimizer step serves
    exactly what an engine given the step's adapter through update_weights serves."""
    rollout = pytest.importorskip("yatt.rollout")  # a sibling: installed beside yatt-core
    trained = {id(p) for p in policy.module.parameters() if p.requires_grad}
    live = list(policy.named_adapter_weights(live=True))
    assert {id(t) for n, t in live if not n.endswith(".lora_scaling")} == trained
    engines = [
        rollout.BuiltinEngine(
            tiny_model_dir,
            config=rollout.EngineConfig(
                max_batch_size=2, max_seq_len=64, region_prefix=prefix, lora_mode="beside"
            ),
        )
        for prefix in ("policy-lora-bound", "policy-lora-synced")
    ]
    binding = engines[0].bind_adapter(live)
    requests = [rollout.Request(prompt_ids=[5, 9, 13, 2]), rollout.Request(prompt_ids=[7, 3])]
    sampling = rollout.SamplingParams(temperature=1.0, max_new_tokens=6, seed=3)
    served = []
    for seed in (0, 1):
        _step(policy, seed=seed)
        binding.refresh()
        engines[1].update_weights(policy.named_adapter_weights())
        got, want = (e.generate(requests, sampling) for e in engines)
        assert [c.logprobs for c in got] == [c.logprobs for c in want], seed
        served.append([c.logprobs for c in got])
    assert served[0] != served[1]  # the second step changed what the binding serves
    for engine in engines:
        engine.close()


def test_the_adapter_exports_in_peft_format_and_merged_as_a_plain_folder(
    tiny_model_dir, tmp_path, policy
):
    from peft import PeftModel

    from yatt.core import export_hf, export_lora_adapter

    _step(policy)
    _step(policy, seed=1)
    batch = _batch(seed=3)
    expected = policy.logprobs(batch)
    adapter_dir = export_lora_adapter(policy, tmp_path / "adapter", dtype="float32")
    assert {p.name for p in adapter_dir.iterdir()} >= {
        "adapter_config.json",
        "adapter_model.safetensors",
    }
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    reloaded = PeftModel.from_pretrained(base, adapter_dir)
    got = _hf_logprobs(reloaded, batch) * batch["attention_mask"]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    merged_dir = export_hf(policy, tmp_path / "merged", dtype="float32")
    plain = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
    assert not any("lora" in n or "base_layer" in n for n, _ in plain.named_parameters())
    got = _hf_logprobs(plain, batch) * batch["attention_mask"]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="no LoRA adapter"):
        export_lora_adapter(TorchPolicy(_config(tiny_model_dir, lora=None)), tmp_path / "none")


def test_checkpointing_and_a_sleep_leave_the_adapters_step_unchanged(tiny_model_dir):
    plain = TorchPolicy(_config(tiny_model_dir))
    other = TorchPolicy(_config(tiny_model_dir, gradient_checkpointing=True))
    other.sleep()
    other.wake_up()
    for policy in (plain, other):
        _step(policy)
    adapters = [dict(p.named_adapter_weights()) for p in (plain, other)]
    for name, tensor in adapters[0].items():
        torch.testing.assert_close(adapters[1][name], tensor, atol=1e-6, rtol=0, msg=name)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bf16 policy/engine)")
@pytest.mark.parametrize("saved", [(), ("lm_head",)], ids=["adapter", "adapter+head"])
def test_cuda_bf16_adapter_sync_serves_the_merged_full_sync(tmp_path, saved):
    rollout = pytest.importorskip("yatt.rollout")
    from yatt.testing import make_tiny_causal_lm

    model_dir = tmp_path / "bf16"
    make_tiny_causal_lm(model_dir, arch="qwen2", seed=0, dtype=torch.bfloat16)
    lora = LoraConfig(rank=RANK, alpha=ALPHA, modules_to_save=saved)
    policy = TorchPolicy(_config(model_dir, dtype="bfloat16", lora=lora))
    assert policy.device.type == "cuda"
    engines = [
        rollout.BuiltinEngine(
            model_dir,
            config=rollout.EngineConfig(
                device="cuda", dtype="bfloat16", max_batch_size=2, max_seq_len=64, region_prefix=p
            ),
        )
        for p in ("cuda-lora-adapter", "cuda-lora-full")
    ]
    for seed in (0, 1, 2):
        _step(policy, seed=seed)
        engines[0].update_weights(policy.named_adapter_weights())
        engines[1].update_weights(policy.named_weights())
        served = [dict(e.model.named_parameters()) for e in engines]
        for name, tensor in served[1].items():
            # One GPU computes B A for both paths: the same bf16 rounding of W + scaling B A.
            assert torch.equal(served[0][name], tensor), (seed, name)
    for engine in engines:
        engine.close()


def test_a_lora_checkpoint_is_not_exported_as_a_model(tiny_model_dir, tmp_path, policy):
    ckpt = pytest.importorskip("yatt.ckpt")
    from yatt.core import export_hf_from_checkpoint

    with ckpt.Checkpointer(tmp_path / "ckpts", async_save=False) as checkpointer:
        checkpointer.save(1, policy.state(), extra={"step": 1})
        folder = checkpointer.verify(1).path
    with pytest.raises(ValueError, match=r"holds a LoRA adapter.*export_lora_adapter"):
        export_hf_from_checkpoint(folder, tmp_path / "hf", model_dir=tiny_model_dir)
    assert not (tmp_path / "hf").exists()


def test_a_bf16_policy_holds_its_frozen_linears_in_bf16_with_the_same_steps(
    tiny_model_dir, monkeypatch
):
    """Autocast computes every matmul from a bf16 cast of its float32 weight: a frozen base
    held in bf16 gives the same logprobs and adapter steps, in half the bytes."""
    import yatt.core.policy._torch_policy as torch_policy

    held = TorchPolicy(_config(tiny_model_dir, dtype="bfloat16"))
    monkeypatch.setattr(torch_policy, "cast_frozen_linears", lambda model, dtype: 0)
    master = TorchPolicy(_config(tiny_model_dir, dtype="bfloat16"))
    dtypes = {n: p.dtype for n, p in held.module.named_parameters()}
    assert dtypes["model.layers.0.self_attn.q_proj.base_layer.weight"] == torch.bfloat16
    assert dtypes["model.layers.1.mlp.down_proj.base_layer.weight"] == torch.bfloat16
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        assert dtypes[name] == torch.float32, name
    assert all(dtypes[n] == torch.float32 for n in dtypes if _is_adapter(n))
    assert all(p.dtype == torch.float32 for p in master.module.parameters())
    batch = _batch(seed=3)
    assert torch.equal(held.logprobs(batch), master.logprobs(batch))
    for policy in (held, master):
        _step(policy)
        _step(policy, seed=1)
    adapters = [dict(p.named_adapter_weights()) for p in (held, master)]
    for name, tensor in adapters[1].items():
        assert torch.equal(adapters[0][name], tensor), name
    assert torch.equal(held.reference_logprobs(batch), master.reference_logprobs(batch))
    assert held.resident_bytes() < 0.8 * master.resident_bytes()


def test_the_memory_a_placement_plan_sees_is_the_adapters(tiny_model_dir):
    policy = TorchPolicy(_config(tiny_model_dir, dtype="bfloat16"))
    _step(policy)
    adapter = [p for n, p in policy.module.named_parameters() if _is_adapter(n)]
    num_adapter = sum(p.numel() for p in adapter)
    need = policy.memory_need()
    assert need.peak["gradients"] == 4 * num_adapter  # float32 gradients of A and B only
    # AdamW: exp_avg and exp_avg_sq per adapter element, and a float32 step count per tensor.
    assert need.resident["optimizer"] == 8 * num_adapter + 4 * len(adapter)
    weights = [*policy.module.parameters(), *policy.module.buffers()]
    assert need.resident["weights"] == sum(t.nbytes for t in weights)


# -- modules_to_save: modules trained whole beside the adapter (PEFT's field) --------------------

HEAD_TRAINED = "lm_head.modules_to_save.default.weight"  # PEFT's trained copy of the head
HEAD_BASE = "lm_head.original_module.weight"  # the original, frozen: the adapter-off base


def _with_head(model_dir, /, **overrides):
    lora = LoraConfig(rank=RANK, alpha=ALPHA, modules_to_save=["lm_head"])
    return _config(model_dir, lora=lora, **overrides)


def _is_trained(name):
    return _is_adapter(name) or name == HEAD_TRAINED


def test_modules_to_save_train_whole_beside_the_adapter_and_the_reference_is_the_base(
    tiny_model_dir,
):
    policy = TorchPolicy(_with_head(tiny_model_dir))
    assert policy.config.lora.modules_to_save == ("lm_head",)  # YAML's list, kept as a tuple
    base = {n: p.detach().clone() for n, p in policy.module.named_parameters()}
    seen_grads = {}
    for name, param in policy.module.named_parameters():
        if param.requires_grad:
            param.register_hook(lambda g, n=name: seen_grads.__setitem__(n, g.abs().sum().item()))
    _step(policy)
    _step(policy, seed=1)
    trainable = {n for n, p in policy.module.named_parameters() if p.requires_grad}
    assert trainable == {n for n in base if _is_adapter(n)} | {HEAD_TRAINED}
    assert set(seen_grads) == trainable and seen_grads[HEAD_TRAINED] > 0
    names = {id(p): n for n, p in policy.module.named_parameters()}
    held = {names[id(p)] for group in policy.optimizer.param_groups for p in group["params"]}
    assert held == trainable == {names[id(p)] for p in policy.optimizer.state}
    for name, param in policy.module.named_parameters():
        if not _is_trained(name):
            assert torch.equal(param, base[name]), name  # the base, its head included, frozen
    assert not torch.equal(policy.module.get_parameter(HEAD_TRAINED), base[HEAD_TRAINED])
    # The reference (adapter off) is the base model, its own head included.
    batch = _batch(seed=3)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    expected = _hf_logprobs(hf, batch) * batch["attention_mask"]
    torch.testing.assert_close(policy.reference_logprobs(batch), expected, atol=1e-5, rtol=0)
    assert policy.module.get_parameter(HEAD_TRAINED).requires_grad  # back on afterwards
    # The full sync names the Hugging Face model, the head its trained copy; the adapter sync
    # carries the same head whole.
    merged = dict(policy.named_weights())
    assert list(merged) == [n for n, _ in hf.named_parameters()]
    assert torch.equal(merged["lm_head.weight"], policy.module.get_parameter(HEAD_TRAINED))
    adapter = dict(policy.named_adapter_weights())
    assert torch.equal(adapter["lm_head.weight.lora_saved"], merged["lm_head.weight"])
    hf.load_state_dict(merged)
    trained = policy.logprobs(batch)
    torch.testing.assert_close(
        trained, _hf_logprobs(hf, batch) * batch["attention_mask"], atol=1e-5, rtol=0
    )
    hf.load_state_dict({**merged, "lm_head.weight": base[HEAD_BASE]})
    without_head = _hf_logprobs(hf, batch) * batch["attention_mask"]
    assert (trained - without_head).abs().max() > 1e-3  # the trained head matters


def test_an_adapter_and_head_sync_serves_the_merged_full_sync_and_the_base_when_off(tiny_model_dir):
    rollout = pytest.importorskip("yatt.rollout")
    from yatt.rollout._weights import named_targets

    policy = TorchPolicy(_with_head(tiny_model_dir))
    engines = [
        rollout.BuiltinEngine(
            tiny_model_dir,
            config=rollout.EngineConfig(max_batch_size=2, max_seq_len=64, region_prefix=prefix),
        )
        for prefix in ("lora-head-adapter", "lora-head-full")
    ]
    base = {n: p.detach().clone() for n, p in engines[0].model.named_parameters()}
    for seed in (0, 1):
        _step(policy, seed=seed)
        engines[0].update_weights(policy.named_adapter_weights())
        engines[1].update_weights(policy.named_weights())
        served = [dict(e.model.named_parameters()) for e in engines]
        for name, tensor in served[1].items():
            assert torch.equal(served[0][name], tensor), (seed, name)
        assert not torch.equal(served[0]["lm_head.weight"], base["lm_head.weight"])
    # The engine's logprobs of a sequence are the policy's (same function, float32).
    batch = _batch(lengths=(9,), seed=5)
    ids = batch["input_ids"][0].tolist()
    request = rollout.Request(prompt_ids=ids[:4])
    sampling = rollout.SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True)
    completion = engines[0].generate([request], sampling)[0]
    full = ids[:4] + list(completion.response_ids)
    rows = [
        {
            "input_ids": torch.tensor(full),
            "loss_mask": torch.ones(len(full), dtype=torch.int64),
            "group_id": 0,
            "reward": 0.0,
        }
    ]
    check = Batch.from_samples(rows, token_keys=["input_ids", "loss_mask"])
    torch.testing.assert_close(
        policy.logprobs(check)[0, 4:], torch.tensor(completion.logprobs), atol=1e-4, rtol=0
    )
    targets = named_targets(engines[0].model)
    engines[0]._adapter.set_enabled(targets, False)
    for name, param in engines[0].model.named_parameters():
        assert torch.equal(param, base[name]), name
    for engine in engines:
        engine.close()


def test_a_checkpoint_with_a_module_to_save_resumes_exactly(tiny_model_dir, tmp_path):
    ckpt = pytest.importorskip("yatt.ckpt")
    from yatt.ckpt._state import collect_state_dict, flatten_tensors, validate_state

    policy = TorchPolicy(_with_head(tiny_model_dir))
    _step(policy)
    state = policy.state()
    saved = flatten_tensors(collect_state_dict(state, validate_state(state)))
    model_keys = [k for k in saved if k.startswith("model.")]
    assert all(_is_trained(k.removeprefix("model.")) for k in model_keys)
    assert "model." + HEAD_TRAINED in model_keys
    assert any(HEAD_TRAINED in k for k in saved if k.startswith("optimizer.state."))
    with ckpt.Checkpointer(tmp_path / "ckpts", async_save=False) as checkpointer:
        checkpointer.save(1, policy.state(), extra={"step": 1})
        _step(policy, seed=1)
        resumed = TorchPolicy(_with_head(tiny_model_dir))
        assert checkpointer.load(resumed.state()) == {"step": 1}
    _step(resumed, seed=1)
    for (name, a), (_, b) in zip(
        policy.module.named_parameters(), resumed.module.named_parameters(), strict=True
    ):
        assert torch.equal(a, b), name


def test_a_module_to_save_exports_in_peft_format_and_merged(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file

    from yatt.core import export_hf, export_lora_adapter

    policy = TorchPolicy(_with_head(tiny_model_dir))
    _step(policy)
    _step(policy, seed=1)
    batch = _batch(seed=3)
    expected = policy.logprobs(batch)
    adapter_dir = export_lora_adapter(policy, tmp_path / "adapter", dtype="float32")
    # PEFT's own key for a module to save: the module's name, no adapter name.
    keys = load_file(adapter_dir / "adapter_model.safetensors")
    assert "base_model.model.lm_head.weight" in keys
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    reloaded = PeftModel.from_pretrained(base, adapter_dir)
    got = _hf_logprobs(reloaded, batch) * batch["attention_mask"]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    merged_dir = export_hf(policy, tmp_path / "merged", dtype="float32")
    plain = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
    got = _hf_logprobs(plain, batch) * batch["attention_mask"]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_a_bf16_policy_keeps_the_base_head_in_float32(tiny_model_dir):
    policy = TorchPolicy(_with_head(tiny_model_dir, dtype="bfloat16"))
    dtypes = {n: p.dtype for n, p in policy.module.named_parameters()}
    assert dtypes[HEAD_BASE] == dtypes[HEAD_TRAINED] == torch.float32
    assert dtypes["model.layers.0.self_attn.q_proj.base_layer.weight"] == torch.bfloat16


@pytest.mark.parametrize(
    ("lora", "match"),
    [
        pytest.param(
            {"target_modules": ["q_proj", "embed_tokens"]},
            r"policy\.lora\.target_modules: 'embed_tokens' matches 'model\.embed_tokens', a "
            r"Embedding, not a linear layer.*modules_to_save",
            id="embedding-target",
        ),
        pytest.param(
            {"modules_to_save": ["lm_haed"]},
            r"policy\.lora\.modules_to_save: 'lm_haed' matches no module.*lm_head",
            id="unmatched-saved",
        ),
        pytest.param(
            {"target_modules": ["q_proj"], "modules_to_save": ["q_proj"]},
            r"policy\.lora\.modules_to_save: 'q_proj' matches .*which target_modules also adapts",
            id="saved-and-targeted",
        ),
        pytest.param(
            {"modules_to_save": "lm_head"},
            r"policy\.lora\.modules_to_save='lm_head': give a list",
            id="saved-not-a-list",
        ),
    ],
)
def test_bad_modules_to_save_and_non_linear_targets_name_the_field(
    tiny_model_dir, lora, match, no_model_loads
):
    with pytest.raises(ValueError, match=match):
        policy_config_from_dict("torch", {"model_dir": tiny_model_dir, "lora": lora})


def test_a_module_to_save_tied_to_the_embeddings_is_refused(tmp_path):
    from yatt.testing import make_tiny_causal_lm

    tied = tmp_path / "tied"
    make_tiny_causal_lm(tied, arch="qwen2", max_position_embeddings=64, tie_word_embeddings=True)
    for module in ("lm_head", "embed_tokens"):
        with pytest.raises(
            ValueError, match=rf"policy\.lora\.modules_to_save: '{module}' matches .*tied"
        ):
            policy_config_from_dict(
                "torch", {"model_dir": str(tied), "lora": {"modules_to_save": [module]}}
            )
    # Without modules_to_save the tied model takes LoRA as before.
    policy_config_from_dict("torch", {"model_dir": str(tied), "lora": {"rank": 4}})
