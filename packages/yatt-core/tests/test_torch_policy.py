"""TorchPolicy in one process: logprobs against an unbatched forward, micro-batch invariance,
non-finite skips, sleep/wake, weight export, checkpoint state and config errors."""

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from yatt.core import (
    Batch,
    PolicyBackend,
    PolicyLoss,
    TorchPolicy,
    TorchPolicyConfig,
    compute_grpo_advantages,
)

NUM_GPUS = 0


def _config(model_dir, /, **overrides):
    base = {
        "model_dir": model_dir,
        "lr": 1e-3,
        "dtype": "float32",
        "parallel": "none",
        "grad_clip": None,
        "max_tokens_per_microbatch": 4096,
    }
    return TorchPolicyConfig(**{**base, **overrides})


def _batch(lengths=(6, 13, 4, 9), seed=0):
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for i, length in enumerate(lengths):
        mask = torch.zeros(length, dtype=torch.int64)
        mask[2:] = 1
        ids = torch.randint(5, 200, (length,), generator=gen)
        rows.append(
            {"input_ids": ids, "loss_mask": mask, "group_id": i // 2, "reward": float(i % 3)}
        )
    batch = Batch.from_samples(rows, token_keys=["input_ids", "loss_mask"])
    batch.samples["advantages"] = compute_grpo_advantages(batch["reward"], batch["group_id"])
    return batch


def test_policy_implements_the_backend_protocol(tiny_model_dir):
    assert isinstance(TorchPolicy(_config(tiny_model_dir)), PolicyBackend)


@pytest.mark.parametrize("temperature", [pytest.param(1.0, id="t1"), pytest.param(0.6, id="t0.6")])
def test_logprobs_match_an_unbatched_forward(tiny_model_dir, temperature):
    batch = _batch()
    # A cap of 14 tokens forces several padded micro-batches.
    policy = TorchPolicy(
        _config(tiny_model_dir, temperature=temperature, max_tokens_per_microbatch=14)
    )
    got = policy.logprobs(batch)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    for i, length in enumerate(batch.lengths.tolist()):
        ids = batch["input_ids"][i : i + 1, :length]
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1] / temperature
        expected = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
        torch.testing.assert_close(got[i, 1:length], expected, atol=1e-5, rtol=0)
        assert (got[i, length:] == 0).all() and got[i, 0] == 0


def _step(model_dir, batch, **overrides):
    policy = TorchPolicy(_config(model_dir, **overrides))
    batch.tokens["old_logprobs"] = policy.logprobs(batch)
    metrics = policy.train_step(batch, PolicyLoss(kl_coef=0.0, should_compute_entropy=True))
    return metrics, dict(policy.named_weights())


def test_step_does_not_depend_on_micro_batching_or_checkpointing(tiny_model_dir):
    whole, whole_weights = _step(tiny_model_dir, _batch())
    split, split_weights = _step(
        tiny_model_dir, _batch(), max_tokens_per_microbatch=13, gradient_checkpointing=True
    )
    assert whole["num_micro_batches"] == 1 and split["num_micro_batches"] >= 3
    for key in ("loss", "grad_norm", "pg_loss", "entropy", "clip_frac"):
        assert split[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-7), key
    for name, tensor in whole_weights.items():
        torch.testing.assert_close(split_weights[name], tensor, atol=1e-4, rtol=0)


def test_micro_batches_cap_padded_tokens(tiny_model_dir):
    # One long and many short samples: a cap on the sum of lengths alone would put the long one
    # beside short ones and pad every row to it (the logits' memory follows rows x longest).
    lengths = (60, 4, 5, 6, 4, 5, 7, 6, 5, 4, 6, 5)
    policy = TorchPolicy(_config(tiny_model_dir, max_tokens_per_microbatch=64))
    batch = _batch(lengths)
    bins = policy.plan_micro_batches(batch)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    for index in bins:
        assert len(index) * max(lengths[i] for i in index) <= 64, index
    # Same step as one big micro-batch.
    batch.tokens["old_logprobs"] = policy.logprobs(batch)
    small = policy.train_step(batch, PolicyLoss())
    whole, _ = _step(tiny_model_dir, _batch(lengths), max_tokens_per_microbatch=4096)
    assert small["loss"] == pytest.approx(whole["loss"], rel=1e-5, abs=1e-7)
    assert small["num_micro_batches"] >= 3


