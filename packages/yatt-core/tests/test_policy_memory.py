"""TorchPolicy's memory side (issue 27): activation checkpointing leaves gradients unchanged, the
activation estimate and the micro-batch cap chosen from a memory budget, the needs it reports
to a placement plan, and no DDP wrapper (with its gradient buckets) on one rank."""

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from yatt.core import (
    TorchPolicy,
    TorchPolicyConfig,
    choose_max_tokens,
    estimate_activation_bytes,
    init_runtime,
)
from yatt.core.cost._policy_memory import DEFAULT_MAX_TOKENS
from yatt.placement import MemoryNeed

NUM_GPUS = 0


@pytest.fixture(autouse=True)
def _no_torchrun_env(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)


def _config(model_dir, **overrides):
    base = dict(model_dir=model_dir, lr=1e-3, dtype="float32", parallel="none", grad_clip=None)
    return TorchPolicyConfig(**{**base, **overrides})


def _gradients(policy: TorchPolicy) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 200, (3, 11), generator=gen)
    policy.module.train()  # Hugging Face checkpoints in training mode only
    logits = policy.module(input_ids=ids, use_cache=False).logits
    logits.log_softmax(-1)[..., 7].mean().backward()
    return {name: p.grad.clone() for name, p in policy.module.named_parameters()}


def _is_checkpointing(model) -> bool:
    # transformers >= 5 renamed it (the old name warns there).
    if hasattr(type(model), "is_activation_checkpointing"):
        return model.is_activation_checkpointing
    return model.is_gradient_checkpointing


def test_activation_checkpointing_is_on_by_config_and_leaves_gradients_unchanged(tiny_model_dir):
    plain = TorchPolicy(_config(tiny_model_dir))
    checkpointed = TorchPolicy(_config(tiny_model_dir, gradient_checkpointing=True))
    assert not _is_checkpointing(plain.module)
    assert _is_checkpointing(checkpointed.module)
    expected = _gradients(plain)
    got = _gradients(checkpointed)
    assert expected.keys() == got.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, atol=1e-6, rtol=1e-5, msg=name)


# A made-up shape small enough to count by hand: h=8, 2 layers, gated MLP of 16, 2 query heads
# and 1 KV head (kv width 4), vocabulary 10.
SHAPE = dict(
    hidden_size=8,
    num_layers=2,
    ffn_hidden_size=16,
    num_heads=2,
    num_kv_heads=1,
    vocab_size=10,
    is_gated_mlp=True,
)
# One layer keeps 34h + 6kv + 8i = 272 + 24 + 128 = 424 bytes a token. Outside the layers:
# 12h = 96, and plain logits 10V = 100.
PLAIN_PER_TOKEN = 2 * 424 + 96 + 100  # 1044
# Checkpointed: each layer's float32 input (4h x 2 layers = 64) and one layer rebuilt (424).
CHECKPOINTED_PER_TOKEN = 64 + 424 + 96 + 100  # 684


def test_activation_estimate_counts_layers_and_logits_by_hand():
    assert (
        estimate_activation_bytes(1, SHAPE, is_checkpointed=False, is_head_logprobs=False)
        == PLAIN_PER_TOKEN
    )
    assert (
        estimate_activation_bytes(100, SHAPE, is_checkpointed=True, is_head_logprobs=False)
        == 100 * CHECKPOINTED_PER_TOKEN
    )
    # Through the head's chunked logprobs the logits are a fixed 3 chunks (1.5 GiB), not 10V.
    head = estimate_activation_bytes(100, SHAPE, is_checkpointed=True, is_head_logprobs=True)
    assert head == 100 * (CHECKPOINTED_PER_TOKEN - 100) + 3 * 2**27 * 4


@pytest.mark.parametrize(
    ("budget", "is_checkpointed", "expected"),
    [
        (1044 * 1000, False, 768),  # 1000 tokens fit: the multiple of 256 below
        (1044 * 1024, False, 1024),
        (1044 * 1024 - 1, False, 768),  # one byte short of 1024
        (684 * 1024, True, 1024),
        (684 * 1023, True, 768),
    ],
)
def test_micro_batch_cap_from_a_memory_budget(budget, is_checkpointed, expected):
    cap = choose_max_tokens(
        budget, SHAPE, is_checkpointed=is_checkpointed, is_head_logprobs=False, multiple=256
    )
    assert cap == expected


def test_a_budget_below_one_multiple_names_the_settings():
    with pytest.raises(ValueError, match="gradient_checkpointing=True") as error:
        choose_max_tokens(1044 * 255, SHAPE, is_checkpointed=False, is_head_logprobs=False)
    assert "max_tokens_per_microbatch=None" in str(error.value)
    with pytest.raises(ValueError) as error:
        choose_max_tokens(684 * 255, SHAPE, is_checkpointed=True, is_head_logprobs=False)
    assert "gradient_checkpointing" not in str(error.value)  # already on: not suggested


def test_a_7b_policy_needs_checkpointing_at_16k_tokens():
    # Qwen2.5-7B's shape: without checkpointing 16k tokens keep over 100 GiB of activations,
    # with it under 16 GiB (the model's weights and AdamW state alone are ~85 GiB of 141).
    qwen7b = dict(
        hidden_size=3584,
        num_layers=28,
        ffn_hidden_size=18944,
        num_heads=28,
        num_kv_heads=4,
        vocab_size=152064,
        is_gated_mlp=True,
    )
    plain = estimate_activation_bytes(16384, qwen7b, is_checkpointed=False)
    checkpointed = estimate_activation_bytes(16384, qwen7b, is_checkpointed=True)
    assert plain > 100 * 2**30 and checkpointed < 16 * 2**30


