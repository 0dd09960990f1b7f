"""A LoRA adapter synced alone into the built-in engine (builtin/_lora.py): the engine then
serves what a full sync of the merged weights serves, after one adapter and after the next
(the previous one un-applied exactly), in float32 and bf16, fused projections or not, keeping
only the adapter's factors beside its weights."""

NUM_GPUS = 0

import pytest
import torch
from transformers import AutoModelForCausalLM

from yatt.rollout import BuiltinEngine, EngineConfig, Request, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
PROMPTS = [[5, 9, 13, 2], [7, 3], [11, 4, 6]]
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RANK, SCALING = 4, 2.0


def _engine(model_dir, prefix, *, dtype="float32", device="cpu", fuse=True):
    config = EngineConfig(
        max_batch_size=4,
        max_seq_len=64,
        region_prefix=prefix,
        dtype=dtype,
        device=device,
        fuse_projections=fuse,
    )
    return BuiltinEngine(model_dir, config=config)


def _base(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def _adapter(base, seed, std=0.05):
    """{module: (A [rank, in], B [out, rank])} for every decoder linear, random (B nonzero, as
    after training)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, module in base.named_modules():
        if name.rsplit(".", 1)[-1] in TARGETS:
            A = torch.randn(RANK, module.in_features, generator=gen) * std
            B = torch.randn(module.out_features, RANK, generator=gen) * std
            out[name] = (A, B)
    return out


def _adapter_pairs(adapter, scaling=SCALING):
    """The wire format TorchPolicy.named_adapter_weights() yields."""
    for name, (A, B) in adapter.items():
        yield name + ".lora_A", A
        yield name + ".lora_B", B
        yield name + ".lora_scaling", torch.tensor(scaling)


def _merged_pairs(base, adapter, scaling=SCALING):
    """The full sync: every weight, targets as W + scaling B A in float32 (LoRA's definition)."""
    for name, param in base.named_parameters():
        module = name.removesuffix(".weight")
        if module in adapter:
            A, B = adapter[module]
            yield name, param.detach() + scaling * (B @ A)
        else:
            yield name, param.detach()


def _served(engine, name):
    return engine.model.get_parameter(name).detach().float().cpu()


def _generate(engine):
    return engine.generate([Request(prompt_ids=list(p)) for p in PROMPTS], GREEDY)


def _assert_same_completions(got, expected, atol):
    assert [c.response_ids for c in got] == [c.response_ids for c in expected]
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=atol, rtol=0
        )


def _ulps_apart(a, b, dtype):
    """Per element, |a - b| in units of the last place of dtype at b."""
    spacing = torch.finfo(dtype).eps * torch.exp2(torch.floor(torch.log2(b.abs().clamp_min(1e-30))))
    return (a - b).abs() / spacing


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "separate"])
def test_adapter_syncs_serve_what_merged_full_syncs_serve(tiny_model_dir, fuse):
    base = _base(tiny_model_dir)
    by_adapter = _engine(tiny_model_dir, f"lora-a-{fuse}", fuse=fuse)
    by_full = _engine(tiny_model_dir, f"lora-f-{fuse}", fuse=fuse)
    untouched = _generate(by_adapter)
    for seed in (1, 2):  # the second replaces the first: un-applied, not stacked
        adapter = _adapter(base, seed)
        by_adapter.update_weights(_adapter_pairs(adapter))
        by_full.update_weights(_merged_pairs(base, adapter))
        for name, _ in base.named_parameters():
            # Both round W + scaling B A (float32, B A on one CPU) once: to the last bit, also
            # after the second adapter replaced the first.
            assert torch.equal(_served(by_adapter, name), _served(by_full, name)), (seed, name)
        _assert_same_completions(_generate(by_adapter), _generate(by_full), atol=1e-5)
    # The adapter changed what the engine serves (not a comparison of two untouched engines).
    assert [c.response_ids for c in _generate(by_adapter)] != [c.response_ids for c in untouched]
    by_adapter.close()
    by_full.close()


def test_the_engine_keeps_only_the_adapters_factors(tiny_model_dir):
    base = _base(tiny_model_dir)
    engine = _engine(tiny_model_dir, "lora-bytes")
    adapter = _adapter(base, 1)
    engine.update_weights(_adapter_pairs(adapter))
    merger = engine._adapter
    assert merger.merged_modules == sorted(adapter)
    factors = sum(d.A.numel() + d.B.numel() for d in merger._merged.values())
    assert factors == sum(A.numel() + B.numel() for A, B in adapter.values())
    weights = sum(base.get_parameter(m + ".weight").numel() for m in adapter)
    assert factors < weights / 4  # rank 4 against 64..128-wide layers
    # Base values kept where un-merging would not give them back: few, for an adapter whose
    # update is small beside the weights (std 1e-4 here against weights of ~2e-2).
    small = _adapter(base, 2, std=0.01)
    engine.update_weights(_adapter_pairs(small))
    kept = sum(0 if d.kept_index is None else d.kept_index.numel() for d in merger._merged.values())
    assert kept < 0.05 * weights
    engine.close()