def test_on_policy_loss_skips_the_old_logprob_pass_with_the_same_step(tiny_model_dir):
    # Random weights: the explicit old logprobs equal the training forward's, so the step and
    # its metrics must match; is_on_policy only saves the separate forward pass.
    explicit, explicit_weights = _step(tiny_model_dir, _batch(), max_tokens_per_microbatch=13)
    policy = TorchPolicy(_config(tiny_model_dir, max_tokens_per_microbatch=13))
    batch = _batch()
    loss = PolicyLoss(kl_coef=0.0, should_compute_entropy=True, is_on_policy=True)
    assert "old_logprobs" not in batch
    on_policy = policy.train_step(batch, loss)
    for key in ("loss", "grad_norm", "pg_loss", "entropy", "clip_frac"):
        assert on_policy[key] == pytest.approx(explicit[key], rel=1e-5, abs=1e-7), key
    for name, tensor in policy.named_weights():
        torch.testing.assert_close(tensor, explicit_weights[name], atol=1e-6, rtol=0)
    # Without the flag a missing old_logprobs is an error that names the way out.
    with pytest.raises(ValueError, match="is_on_policy"):
        policy.train_step(_batch(), PolicyLoss())


def test_policy_step_is_the_same_through_the_head_or_the_logits(tiny_model_dir, monkeypatch):
    import yatt.core.policy._head_logprobs as head_logprobs

    monkeypatch.setattr(head_logprobs, "CHUNK_ELEMENTS", 2048)  # several chunks per micro-batch
    config = _config(tiny_model_dir, max_tokens_per_microbatch=13, temperature=0.8)
    loss = PolicyLoss(kl_coef=0.0, should_compute_entropy=True, is_on_policy=True)
    results = []
    for is_head in (True, False):
        policy = TorchPolicy(config)
        assert policy._is_head_logprobs  # llama: the head path is the default
        policy._is_head_logprobs = is_head
        logprobs = policy.logprobs(_batch())
        metrics = policy.train_step(_batch(), loss)
        results.append((logprobs, metrics, dict(policy.named_weights())))
    (head_lp, head_metrics, head_weights), (plain_lp, plain_metrics, plain_weights) = results
    torch.testing.assert_close(head_lp, plain_lp, atol=1e-5, rtol=0)
    for key in ("loss", "grad_norm", "pg_loss", "entropy"):
        assert head_metrics[key] == pytest.approx(plain_metrics[key], rel=1e-5, abs=1e-7), key
    for name, tensor in plain_weights.items():
        # Chunks sum gradients in another order; Adam turns rounding-level gradients into steps
        # of up to lr (1e-3) on a few elements, as in the micro-batching test above.
        torch.testing.assert_close(head_weights[name], tensor, atol=1e-4, rtol=0)


def test_compiled_head_logprobs_give_the_eager_step(tiny_model_dir, monkeypatch):
    from torch._dynamo.utils import counters

    import yatt.core.policy._head_logprobs as head_logprobs

    monkeypatch.setattr(head_logprobs, "CHUNK_ELEMENTS", 2048)  # several chunks per micro-batch
    torch._dynamo.reset()  # earlier tests' graphs count toward the recompile limit
    counters.clear()
    loss = PolicyLoss(kl_coef=0.0, should_compute_entropy=True, is_on_policy=True)
    results = {}
    for is_compiled in (False, True):
        config = _config(
            tiny_model_dir,
            max_tokens_per_microbatch=13,
            temperature=0.8,
            compile_head_logprobs=is_compiled,
        )
        policy = TorchPolicy(config)
        logprobs = policy.logprobs(_batch())
        metrics = policy.train_step(_batch(), loss)
        results[is_compiled] = (logprobs, metrics, dict(policy.named_weights()))
    # The flag reached the head: its chunks ran compiled, in whole graphs.
    assert counters["stats"]["unique_graphs"] > 0 and not counters["graph_break"]
    torch._dynamo.reset()
    (lp, metrics, weights), (eager_lp, eager_metrics, eager_weights) = results[True], results[False]
    torch.testing.assert_close(lp, eager_lp, atol=1e-5, rtol=0)
    for key in ("loss", "grad_norm", "pg_loss", "entropy"):
        assert metrics[key] == pytest.approx(eager_metrics[key], rel=1e-5, abs=1e-7), key
    for name, tensor in eager_weights.items():
        # Rounding-level gradient differences, as in the head-vs-logits test above.
        torch.testing.assert_close(weights[name], tensor, atol=1e-4, rtol=0)