def test_an_unset_cap_is_the_default_without_cuda(tiny_model_dir):
    policy = TorchPolicy(_config(tiny_model_dir, max_tokens_per_microbatch=None))
    assert policy.max_tokens_per_microbatch == DEFAULT_MAX_TOKENS
    with pytest.raises(ValueError, match="max_tokens_per_microbatch=0"):
        _config(tiny_model_dir, max_tokens_per_microbatch=0)
    with pytest.raises(ValueError, match="gradient_checkpointing='yes'"):
        _config(tiny_model_dir, gradient_checkpointing="yes")


def test_policy_reports_its_memory_to_a_plan(tiny_model_dir):
    policy = TorchPolicy(_config(tiny_model_dir, max_tokens_per_microbatch=512))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())  # RoPE's table
    need = policy.memory_need()
    assert isinstance(need, MemoryNeed)
    # Float32 weights; AdamW's two moments, before its first step made them.
    assert need.resident == {"weights": param_bytes + buffer_bytes, "optimizer": 2 * param_bytes}
    assert need.peak["gradients"] == param_bytes
    shape = policy._cost_shape
    activations = estimate_activation_bytes(512, shape, is_checkpointed=False)
    assert need.peak.get("activations", 0) == activations or (
        activations < param_bytes and need.peak["optimizer step"] == param_bytes
    )
    assert "max_tokens_per_microbatch (now 512)" in need.settings["activations"]
    assert "gradient_checkpointing=True" in need.settings["activations"]


def test_one_rank_trains_without_the_ddp_wrapper(tiny_model_dir):
    with init_runtime(seed=0, device="cpu") as rt:
        policy = TorchPolicy(_config(tiny_model_dir, parallel="ddp"), rt)
        assert policy._ddp is None  # no gradient buckets beside the gradients
        assert dist.is_initialized()


def _batch(seed=0):
    from yatt.core import Batch, compute_grpo_advantages

    gen = torch.Generator().manual_seed(seed)
    rows = []
    for i, length in enumerate((6, 13, 4, 9)):
        mask = torch.zeros(length, dtype=torch.int64)
        mask[2:] = 1
        ids = torch.randint(5, 200, (length,), generator=gen)
        rows.append({"input_ids": ids, "loss_mask": mask, "group_id": i // 2, "reward": i % 3})
    batch = Batch.from_samples(rows, token_keys=["input_ids", "loss_mask"])
    batch.samples["advantages"] = compute_grpo_advantages(batch["reward"], batch["group_id"])
    return batch


def test_an_offloaded_optimizer_comes_in_for_the_step_only_and_trains_the_same(tiny_model_dir):
    from yatt.core import PolicyLoss
    from yatt.placement import is_offloaded

    loss = PolicyLoss(is_on_policy=True, rollout_correction="none")
    weights = []
    for is_away in (False, True):
        policy = TorchPolicy(_config(tiny_model_dir, should_offload_optimizer=is_away))
        for step in range(2):
            policy.sleep()
            policy.wake_up()  # the plan's train phase wakes both tags
            assert is_offloaded(policy.optimizer) == is_away  # stays on the host
            policy.train_step(_batch(step), loss)
            assert is_offloaded(policy.optimizer) == is_away  # out again after its step
        weights.append(dict(policy.named_weights()))
        if is_away:
            state = policy.state()  # a checkpoint reads the state where it is real
            assert not is_offloaded(state["optimizer"])
            assert len(policy.optimizer.state) > 0
    for name, tensor in weights[0].items():
        torch.testing.assert_close(weights[1][name], tensor, atol=0, rtol=0)


def test_an_offloaded_optimizer_is_part_of_the_peak_not_resident(tiny_model_dir):
    policy = TorchPolicy(
        _config(tiny_model_dir, should_offload_optimizer=True, max_tokens_per_microbatch=1)
    )
    policy._is_head_logprobs = False  # no fixed 1.5 GiB of head chunks: tokens only
    param_bytes = sum(p.numel() * 4 for p in policy.module.parameters())
    need = policy.memory_need()
    assert need.resident["optimizer"] == 0
    # One token's activations are far below AdamW's two moments: the step's state is the peak.
    assert need.peak == {"gradients": param_bytes, "optimizer": 2 * param_bytes}


def test_the_host_memory_reported_before_anything_moves_is_what_sleep_then_holds(tiny_model_dir):
    from yatt.core import PolicyLoss
    from yatt.placement import HostNeed, host_bytes_of

    loss = PolicyLoss(is_on_policy=True, rollout_correction="none")
    policy = TorchPolicy(_config(tiny_model_dir, should_offload_optimizer=True))
    param_bytes = sum(p.numel() * 4 for p in policy.module.parameters())
    before = policy.host_need()
    assert isinstance(before, HostNeed)
    # Packed copies: at least the bytes, at most twice (one power-of-two rounding of the whole).
    assert param_bytes <= before.parts["weights"] < 2 * param_bytes + (1 << 20)
    assert 2 * param_bytes <= before.parts["optimizer"] < 4 * param_bytes + (1 << 20)
    assert "fsdp2" in before.settings["optimizer"]
    policy.train_step(_batch(0), loss)  # makes the state; it goes to the host after the step
    policy.sleep()
    held = {
        "weights": host_bytes_of(policy.module),
        "optimizer": host_bytes_of(policy.optimizer),
    }
    assert held == dict(before.parts)
    assert policy.host_need().parts == held