def test_bf16_small_updates_accumulate_instead_of_rounding_away(tmp_path):
    """RL moves an adapter a little each step. Merged into bf16 weights, an update smaller than
    half a unit in the last place rounds away; re-merging each time from the base (un-apply
    rounded back onto the grid) still serves round(W + d_k), as a full sync does."""
    from yatt.testing import make_tiny_causal_lm

    model_dir = tmp_path / "bf16"
    make_tiny_causal_lm(model_dir, arch="qwen2", seed=0, dtype=torch.bfloat16)
    base = _base(model_dir)  # bf16 values, exactly, in float32
    engine = _engine(model_dir, "lora-bf16", dtype="bfloat16")
    direction = _adapter(base, 3, std=0.05)
    for step in range(1, 21):  # the adapter grows by 1/20 of `direction` a sync
        adapter = {m: (A, B * step / 20) for m, (A, B) in direction.items()}
        engine.update_weights(_adapter_pairs(adapter))
    final = dict(_merged_pairs(base, adapter))
    for module in direction:
        name = module + ".weight"
        want = final[name].to(torch.bfloat16).float()  # what a full sync serves
        assert torch.equal(_served(engine, name), want), name
    # What un-merging needs besides the factors: the base values rounding cannot give back
    # (the merge crossed a power of two: ~1/5 here, where the last update is as large as the
    # weights), not the whole weight, which a check without the rounding step would keep.
    merged = engine._adapter._merged.values()
    kept = sum(0 if d.kept_index is None else d.kept_index.numel() for d in merged)
    weights = sum(base.get_parameter(m + ".weight").numel() for m in direction)
    assert kept < 0.5 * weights
    engine.close()


def test_a_full_sync_after_an_adapter_is_the_new_base(tiny_model_dir):
    base = _base(tiny_model_dir)
    engine = _engine(tiny_model_dir, "lora-reset")
    engine.update_weights(_adapter_pairs(_adapter(base, 1)))
    engine.update_weights(base.named_parameters())  # full weights, no adapter
    assert engine._adapter.merged_modules == []
    second = _adapter(base, 2)
    engine.update_weights(_adapter_pairs(second))
    for name, want in _merged_pairs(base, second):
        assert torch.equal(_served(engine, name), want), name
    engine.close()


def test_incomplete_or_misnamed_adapters_are_refused(tiny_model_dir):
    base = _base(tiny_model_dir)
    engine = _engine(tiny_model_dir, "lora-bad")
    pairs = list(_adapter_pairs(_adapter(base, 1)))
    with pytest.raises(ValueError, match=r"lacks \['scaling'\]"):
        engine.update_weights(pairs[:2])
    with pytest.raises(ValueError, match=r"no '\.weight'"):
        engine.update_weights(
            [
                ("model.nowhere.lora_A", pairs[0][1]),
                ("model.nowhere.lora_B", pairs[1][1]),
                ("model.nowhere.lora_scaling", torch.tensor(2.0)),
            ]
        )
    A, B = pairs[0][1], pairs[1][1]
    name = pairs[0][0].removesuffix(".lora_A")
    with pytest.raises(ValueError, match="update for a"):
        engine.update_weights(
            [
                (name + ".lora_A", A[:, :-1]),
                (name + ".lora_B", B),
                (name + ".lora_scaling", torch.tensor(2.0)),
            ]
        )
    engine.close()


def test_an_adapter_into_weights_lost_on_wake_is_refused(tiny_model_dir):
    base = _base(tiny_model_dir)
    config = EngineConfig(max_batch_size=2, max_seq_len=64, region_prefix="lora-lost")
    engine = BuiltinEngine(tiny_model_dir, config=config, should_back_up_weights=False)
    engine.sleep()
    engine.wake_up()
    with pytest.raises(ValueError, match="weights are lost"):
        engine.update_weights(_adapter_pairs(_adapter(base, 1)))
    # Full weights and the adapter in one sync: the adapter lands on the fresh base.
    adapter = _adapter(base, 1)
    engine.update_weights([*base.named_parameters(), *_adapter_pairs(adapter)])
    for name, want in _merged_pairs(base, adapter):
        assert torch.equal(_served(engine, name), want), name
    engine.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bf16 engine on GPU)")
def test_cuda_bf16_adapter_syncs_serve_what_merged_full_syncs_serve(tmp_path):
    from yatt.testing import make_tiny_causal_lm

    model_dir = tmp_path / "bf16"
    make_tiny_causal_lm(model_dir, arch="qwen2", seed=0, dtype=torch.bfloat16)
    base = _base(model_dir)
    by_adapter = _engine(model_dir, "lora-cuda-a", dtype="bfloat16", device="cuda")
    by_full = _engine(model_dir, "lora-cuda-f", dtype="bfloat16", device="cuda")
    for seed in (1, 2):
        adapter = _adapter(base, seed)
        by_adapter.update_weights((n, t.cuda()) for n, t in _adapter_pairs(adapter))
        by_full.update_weights((n, t.cuda()) for n, t in _merged_pairs(base, adapter))
        for name, _ in base.named_parameters():
            got, want = _served(by_adapter, name), _served(by_full, name)
            # The GPU's B A may differ from the CPU's (the full sync's) in the last float32
            # bits, which can move a bf16 rounding by one unit; never more.
            assert (_ulps_apart(got, want, torch.bfloat16) <= 1).all(), name
            assert (got == want).float().mean() > 0.99, name
        # bf16 logits: 2^-8 relative; a one-unit weight difference in a few elements.
        _assert_same_completions(_generate(by_adapter), _generate(by_full), atol=2e-2)
    by_adapter.close()
    by_full.close()


