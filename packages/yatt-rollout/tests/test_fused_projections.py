"""q/k/v and gate/up as one GEMM each (builtin/_fused_projections.py): same values as the
model's own projections, same parameter names, weight updates still land, never a wrong slice."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from yatt.rollout import BuiltinEngine, EngineConfig, Request, SamplingParams
from yatt.rollout.builtin._fused_projections import (
    GroupedLinear,
    ProjectionGroup,
    fuse_projections,
)


@pytest.fixture
def model_pair(tiny_model_dir):
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    fused = copy.deepcopy(reference)
    num_groups = fuse_projections(fused)
    return reference, fused, num_groups


def _layers(model):
    return model.model.layers


def test_every_layer_gets_one_qkv_and_one_gate_up_group(model_pair):
    reference, fused, num_groups = model_pair
    num_layers = len(_layers(reference))
    assert num_groups == 2 * num_layers
    for layer in _layers(fused):
        attn, mlp = layer.self_attn, layer.mlp
        qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
        assert all(isinstance(m, GroupedLinear) for m in [*qkv, mlp.gate_proj, mlp.up_proj])
        assert len({id(m.group) for m in qkv}) == 1
        assert mlp.gate_proj.group is mlp.up_proj.group is not attn.q_proj.group
        # The members are consecutive row blocks of one tensor: [q | k | v].
        weight = attn.q_proj.group.weight
        rows = 0
        for member in qkv:
            assert member.weight.data_ptr() == weight[rows:].data_ptr()
            rows += member.out_features
        assert rows == weight.shape[0]
        assert not isinstance(layer.self_attn.o_proj, GroupedLinear)
        assert not isinstance(layer.mlp.down_proj, GroupedLinear)


def test_state_dict_names_shapes_and_values_are_unchanged(model_pair):
    reference, fused, _ = model_pair
    expected, got = reference.state_dict(), fused.state_dict()
    assert list(got) == list(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=name)


def test_logits_equal_the_unfused_model(model_pair):
    reference, fused, _ = model_pair
    ids = torch.randint(
        0, reference.config.vocab_size, (3, 11), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        torch.testing.assert_close(fused(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)


def test_a_weight_copied_into_a_member_is_what_the_fused_gemm_reads(model_pair):
    """The weight sync's path: copy_ into q_proj.weight / up_proj.bias-less weight by name."""
    reference, fused, _ = model_pair
    generator = torch.Generator().manual_seed(1)
    targets = dict(fused.named_parameters())
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if any(p in name for p in ("k_proj", "v_proj", "up_proj")):
                new = torch.randn(param.shape, generator=generator) * 0.05
                param.copy_(new)
                targets[name].copy_(new)
        ids = torch.randint(0, reference.config.vocab_size, (2, 9), generator=generator)
        torch.testing.assert_close(fused(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)


def test_odd_call_patterns_give_each_member_its_own_projection():
    torch.manual_seed(0)
    linears = [torch.nn.Linear(6, n, bias=True) for n in (4, 2, 2)]
    expected = [copy.deepcopy(m) for m in linears]
    holder = torch.nn.Module()
    holder.q_proj, holder.k_proj, holder.v_proj = linears
    assert fuse_projections(holder) == 1
    q, k, v = holder.q_proj, holder.k_proj, holder.v_proj
    x, y = torch.randn(3, 6), torch.randn(3, 6)
    with torch.no_grad():
        # Another input half way, a member read twice, members out of order.
        calls = [(q, 0, x), (q, 0, y), (k, 1, x), (k, 1, x), (v, 2, y), (q, 0, x), (v, 2, x)]
        for member, index, inp in calls:
            torch.testing.assert_close(member(inp), expected[index](inp))
        # Once every member has read an input's output, nothing is held.
        q(x), k(x), v(x)
    assert q.group._input is None and q.group._outputs == ()


def test_only_plain_linears_of_one_input_size_are_grouped():
    class Subclassed(torch.nn.Linear):
        pass

    mixed = torch.nn.Module()
    mixed.q_proj, mixed.k_proj, mixed.v_proj = (
        torch.nn.Linear(4, 4),
        torch.nn.Linear(4, 2, bias=False),  # bias on some members only
        torch.nn.Linear(4, 2),
    )
    lora_like = torch.nn.Module()
    lora_like.gate_proj, lora_like.up_proj = Subclassed(4, 8), torch.nn.Linear(4, 8)
    widths = torch.nn.Module()
    widths.gate_proj, widths.up_proj = torch.nn.Linear(4, 8), torch.nn.Linear(5, 8)
    for module in (mixed, lora_like, widths):
        assert fuse_projections(module) == 0
        assert not any(isinstance(m, GroupedLinear) for m in module.modules())


def test_the_fused_forward_compiles_without_graph_breaks(model_pair):
    """The engine compiles its decode step: the grouping must not break dynamo's graph."""
    reference, fused, _ = model_pair
    ids = torch.randint(
        0, reference.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(2)
    )
    compiled = torch.compile(lambda t: fused(t).logits, fullgraph=True, backend="eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids), reference(ids).logits, rtol=1e-5, atol=1e-5)


def test_group_output_is_split_in_member_order():
    weight = torch.arange(12.0).reshape(3, 4)  # rows: member 0 has 2, member 1 has 1
    group = ProjectionGroup(weight, None, [2, 1])
    x = torch.eye(4)[:1]  # picks column 0 of every row
    assert group.output(x, 1).tolist() == [[8.0]]
    assert group.output(x, 0).tolist() == [[0.0, 4.0]]


def _generate(engine, prompts, sampling):
    return engine.generate([Request(prompt_ids=p) for p in prompts], sampling)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_engine_with_fused_projections_samples_what_the_unfused_engine_does(
    tiny_model_dir, assert_same_samples, temperature
):
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    sampling = SamplingParams(n=2, max_new_tokens=12, temperature=temperature, seed=3)
    outputs = {}
    for fuse in (False, True):
        config = EngineConfig(
            dtype="float32", max_batch_size=8, max_seq_len=64, fuse_projections=fuse
        )
        engine = BuiltinEngine(tiny_model_dir, config=config)
        try:
            groups = [m for m in engine.model.modules() if isinstance(m, GroupedLinear)]
            assert bool(groups) == fuse
            outputs[fuse] = _generate(engine, prompts, sampling)
        finally:
            engine.close()
    assert_same_samples(outputs[True], outputs[False], atol=1e-4)


def test_engine_update_weights_reaches_the_fused_gemm(tiny_model_dir, assert_same_samples):
    """After a weight sync, a fused engine samples what an engine loaded with those weights does."""
    new_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in new_model.named_parameters():
            if name.endswith(("q_proj.weight", "v_proj.bias", "gate_proj.weight")):
                param.add_(torch.randn(param.shape, generator=generator) * 0.5)
    prompts = [[1, 2, 3], [7, 7, 7, 7]]
    sampling = SamplingParams(n=2, max_new_tokens=10, temperature=0.0)
    config = EngineConfig(dtype="float32", max_batch_size=8, max_seq_len=64)
    synced = BuiltinEngine(tiny_model_dir, config=config)
    fresh = BuiltinEngine(copy.deepcopy(new_model), config=config)
    try:
        before = _generate(synced, prompts, sampling)
        synced.update_weights(new_model.named_parameters())
        after, expected = _generate(synced, prompts, sampling), _generate(fresh, prompts, sampling)
    finally:
        synced.close()
        fresh.close()
    assert_same_samples(after, expected, atol=1e-4)
    assert [c.logprobs for c in before] != [c.logprobs for c in after]