def test_head_logprobs_compile_by_default_on_cuda_only(tiny_model_dir, monkeypatch):
    """compile_head_logprobs=None: compiled on CUDA (measured faster there), eager on CPU;
    an explicit bool wins either way. Nothing is compiled on the CPU default."""
    made = []
    monkeypatch.setattr(
        "yatt.core.policy._torch_policy.compiled_chunk_logprobs", lambda: made.append(1)
    )
    default = TorchPolicy(_config(tiny_model_dir))
    assert TorchPolicyConfig.__dataclass_fields__["compile_head_logprobs"].default is None
    assert not default._should_compile_head and not made
    assert TorchPolicy(_config(tiny_model_dir, compile_head_logprobs=True))._should_compile_head
    assert made == [1]


@pytest.mark.parametrize(
    ("is_head", "checkpointing"), [(True, False), (False, False), (True, True)]
)
def test_attention_is_causal_without_a_mask_and_never_on_cudnn(
    tiny_model_dir, monkeypatch, is_head, checkpointing
):
    """Training shapes change every step. cuDNN's attention builds a graph per new shape
    (hundreds of ms), and a padding mask rules out the flash kernel; right-padded rows need
    neither (causal attention never reaches the padding after a row). Read where the model
    calls SDPA, in logprobs and in the train step (and in the backward's recomputed forward
    under activation checkpointing), on micro-batches with padding."""
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        backends = torch.backends.cuda
        mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
        seen.append(
            (
                backends.cudnn_sdp_enabled(),
                backends.flash_sdp_enabled(),
                backends.mem_efficient_sdp_enabled(),
                mask is None and kwargs.get("is_causal", False),
            )
        )
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    config = _config(
        tiny_model_dir, max_tokens_per_microbatch=13, gradient_checkpointing=checkpointing
    )
    policy = TorchPolicy(config)
    policy._is_head_logprobs = is_head
    batch = _batch()  # lengths 6, 13, 4, 9: padded micro-batches under the 13-token cap
    assert any(len(p) > 1 for p in policy.plan_micro_batches(batch))
    before = torch.backends.cuda.cudnn_sdp_enabled()
    policy.logprobs(batch)
    policy.train_step(_batch(), PolicyLoss(is_on_policy=True))
    assert seen, "the model never called scaled_dot_product_attention"
    assert set(seen) == {(False, True, True, True)}
    assert torch.backends.cuda.cudnn_sdp_enabled() == before


def test_non_finite_loss_skips_the_optimizer_step(tiny_model_dir):
    policy = TorchPolicy(_config(tiny_model_dir))
    before = {n: t.clone() for n, t in policy.named_weights()}
    batch = _batch()
    batch.tokens["old_logprobs"] = policy.logprobs(batch)
    batch.samples["advantages"][1] = float("nan")
    metrics = policy.train_step(batch, PolicyLoss())
    assert metrics["is_skipped"] == 1.0 and policy.num_skipped_steps == 1
    for name, tensor in policy.named_weights():
        assert torch.equal(tensor, before[name]), name
    # Gradients were cleared: the next, healthy step starts clean and moves the weights.
    batch.samples["advantages"][1] = 0.5
    assert policy.train_step(batch, PolicyLoss())["is_skipped"] == 0.0
    assert any(not torch.equal(t, before[n]) for n, t in policy.named_weights())


def test_empty_global_batch_skips_the_step(tiny_model_dir):
    policy = TorchPolicy(_config(tiny_model_dir))
    before = [p.detach().clone() for p in policy.module.parameters()]
    empty = _batch().select([])
    metrics = policy.train_step(empty, PolicyLoss())
    assert metrics["is_skipped"] == 1.0 and metrics["num_loss_tokens"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(before, policy.module.parameters(), strict=True))