def test_the_adapter_turns_off_and_on_exactly_on_the_resident_weights(tiny_model_dir):
    """One resident base for policy and judge: with the adapter off the engine serves the base
    bit for bit (a self-judging GenRM reads it), and back on, base + adapter again."""
    from yatt.rollout._weights import named_targets

    base = _base(tiny_model_dir)
    engine = _engine(tiny_model_dir, "lora-toggle")
    first = _generate(engine)
    adapter = _adapter(base, 1)
    engine.update_weights(_adapter_pairs(adapter))
    merged = {n: _served(engine, n) for n, _ in base.named_parameters()}
    with_adapter = _generate(engine)
    targets = named_targets(engine.model)
    engine._adapter.set_enabled(targets, False)
    for name, param in base.named_parameters():
        assert torch.equal(_served(engine, name), param.detach()), name
    _assert_same_completions(_generate(engine), first, atol=0)
    with pytest.raises(RuntimeError, match="adapter is off"):
        engine.update_weights(_adapter_pairs(adapter))
    engine._adapter.set_enabled(targets, True)
    for name, tensor in merged.items():
        assert torch.equal(_served(engine, name), tensor), name
    _assert_same_completions(_generate(engine), with_adapter, atol=0)
    engine.close()


def _head(base, seed, std=0.05):
    """A trained LM head: the base's plus a random full-rank change (modules_to_save)."""
    gen = torch.Generator().manual_seed(100 + seed)
    weight = base.get_parameter("lm_head.weight").detach()
    return weight + torch.randn(weight.shape, generator=gen) * std


def test_a_module_to_save_is_served_whole_and_the_base_comes_back_when_off(tiny_model_dir):
    """PEFT's modules_to_save (the LM head trained whole): "<p>.lora_saved" replaces the served
    value outright, what a full sync of the merged model serves, and the adapter turned off
    serves the base's head again, bit for bit."""
    from yatt.rollout._weights import named_targets

    base = _base(tiny_model_dir)
    assert not base.config.tie_word_embeddings  # a tied head is refused by yatt.core
    by_adapter = _engine(tiny_model_dir, "lora-saved-a")
    by_full = _engine(tiny_model_dir, "lora-saved-f")
    first = _generate(by_adapter)
    for seed in (1, 2):  # the second head replaces the first; the base stays the base
        adapter, head = _adapter(base, seed), _head(base, seed)
        by_adapter.update_weights([*_adapter_pairs(adapter), ("lm_head.weight.lora_saved", head)])
        full = dict(_merged_pairs(base, adapter))
        full["lm_head.weight"] = head
        by_full.update_weights(full.items())
        for name, _ in base.named_parameters():
            assert torch.equal(_served(by_adapter, name), _served(by_full, name)), (seed, name)
        assert torch.equal(_served(by_adapter, "lm_head.weight"), head)  # not a low-rank delta
        _assert_same_completions(_generate(by_adapter), _generate(by_full), atol=1e-5)
    assert by_adapter._adapter.saved_parameters == ["lm_head.weight"]
    targets = named_targets(by_adapter.model)
    by_adapter._adapter.set_enabled(targets, False)
    for name, param in base.named_parameters():
        assert torch.equal(_served(by_adapter, name), param.detach()), name
    _assert_same_completions(_generate(by_adapter), first, atol=0)
    by_adapter._adapter.set_enabled(targets, True)
    assert torch.equal(_served(by_adapter, "lm_head.weight"), head)
    # A full sync of the head makes it the base: nothing kept aside any more.
    by_adapter.update_weights([("lm_head.weight", base.get_parameter("lm_head.weight"))])
    assert by_adapter._adapter.saved_parameters == []
    by_adapter.close()
    by_full.close()


def test_bad_module_to_save_values_are_refused(tiny_model_dir):
    base = _base(tiny_model_dir)
    engine = _engine(tiny_model_dir, "lora-saved-bad")
    head = _head(base, 1)
    with pytest.raises(ValueError, match=r"'model\.nowhere\.weight', which the served model lacks"):
        engine.update_weights([("model.nowhere.weight.lora_saved", head)])
    with pytest.raises(ValueError, match=r"lm_head\.weight\.lora_saved' has shape"):
        engine.update_weights([("lm_head.weight.lora_saved", head[:-1])])
    with pytest.raises(ValueError, match="came after its module to save"):
        engine.update_weights([("lm_head.weight.lora_saved", head), ("lm_head.weight", head)])
    engine.close()
