NUM_GPUS = 0

"""megatron-core's own GPTModel on CPU (gloo; see _cpu_shim.py), at tp=1 and tp=2: the shapes
our mapping expects are what it allocates, and with HF weights loaded its logprobs, entropy and
their gradients equal the HF model's; the bucketed exporter gives back the HF weights bitwise.
Skipped when megatron-core is not installed (it is in the `megatron` extra)."""

import pytest
import torch

ARCHS = ["llama", "qwen2", "qwen3"]


def _cases(results):
    return [(key, r[key]) for r in results for key in r if key not in ("shapes", "policy")]


def test_megatron_allocates_the_shapes_the_mapping_expects(megatron_cpu_results):
    _, results = megatron_cpu_results
    for r in results:
        assert sorted(r["shapes"]) == sorted(ARCHS)
        for arch, per_tied in r["shapes"].items():
            for is_tied, shapes in per_tied.items():
                assert shapes["got"] == shapes["expected"], f"{arch} tied={is_tied}"


def test_megatron_logprobs_entropy_and_grads_equal_hf(megatron_cpu_results):
    tp, results = megatron_cpu_results
    cases = _cases(results)
    assert len(cases) == tp * len(ARCHS) * (2 if tp == 1 else 1)
    for key, r in cases:
        mask = r["mask"].bool()
        # float32 on both sides: a mapping error (a swapped head, a shifted row) is O(1).
        torch.testing.assert_close(
            r["logprobs"][mask], r["ref_logprobs"][mask], atol=3e-5, rtol=1e-5, msg=str(key)
        )
        torch.testing.assert_close(
            r["entropy"][mask], r["ref_entropy"][mask], atol=3e-5, rtol=1e-5, msg=str(key)
        )
        torch.testing.assert_close(r["grad"], r["ref_grad"], atol=3e-5, rtol=1e-4, msg=str(key))
        # Padding columns of the vocabulary get no probability mass and no gradient.
        assert r["grad_pad"].numel() > 0 and r["grad_pad"].abs().max() == 0, key


@pytest.mark.parametrize("arch", ARCHS)
def test_bucketed_export_returns_the_hf_weights_bitwise(megatron_cpu_results, arch):
    _, results = megatron_cpu_results
    for key, r in _cases(results):
        if key[0] != arch:
            continue
        expected = dict(r["hf_state"])
        if r["is_tied"]:
            expected.pop("lm_head.weight", None)
        assert set(r["exported"]) == set(expected), key
        for name, tensor in expected.items():
            assert torch.equal(r["exported"][name], tensor), (key, name)


def test_policy_train_steps_and_weights_equal_torch_policy(megatron_cpu_results):
    """Three MegatronPolicy train steps (micro-batches from yatt.balance.pack, DDP, Megatron's
    optimizer) give TorchPolicy's losses and weights, in float32, at tp=1 and tp=2; a step
    without loss tokens is skipped; model_config is the HF config."""
    _, results = megatron_cpu_results
    for r in results:
        p = r["policy"]
        assert p["losses"][0] != p["losses"][2]  # the steps changed the model
        # The steps ran with logprobs computed in the output layer (at tp=2 its gradient
        # all-reduce is what makes them match TorchPolicy); they equal the full logits'.
        assert p["is_head_logprobs"]
        for got, want in zip(p["head_path"], p["plain_path"], strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        assert p["losses"] == pytest.approx(p["torch_losses"], abs=1e-5)
        # The rollout weights were set to 1.5, 1.105 or 1 a token: their max is 1.5 on every
        # backend (a max over micro-batches and ranks, not a sum spread over the tokens).
        megatron_metrics, torch_metrics = p["step_metrics"], p["torch_step_metrics"]
        assert megatron_metrics["is_weight_max"] == pytest.approx(1.5, rel=1e-6)
        assert torch_metrics["is_weight_max"] == pytest.approx(1.5, rel=1e-6)
        assert set(megatron_metrics) == set(torch_metrics)
        # One data-parallel rank (TP ranks share the batch), and a runtime-less TorchPolicy
        # is one process: neither counts another process's tokens.
        assert megatron_metrics["num_loss_tokens"] == p["batch_loss_tokens"]
        assert torch_metrics["num_loss_tokens"] == p["batch_loss_tokens"]
        for key, value in torch_metrics.items():
            if key != "num_micro_batches":  # each backend packs its own micro-batches
                assert megatron_metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
        assert set(p["weights"]) == set(p["torch_weights"])
        for name, tensor in p["torch_weights"].items():
            # Adam scales every update to about lr (1e-3): where a gradient is at rounding level,
            # TP's different summation order moves that element by up to ~lr. A wrong shard or
            # name would be off by the weights' own scale (~2e-2) almost everywhere.
            torch.testing.assert_close(p["weights"][name], tensor, atol=5e-4, rtol=0, msg=name)
        assert p["state_restored"] and p["num_state_tensors"] > 0
        assert p["skipped"]["is_skipped"] == 1.0 and p["skipped"]["num_loss_tokens"] == 0.0
        assert (p["model_config"]["hidden_size"], p["model_config"]["num_hidden_layers"]) == (64, 2)
        # Both backends weigh a sample alike (packing and rank balancing use estimate_costs).
        megatron_costs, torch_costs = p["costs"]
        assert megatron_costs == torch_costs and megatron_costs[2] > 60 * megatron_costs[0]
        # A batch's costs are its samples' lengths' (a GPT model's tokens), as TorchPolicy's.
        assert p["batch_costs"][0] == p["batch_costs"][1]
        # resident_bytes counts each parameter storage once (shared DDP buffers, padding aside).
        assert p["param_bytes"] <= p["resident_bytes"] < 1.5 * p["param_bytes"]