def test_sleep_and_wake_up_round_trip(tiny_model_dir):
    policy = TorchPolicy(_config(tiny_model_dir))
    batch = _batch()
    expected = policy.logprobs(batch)
    awake_bytes = policy.resident_bytes()
    policy.sleep()
    assert policy.resident_bytes() == 0 < awake_bytes
    with pytest.raises(RuntimeError, match="wake_up"):
        policy.logprobs(batch)
    policy.wake_up(["weights"])
    torch.testing.assert_close(policy.logprobs(batch), expected, atol=0, rtol=0)
    batch.tokens["old_logprobs"] = expected
    with pytest.raises(RuntimeError, match="optimizer is offloaded"):
        policy.train_step(batch, PolicyLoss())
    policy.wake_up()
    assert policy.train_step(batch, PolicyLoss())["is_skipped"] == 0.0


def test_named_weights_use_hugging_face_names(tiny_model_dir):
    policy = TorchPolicy(_config(tiny_model_dir))
    names = [name for name, _ in policy.named_weights()]
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert names == [name for name, _ in hf.named_parameters()]
    for name, tensor in policy.named_weights():
        assert torch.equal(tensor, hf.get_parameter(name).detach())


def test_state_works_with_distributed_checkpoint_state_dict(tiny_model_dir):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    policy = TorchPolicy(_config(tiny_model_dir))
    batch = _batch()
    batch.tokens["old_logprobs"] = policy.logprobs(batch)
    policy.train_step(batch, PolicyLoss())
    state = policy.state()
    model_sd, optim_sd = get_state_dict(state["model"], state["optimizer"])
    assert "model.embed_tokens.weight" in model_sd
    assert "model.embed_tokens.weight" in optim_sd["state"]


def test_reference_policy_is_frozen(tiny_model_dir):
    policy = TorchPolicy(_config(tiny_model_dir, is_reference=True))
    assert policy.optimizer is None and set(policy.state()) == {"model"}
    assert not any(p.requires_grad for p in policy.module.parameters())
    with pytest.raises(RuntimeError, match="reference"):
        policy.train_step(_batch(), PolicyLoss())


def test_sequence_longer_than_the_context_is_an_error(tiny_model_dir):
    policy = TorchPolicy(_config(tiny_model_dir))
    assert policy.max_context_tokens == 64
    with pytest.raises(ValueError, match="context of 64"):
        policy.logprobs(_batch(lengths=(70,)))


def test_bfloat16_compute_runs_and_keeps_float32_master_weights(tiny_model_dir):
    metrics, weights = _step(tiny_model_dir, _batch(), dtype="bfloat16")
    assert metrics["is_skipped"] == 0.0 and metrics["grad_norm"] > 0
    assert all(t.dtype == torch.float32 for t in weights.values())


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        pytest.param({"model_dir": "/nonexistent/model"}, "does not exist", id="missing-dir"),
        pytest.param({"lr": 0.0}, "lr", id="zero-lr"),
        pytest.param({"betas": (0.9, 1.0)}, "betas", id="beta-1"),
        pytest.param({"grad_clip": -1.0}, "grad_clip", id="negative-clip"),
        pytest.param({"max_tokens_per_microbatch": 0}, "max_tokens_per_microbatch", id="zero-cap"),
        pytest.param({"parallel": "zero3"}, "parallel", id="unknown-parallel"),
        pytest.param({"dtype": "fp8"}, "dtype", id="unknown-dtype"),
        pytest.param({"temperature": -1.0}, "temperature", id="negative-temperature"),
        pytest.param(
            {"compile_head_logprobs": "yes"}, "compile_head_logprobs", id="compile-not-bool"
        ),
    ],
)
def test_config_errors_name_the_field(tiny_model_dir, tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        _config(tiny_model_dir, **overrides)


def test_directory_without_config_and_parallel_without_runtime(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match=r"has no config\.json"):
        _config(str(tmp_path))
    with pytest.raises(ValueError, match="needs a runtime"):
        TorchPolicy(_config(tiny_model_dir, parallel="ddp"))
    assert dataclasses.is_dataclass(TorchPolicyConfig)
