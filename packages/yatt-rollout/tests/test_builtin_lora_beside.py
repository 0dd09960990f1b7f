"""EngineConfig.lora_mode="beside" (builtin/_lora_beside.py): the adapter's low-rank product
beside the untouched base GEMMs, gated per row by Request.use_adapter. Rows with the adapter
serve what a merged full sync serves (LoRA's definition, W + s B A, rounded once there, and
x W^T + s (x A^T) B^T here: float32 rounding apart); rows without it serve the base model's
logprobs exactly, in the same batch; the engine holds one set of base tensors."""

NUM_GPUS = 0

import pytest
import torch
from transformers import AutoModelForCausalLM

from yatt.rollout import BuiltinEngine, EngineConfig, Request, SamplingParams

PROMPTS = [[5, 9, 13, 2], [7, 3], [11, 4, 6]]
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RANK, SCALING = 4, 2.0


def _base(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def _adapter(base, seed, std=0.05, rank=RANK):
    """{module: (A [rank, in], B [out, rank])} for every decoder linear, random (B nonzero)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, module in base.named_modules():
        if name.rsplit(".", 1)[-1] in TARGETS:
            A = torch.randn(rank, module.in_features, generator=gen) * std
            B = torch.randn(module.out_features, rank, generator=gen) * std
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


def _head(base, seed, std=0.05):
    """A trained LM head: the base's plus a random full-rank change (modules_to_save)."""
    gen = torch.Generator().manual_seed(100 + seed)
    weight = base.get_parameter("lm_head.weight").detach()
    return weight + torch.randn(weight.shape, generator=gen) * std


def _served(engine, name):
    return engine.model.get_parameter(name).detach().float().cpu()


# Two samples per prompt at temperature 1 and fixed seed: decode rows of both kinds in every
# step; the label ids: a judge's verdict probabilities at the first response position.
SAMPLED = SamplingParams(temperature=1.0, n=2, max_new_tokens=6, seed=7, label_token_ids=(3, 5))
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
MIXED_PROMPTS = [*PROMPTS, [8, 8, 1, 4, 2]]
# Per prompt: with the adapter (policy rows) or on the base (judge rows), interleaved.
IS_ON = [True, False, True, False]
# float32 logprobs of a tiny model: x (W + s B A)^T and x W^T + s (x A^T) B^T round apart by
# a few units of 2^-24 per GEMM; 1e-5 is ~100 of them.
ATOL_F32 = 1e-5


def _engine(model_dir, prefix, *, mode="beside", fuse=True, back_up=True, **kwargs):
    """back_up=False: woken without a backup of the weights (they are lost in a sleep)."""
    config = EngineConfig(
        max_batch_size=8,
        max_seq_len=64,
        region_prefix=prefix,
        fuse_projections=fuse,
        lora_mode=mode,
        **kwargs,
    )
    return BuiltinEngine(model_dir, config=config, should_back_up_weights=back_up)


def _requests(use_adapter=None, prompts=MIXED_PROMPTS):
    flags = use_adapter or [True] * len(prompts)
    return [Request(prompt_ids=list(p), use_adapter=f) for p, f in zip(prompts, flags, strict=True)]


def _assert_same(got, want, atol):
    assert (got.request_index, got.sample_index) == (want.request_index, want.sample_index)
    assert got.response_ids == want.response_ids
    torch.testing.assert_close(
        torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=atol, rtol=0
    )
    if want.label_logprobs is not None:
        torch.testing.assert_close(
            torch.tensor(got.label_logprobs), torch.tensor(want.label_logprobs), atol=atol, rtol=0
        )


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "separate"])
def test_rows_with_and_without_the_adapter_in_one_batch(tiny_model_dir, fuse):
    """Adapter rows = a merged full sync's engine; base rows = a plain base engine, exactly.
    Every engine gets the same prompts in the same batch (same GEMM shapes), so the base rows'
    comparison is bit for bit."""
    base = _base(tiny_model_dir)
    beside = _engine(tiny_model_dir, f"bs-{fuse}", fuse=fuse)
    merged = _engine(tiny_model_dir, f"bs-m-{fuse}", mode="merge", fuse=fuse)
    plain = _engine(tiny_model_dir, f"bs-p-{fuse}", fuse=fuse)
    want_base = plain.generate(_requests(), SAMPLED)
    for seed in (1, 2):  # the second adapter replaces the first in the same buffers
        adapter = _adapter(base, seed)
        beside.update_weights(_adapter_pairs(adapter))
        merged.update_weights(_merged_pairs(base, adapter))
        want_adapter = merged.generate(_requests(), SAMPLED)
        got = beside.generate(_requests(IS_ON), SAMPLED)
        assert len(got) == 2 * len(MIXED_PROMPTS)
        for c, on, off in zip(got, want_adapter, want_base, strict=True):
            if IS_ON[c.request_index]:
                _assert_same(c, on, ATOL_F32)
            else:
                _assert_same(c, off, 0.0)
        # The adapter changed the policy rows (not a comparison of two base engines).
        assert [c.response_ids for c in want_adapter] != [c.response_ids for c in want_base]
    for engine in (beside, merged, plain):
        engine.close()


def test_greedy_adapter_rows_match_a_merged_full_sync(tiny_model_dir):
    base = _base(tiny_model_dir)
    beside = _engine(tiny_model_dir, "bs-greedy")
    merged = _engine(tiny_model_dir, "bs-greedy-m", mode="merge")
    adapter = _adapter(base, 3)
    beside.update_weights(_adapter_pairs(adapter))
    merged.update_weights(_merged_pairs(base, adapter))
    got = beside.generate(_requests(prompts=PROMPTS, use_adapter=[True] * 3), GREEDY)
    want = merged.generate(_requests(prompts=PROMPTS, use_adapter=[True] * 3), GREEDY)
    for a, b in zip(got, want, strict=True):
        _assert_same(a, b, ATOL_F32)
    beside.close()
    merged.close()


def _reusing(pairs):
    """The pairs, each tensor scribbled over once the engine has returned from its bucket (one
    pair a bucket: pair j - 2's bucket is done when pair j is asked for), as a sender that
    reuses its bucket memory may (update_weights' contract)."""
    given = []
    for j, pair in enumerate(pairs):
        if j >= 2:
            given[j - 2][1].fill_(7.0)
        given.append(pair)
        yield pair


@pytest.mark.parametrize("bucket_bytes", [1, 1 << 30], ids=["piece-per-bucket", "one-bucket"])
def test_the_sync_keeps_copies_not_the_senders_tensors(tiny_model_dir, bucket_bytes):
    """The engine serves what was synced until the next sync, whatever the sender does with its
    tensors afterwards: reuses a bucket's memory once the engine returned from it (a module's
    pieces across buckets are kept until it is complete), or trains them in place (a colocated
    trainer's live LoRA parameters); on the first sync (new buffers) and the next (in place)."""
    base = _base(tiny_model_dir)
    engine = _engine(tiny_model_dir, f"bs-own-{bucket_bytes}")
    reference = _engine(tiny_model_dir, f"bs-own-ref-{bucket_bytes}")
    for seed in (4, 5):
        adapter = _adapter(base, seed)
        sent = {m: (A.clone(), B.clone()) for m, (A, B) in adapter.items()}
        pairs = _adapter_pairs(sent)
        engine.update_weights(
            _reusing(pairs) if bucket_bytes == 1 else pairs, bucket_bytes=bucket_bytes
        )
        for A, B in sent.values():  # the trainer's next optimizer step, in place
            A.mul_(-3.0)
            B.add_(1.0)
        reference.update_weights(_adapter_pairs(adapter))
        got = engine.generate(_requests(prompts=PROMPTS, use_adapter=[True] * 3), GREEDY)
        want = reference.generate(_requests(prompts=PROMPTS, use_adapter=[True] * 3), GREEDY)
        for a, b in zip(got, want, strict=True):
            _assert_same(a, b, 0.0)
    engine.close()
    reference.close()


def test_the_engine_holds_one_set_of_base_tensors(tiny_model_dir):
    """Adapter syncs and adapter-on/off calls never copy or move the base: the same storage
    (data_ptr) before and after, its values the checkpoint's bit for bit; beside it only the
    adapter's factors (rank x (in + out) per target)."""
    from yatt.rollout._weights import named_targets

    base = _base(tiny_model_dir)
    engine = _engine(tiny_model_dir, "bs-bytes")
    before = {name: t.data_ptr() for name, t in named_targets(engine.model).items()}
    adapter = _adapter(base, 1)
    engine.update_weights(_adapter_pairs(adapter))
    engine.generate(_requests(IS_ON), SAMPLED)
    view = engine.without_adapter()
    view.generate(_requests(), SAMPLED)
    assert view.engine is engine  # the judge's engine is the policy's, not a copy
    after = {name: t.data_ptr() for name, t in named_targets(engine.model).items()}
    assert after == before
    for name, param in base.named_parameters():
        assert torch.equal(_served(engine, name), param.detach()), name
    factors = sum(A.numel() + B.numel() for A, B in adapter.values())
    assert engine.adapter_bytes() == factors * 4  # float32 served dtype
    weights = sum(p.numel() for p in base.parameters())
    assert factors < weights / 4
    engine.close()


def test_the_base_view_serves_the_base(tiny_model_dir):
    """engine.without_adapter(): a judge on the policy's engine reads the base model's
    verdict probabilities, what a separate base engine gives."""
    base = _base(tiny_model_dir)
    engine = _engine(tiny_model_dir, "bs-view")
    plain = _engine(tiny_model_dir, "bs-view-p")
    engine.update_weights(_adapter_pairs(_adapter(base, 1)))
    view = engine.without_adapter()
    got = view.generate(_requests(), SAMPLED)
    want = plain.generate(_requests(), SAMPLED)
    for a, b in zip(got, want, strict=True):
        _assert_same(a, b, 0.0)
    with pytest.raises(RuntimeError, match="sync the policy's engine"):
        view.update_weights([])
    engine.close()
    plain.close()


def test_a_full_sync_drops_the_adapter(tiny_model_dir):
    base = _base(tiny_model_dir)
    engine = _engine(tiny_model_dir, "bs-full")
    plain = _engine(tiny_model_dir, "bs-full-p")
    engine.update_weights(_adapter_pairs(_adapter(base, 1)))
    engine.update_weights(base.named_parameters())  # full weights: the new base, no adapter
    for a, b in zip(
        engine.generate(_requests(), SAMPLED), plain.generate(_requests(), SAMPLED), strict=True
    ):
        _assert_same(a, b, 0.0)
    with pytest.raises(ValueError, match="came after the adapter"):
        pairs = list(_adapter_pairs(_adapter(base, 2)))
        weight = pairs[0][0].replace(".lora_A", ".weight")
        engine.update_weights([*pairs, (weight, base.get_parameter(weight).detach())])
    engine.close()
    plain.close()


def test_a_module_to_save_serves_adapter_rows_only(tiny_model_dir):
    """PEFT's modules_to_save (the LM head trained whole): rows with the adapter read the
    trained head, as a merged full sync with that head does; base rows the base's head."""
    base = _base(tiny_model_dir)
    beside = _engine(tiny_model_dir, "bs-head")
    merged = _engine(tiny_model_dir, "bs-head-m", mode="merge")
    plain = _engine(tiny_model_dir, "bs-head-p")
    adapter, head = _adapter(base, 1), _head(base, 1)
    beside.update_weights([*_adapter_pairs(adapter), ("lm_head.weight.lora_saved", head)])
    full = dict(_merged_pairs(base, adapter))
    full["lm_head.weight"] = head
    merged.update_weights(full.items())
    got = beside.generate(_requests(IS_ON), SAMPLED)
    want_on = merged.generate(_requests(), SAMPLED)
    want_off = plain.generate(_requests(), SAMPLED)
    for c, on, off in zip(got, want_on, want_off, strict=True):
        _assert_same(c, on if IS_ON[c.request_index] else off, ATOL_F32 * IS_ON[c.request_index])
    assert beside._low_rank.saved_parameters == ["lm_head.weight"]
    for engine in (beside, merged, plain):
        engine.close()


def test_bad_input_is_refused(tiny_model_dir):
    base = _base(tiny_model_dir)
    merge = _engine(tiny_model_dir, "bs-bad-m", mode="merge")
    with pytest.raises(ValueError, match=r"requests\[0\]\.use_adapter=False.*lora_mode"):
        merge.generate([Request(prompt_ids=[1, 2], use_adapter=False)], GREEDY)
    with pytest.raises(ValueError, match="lora_mode='beside'"):
        merge.without_adapter()
    merge.close()
    with pytest.raises(ValueError, match=r"EngineConfig\.lora_mode='sideways'"):
        EngineConfig(lora_mode="sideways")
    engine = _engine(tiny_model_dir, "bs-bad")
    pairs = list(_adapter_pairs(_adapter(base, 1)))
    with pytest.raises(ValueError, match=r"lacks \['scaling'\]"):
        engine.update_weights(pairs[:2])
    A, B = pairs[0][1], pairs[1][1]
    name = pairs[0][0].removesuffix(".lora_A")
    with pytest.raises(ValueError, match="update for a"):
        engine.update_weights(
            [
                (name + ".lora_A", A[:, :-1]),
                (name + ".lora_B", B),
                (name + ".lora_scaling", A[0, 0]),
            ]
        )
    with pytest.raises(ValueError, match=r"requests\[0\]\.use_adapter=1"):
        engine.generate([Request(prompt_ids=[1, 2], use_adapter=1)], GREEDY)
    engine.close()


def test_an_adapter_into_weights_lost_on_wake_is_refused(tiny_model_dir):
    base = _base(tiny_model_dir)
    config = EngineConfig(
        max_batch_size=2, max_seq_len=64, region_prefix="bs-lost", lora_mode="beside"
    )
    engine = BuiltinEngine(tiny_model_dir, config=config, should_back_up_weights=False)
    engine.sleep()
    engine.wake_up()
    with pytest.raises(ValueError, match="weights are lost"):
        engine.update_weights(_adapter_pairs(_adapter(base, 1)))
    engine.update_weights([*base.named_parameters(), *_adapter_pairs(_adapter(base, 1))])
    engine.generate(_requests(prompts=PROMPTS[:1]), GREEDY)  # served again
    engine.close()


def test_a_kept_conversation_turns_to_the_base_with_its_own_kv(tiny_model_dir):
    """Request.session_id keeps a turn's KV for the next one; that KV was computed with the
    adapter, so a next turn without it prefills whole: the base model's logprobs exactly."""
    base = _base(tiny_model_dir)
    engine = _engine(tiny_model_dir, "bs-session")
    plain = _engine(tiny_model_dir, "bs-session-p")
    engine.update_weights(_adapter_pairs(_adapter(base, 1)))
    prompt = [5, 9, 13, 2]
    (first,) = engine.generate([Request(prompt_ids=prompt, session_id="s")], GREEDY)
    assert engine.num_kept_sessions == 1
    turn = [*prompt, *first.response_ids, 9, 10]
    (got,) = engine.generate([Request(prompt_ids=turn, session_id="s", use_adapter=False)], GREEDY)
    (want,) = plain.generate([Request(prompt_ids=turn)], GREEDY)
    _assert_same(got, want, 0.0)
    engine.close()
    plain.close()


@pytest.mark.slow
def test_compiled_steps_see_an_adapter_synced_after_their_first_compile(tiny_model_dir):
    """The adapter's hooks appear at its first sync, after the engine's first compiled call:
    the compiled prefill and decode step must take them (dynamo skips hook guards by default
    and replayed the graph compiled without them: adapter rows then served the base)."""
    base = _base(tiny_model_dir)
    compiled = _engine(tiny_model_dir, "bs-compiled", compile_decode=True, compile_prefill=True)
    merged = _engine(tiny_model_dir, "bs-compiled-m", mode="merge")
    plain = _engine(tiny_model_dir, "bs-compiled-p")
    compiled.generate(_requests(), GREEDY)  # compiled without hooks
    adapter = _adapter(base, 1)
    compiled.update_weights(_adapter_pairs(adapter))
    merged.update_weights(_merged_pairs(base, adapter))
    got = compiled.generate(_requests(IS_ON), GREEDY)
    want_on, want_off = merged.generate(_requests(), GREEDY), plain.generate(_requests(), GREEDY)
    for c, on, off in zip(got, want_on, want_off, strict=True):
        # Compiled against eager engines: float32 fusion apart, never the other model.
        _assert_same(c, on if IS_ON[c.request_index] else off, ATOL_F32)
    for engine in (compiled, merged, plain):
        engine.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (graphs, compile)")
@pytest.mark.parametrize("reserve", [None, RANK], ids=["made-at-sync", "reserved"])
def test_cuda_rows_with_and_without_the_adapter_under_graphs(tmp_path, reserve):
    """On a GPU, bf16, CUDA graphs and the compiled decode step: the gate is a graph input.
    Adapter rows match a merged full sync's engine, base rows a plain engine's (bf16 logits:
    2^-8 relative; the compiled graphs of the two engines may fuse differently). With the
    buffers reserved (max_lora_rank) the graphs captured before the first adapter serve it."""
    from yatt.testing import make_tiny_causal_lm

    model_dir = tmp_path / "bf16"
    make_tiny_causal_lm(model_dir, arch="qwen2", seed=0, dtype=torch.bfloat16)
    base = _base(model_dir)
    kwargs = dict(dtype="bfloat16", device="cuda")
    beside = _engine(model_dir, f"bs-cuda-{reserve}", max_lora_rank=reserve, **kwargs)
    merged = _engine(model_dir, f"bs-cuda-m-{reserve}", mode="merge", **kwargs)
    plain = _engine(model_dir, f"bs-cuda-p-{reserve}", **kwargs)
    want_base = plain.generate(_requests(), GREEDY)
    if reserve is not None:  # graphs captured before any adapter, kept through the syncs
        assert [c.response_ids for c in beside.generate(_requests(), GREEDY)] == [
            c.response_ids for c in want_base
        ]
        releases = _spy_graph_releases(beside)
    for seed in (1, 2):
        adapter = _adapter(base, seed)
        beside.update_weights((n, t.cuda()) for n, t in _adapter_pairs(adapter))
        if reserve is not None:
            assert releases == []
        merged.update_weights((n, t.cuda()) for n, t in _merged_pairs(base, adapter))
        want_adapter = merged.generate(_requests(), GREEDY)
        got = beside.generate(_requests(IS_ON), GREEDY)
        for c, on, off in zip(got, want_adapter, want_base, strict=True):
            _assert_same(c, on if IS_ON[c.request_index] else off, 2e-2)
    for engine in (beside, merged, plain):
        engine.close()


def _spy_graph_releases(engine) -> list[int]:
    """The calls to the engine's graph release (captured graphs dropped: under CUDA graphs and
    compile, everything is recaptured and compiled again) from now on."""
    calls: list[int] = []
    original = engine._runner.release_graphs

    def spy():
        calls.append(1)
        original()

    engine._runner.release_graphs = spy
    return calls


def test_reserved_buffers_serve_the_base_and_take_adapters_in_place(tiny_model_dir):
    """EngineConfig.max_lora_rank: zero buffers and hooks made with the engine. Before any
    adapter it serves the base exactly; an adapter of that rank, then of a lower one (padded
    with zeros), loads without dropping the graphs and serves what a merged full sync serves;
    one of a higher rank re-makes the buffers (graphs dropped once) and is still served."""
    base = _base(tiny_model_dir)
    reserved = _engine(tiny_model_dir, "bs-res", max_lora_rank=RANK)
    plain = _engine(tiny_model_dir, "bs-res-p")
    merged = _engine(tiny_model_dir, "bs-res-m", mode="merge")
    # Rank 4 on the tiny model's 14 decoder linears (float32): A [4, in] and sB [out, 4] each.
    hidden, kv_out, mlp = 64, 32, 128
    linears = [(hidden, hidden), (hidden, kv_out), (hidden, kv_out), (hidden, hidden)]
    linears += [(hidden, mlp), (hidden, mlp), (mlp, hidden)]
    assert reserved.adapter_bytes() == 2 * sum(4 * RANK * (i + o) for i, o in linears)
    for got, want in zip(
        reserved.generate(_requests(), SAMPLED), plain.generate(_requests(), SAMPLED), strict=True
    ):
        _assert_same(got, want, 0.0)
    releases = _spy_graph_releases(reserved)
    for seed, rank, want_releases in ((1, RANK, 0), (2, RANK // 2, 0), (3, 2 * RANK, 1)):
        adapter = _adapter(base, seed, rank=rank)
        reserved.update_weights(_adapter_pairs(adapter))
        merged.update_weights(_merged_pairs(base, adapter))
        assert len(releases) == want_releases, (seed, rank)
        got = reserved.generate(_requests(), GREEDY)
        for a, b in zip(got, merged.generate(_requests(), GREEDY), strict=True):
            _assert_same(a, b, ATOL_F32)
    for engine in (reserved, plain, merged):
        engine.close()


def test_reserved_targets_follow_peft_rules(tiny_model_dir):
    """lora_target_modules as PEFT's target_modules: "all-linear" is every decoder Linear but
    the output layer, a tuple names modules by their last parts, a string is a regex on the
    whole name; one selecting nothing is refused at construction."""
    layers = [f"model.layers.{i}" for i in range(2)]
    attn, mlp = ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")
    every = sorted(
        [f"{p}.self_attn.{m}" for p in layers for m in attn]
        + [f"{p}.mlp.{m}" for p in layers for m in mlp]
    )
    cases = [
        ("all-linear", every),
        (
            ("q_proj", "v_proj"),
            sorted(f"{p}.self_attn.{m}" for p in layers for m in ("q_proj", "v_proj")),
        ),
        (r"model\.layers\.0\..*", [n for n in every if n.startswith("model.layers.0.")]),
    ]
    for i, (targets, want) in enumerate(cases):
        engine = _engine(
            tiny_model_dir, f"bs-tgt-{i}", max_lora_rank=2, lora_target_modules=targets
        )
        assert engine._low_rank.modules == want, targets
        engine.close()
    with pytest.raises(ValueError, match=r"lora_target_modules=\('lm_head',\) selects no"):
        _engine(tiny_model_dir, "bs-tgt-bad", max_lora_rank=2, lora_target_modules=("lm_head",))


def test_max_lora_rank_bad_values_are_refused():
    with pytest.raises(ValueError, match=r"EngineConfig\.max_lora_rank=0"):
        EngineConfig(lora_mode="beside", max_lora_rank=0)
    with pytest.raises(ValueError, match=r"max_lora_rank=8 with lora_mode='merge'"):
        EngineConfig(max_lora_rank=8)
    with pytest.raises(ValueError, match=r"EngineConfig\.lora_target_modules=\(\)"):
        EngineConfig(lora_mode="beside", max_lora_rank=8, lora_target_modules=())


def test_reserved_buffers_lost_on_wake_are_cleared_by_the_full_sync(tiny_model_dir):
    """Woken without a backup, the weights' region holds garbage (NaN here), the reserved
    adapter buffers too; the full sync that must follow serves the base again exactly: a NaN
    factor times a zeroed one would still be NaN, so both are cleared."""
    base = _base(tiny_model_dir)
    engine = _engine(tiny_model_dir, "bs-res-lost", max_lora_rank=RANK, back_up=False)
    plain = _engine(tiny_model_dir, "bs-res-lost-p")
    engine.sleep()
    engine.wake_up()
    engine.update_weights(base.named_parameters())
    for got, want in zip(
        engine.generate(_requests(), SAMPLED), plain.generate(_requests(), SAMPLED), strict=True
    ):
        _assert_same(got, want, 0.0)
    engine.close()
    plain.close()


# -- a bound adapter (BuiltinEngine.bind_adapter, _adapter_binding.py) -------------------------


def _trained(adapter, head=None):
    """The adapter as a trainer holds it: nn.Parameters (A, B per module; the trained head)."""
    params = {
        m: (torch.nn.Parameter(A.clone()), torch.nn.Parameter(B.clone()))
        for m, (A, B) in adapter.items()
    }
    return params, (None if head is None else torch.nn.Parameter(head.clone()))


def _live_pairs(params, head=None, scaling=SCALING):
    """What TorchPolicy.named_adapter_weights(live=True) yields: the parameters themselves."""
    for name, (A, B) in params.items():
        yield name + ".lora_A", A
        yield name + ".lora_B", B
        yield name + ".lora_scaling", torch.tensor(scaling)
    if head is not None:
        yield "lm_head.weight.lora_saved", head


def _values(params):
    return {m: (A.detach().clone(), B.detach().clone()) for m, (A, B) in params.items()}


@torch.no_grad()
def _optimizer_step(params, base, seed, head=None):
    """In place, as AdamW updates a trainer's parameters: new values, same storage."""
    for module, (A, B) in _adapter(base, seed).items():
        params[module][0].copy_(A)
        params[module][1].copy_(B)
    if head is not None:
        head.copy_(_head(base, seed))


def _assert_serves_alike(engine, reference, requests=None):
    """Bit for bit: both engines hold the same values after the same float32 operations."""
    requests = requests or _requests(IS_ON)
    got, want = engine.generate(requests, SAMPLED), reference.generate(requests, SAMPLED)
    for c, w in zip(got, want, strict=True):
        _assert_same(c, w, 0.0)
    return got


@pytest.mark.parametrize("reserve", [None, 2 * RANK], ids=["own-rank", "reserved-larger"])
def test_a_bound_adapter_refreshes_to_what_update_weights_serves(tiny_model_dir, reserve):
    """bind_adapter loads the trainer's adapter once; after each in-place optimizer step,
    refresh() serves exactly what an engine given the same values through update_weights
    serves (the same float32 scaling B, rounded once). Reserved at a larger rank, the bound
    copies fill the first `rank` rows / columns. With the head trained whole too."""
    base = _base(tiny_model_dir)
    bound = _engine(tiny_model_dir, f"bd-{reserve}", max_lora_rank=reserve)
    synced = _engine(tiny_model_dir, f"bd-s-{reserve}", max_lora_rank=reserve)
    params, head = _trained(_adapter(base, 1), _head(base, 1))
    binding = bound.bind_adapter(_live_pairs(params, head))
    assert binding.num_tensors == 2 * len(params) + 1
    synced.update_weights(_live_pairs(_values(params), head.detach().clone()))
    first = _assert_serves_alike(bound, synced)
    _optimizer_step(params, base, 2, head)
    binding.refresh()
    synced.update_weights(_live_pairs(_values(params), head.detach().clone()))
    second = _assert_serves_alike(bound, synced)
    # The step changed what is served: the comparison is not between two stale engines.
    assert [c.logprobs for c in first] != [c.logprobs for c in second]
    for engine in (bound, synced):
        engine.close()


@pytest.mark.parametrize("way", ["refresh", "update_weights"])
@pytest.mark.parametrize(
    "dtype, scaling",
    [("bfloat16", 2.0), ("bfloat16", 0.25), ("bfloat16", 16 / 12), ("float16", 2.0)],
)
def test_a_sync_rounds_scaling_times_B_once(tiny_model_dir, dtype, scaling, way):
    """The served sB is scaling * B computed in float32 and rounded once into the served dtype,
    whichever way a sync gets there (a bound refresh or update_weights into reserved buffers):
    B cast first then scaled in place (a power-of-two scaling into bfloat16), or through
    float32 (any other scaling; float16, whose subnormals a cast-first would round coarser).
    A is the cast."""
    base = _base(tiny_model_dir)
    engine = _engine(tiny_model_dir, f"bd-round-{dtype}-{scaling}", max_lora_rank=RANK, dtype=dtype)
    params, _ = _trained(_adapter(base, 1))
    binding = engine.bind_adapter(_live_pairs(params, scaling=scaling))
    # tiny B entries too: float16 subnormals (below 6.1e-5), where rounding first would differ
    _optimizer_step(params, base, 2)
    with torch.no_grad():
        for _, B in params.values():
            B[: B.shape[0] // 2] *= 1e-4
    if way == "refresh":
        binding.refresh()
    else:
        engine.update_weights(_live_pairs(_values(params), scaling=scaling))
    served = getattr(torch, dtype)
    for module, (A, B) in params.items():
        factors = engine._low_rank._factors[module]
        assert torch.equal(factors.A, A.detach().to(served))
        assert torch.equal(factors.sB, (B.detach().float() * scaling).to(served))
    engine.close()


def test_a_bound_parameter_moved_to_new_storage_is_read_where_it_is_now(tiny_model_dir):
    """A trainer that offloads and onloads its parameters gives them new storage
    (param.data = ...): the binding holds the parameters, not views of the old storage, so
    refresh() reads the new values. An empty placeholder (offloaded, not back) is refused,
    naming the tensor."""
    base = _base(tiny_model_dir)
    bound = _engine(tiny_model_dir, "bd-moved", max_lora_rank=RANK)
    synced = _engine(tiny_model_dir, "bd-moved-s", max_lora_rank=RANK)
    params, _ = _trained(_adapter(base, 1))
    binding = bound.bind_adapter(_live_pairs(params))
    new = _adapter(base, 3)
    for module, (A, B) in params.items():
        A.data, B.data = new[module][0].clone(), new[module][1].clone()
    binding.refresh()
    synced.update_weights(_adapter_pairs(new))
    _assert_serves_alike(bound, synced)
    first = next(iter(params))
    params[first][1].data = torch.empty(0)
    with pytest.raises(ValueError, match=rf"'{first}\.lora_B' is now \(0,\).*onload it first"):
        binding.refresh()
    for engine in (bound, synced):
        engine.close()


def test_a_binding_goes_stale_and_bad_bindings_are_refused(tiny_model_dir):
    """update_weights after bind_adapter, the weights asleep or lost: refresh() raises (bind
    again). Detached tensors (they would go stale), a full weight, a merge-mode engine:
    ValueError before anything loads (the engine still serves the base)."""
    base = _base(tiny_model_dir)
    engine = _engine(tiny_model_dir, "bd-bad", max_lora_rank=RANK)
    plain = _engine(tiny_model_dir, "bd-bad-p")
    with pytest.raises(
        ValueError,
        match=r"'model\.layers\.0\.self_attn\.q_proj\.lora_A' is a Tensor, not the trained nn\.Parameter",
    ):
        engine.bind_adapter(_adapter_pairs(_adapter(base, 1)))
    params, _ = _trained(_adapter(base, 1))
    with pytest.raises(ValueError, match=r"'lm_head\.weight' is a full weight"):
        engine.bind_adapter([("lm_head.weight", base.lm_head.weight), *_live_pairs(params)])
    _assert_serves_alike(engine, plain, _requests())  # nothing loaded
    with pytest.raises(ValueError, match=r"no tensors"):
        engine.bind_adapter([])
    binding = engine.bind_adapter(_live_pairs(params))
    engine.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        binding.refresh()
    engine.wake_up()
    binding.refresh()  # woken with the backup: still bound
    engine.update_weights(_adapter_pairs(_adapter(base, 2)))
    with pytest.raises(
        ValueError, match=r"update_weights was called after bind_adapter.*bind again"
    ):
        binding.refresh()
    engine.bind_adapter(_live_pairs(params)).refresh()  # bound again
    merge = _engine(tiny_model_dir, "bd-bad-m", mode="merge")
    with pytest.raises(ValueError, match=r"bind_adapter with EngineConfig\.lora_mode='merge'"):
        merge.bind_adapter(_live_pairs(params))
    lossy = _engine(tiny_model_dir, "bd-lossy", max_lora_rank=RANK, back_up=False)
    lossy_binding = lossy.bind_adapter(_live_pairs(params))
    lossy.sleep()
    lossy.wake_up()
    with pytest.raises(ValueError, match="base weights were lost"):
        lossy_binding.refresh()
    for e in (engine, plain, merge, lossy):
        e.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (graphs, compile)")
def test_cuda_a_bound_adapter_refreshes_under_graphs(tmp_path):
    """On a GPU, bf16, CUDA graphs and the compiled decode step, buffers reserved: a refresh
    after an in-place step keeps the captured graphs and serves what an engine synced with
    update_weights serves (separately compiled engines: bf16 tolerance, same tokens)."""
    from yatt.testing import make_tiny_causal_lm

    model_dir = tmp_path / "bf16"
    make_tiny_causal_lm(model_dir, arch="qwen2", seed=0, dtype=torch.bfloat16)
    base = _base(model_dir)
    kwargs = dict(dtype="bfloat16", device="cuda", max_lora_rank=RANK)
    bound = _engine(model_dir, "bd-cuda", **kwargs)
    synced = _engine(model_dir, "bd-cuda-s", **kwargs)
    params, _ = _trained({m: (A.cuda(), B.cuda()) for m, (A, B) in _adapter(base, 1).items()})
    binding = bound.bind_adapter(_live_pairs(params))
    before = bound.generate(_requests(), GREEDY)  # graphs captured with the adapter bound
    releases = _spy_graph_releases(bound)
    with torch.no_grad():
        for module, (A, B) in _adapter(base, 2).items():
            params[module][0].copy_(A)
            params[module][1].copy_(B)
    binding.refresh()
    assert releases == []
    synced.update_weights((n, t.cuda()) for n, t in _adapter_pairs(_adapter(base, 2)))
    got, want = bound.generate(_requests(), GREEDY), synced.generate(_requests(), GREEDY)
    for c, w in zip(got, want, strict=True):
        _assert_same(c, w, 2e-2)
    assert [c.logprobs for c in got] != [c.logprobs for c in before]
    for engine in (bound, synced):
        engine.close()


def test_a_reserved_module_to_save_is_set_and_cleared_in_place(tiny_model_dir):
    """EngineConfig.lora_modules_to_save: the LM head's trained copy and hook made with the
    engine, off. Before any adapter it serves the base exactly; adapters with the head and a
    full sync of the head (the new base: the copy off) keep the engine's graphs (no layout
    change). Adapter rows serve what a merged full sync serves, base rows the base; each
    state bit for bit what a beside engine without the reservation serves."""
    base = _base(tiny_model_dir)
    reserved = _engine(
        tiny_model_dir, "bs-rsave", max_lora_rank=RANK, lora_modules_to_save=("lm_head",)
    )
    unreserved = _engine(tiny_model_dir, "bs-rsave-u")
    plain = _engine(tiny_model_dir, "bs-rsave-p")
    merged = _engine(tiny_model_dir, "bs-rsave-m", mode="merge")
    assert reserved._low_rank.saved_parameters == ["lm_head.weight"]
    _assert_serves_alike(reserved, plain, _requests())
    releases = _spy_graph_releases(reserved)
    adapter, head = _adapter(base, 1), _head(base, 1)
    for engine in (reserved, unreserved):
        engine.update_weights([*_adapter_pairs(adapter), ("lm_head.weight.lora_saved", head)])
    full = dict(_merged_pairs(base, adapter))
    full["lm_head.weight"] = head
    merged.update_weights(full.items())
    got = _assert_serves_alike(reserved, unreserved)
    want_on, want_off = merged.generate(_requests(), SAMPLED), plain.generate(_requests(), SAMPLED)
    for c, on, off in zip(got, want_on, want_off, strict=True):
        is_on = IS_ON[c.request_index]
        _assert_same(c, on if is_on else off, ATOL_F32 * is_on)
    # A full sync of the base's head: the trained copy is off, the adapter's factors stay.
    for engine in (reserved, unreserved):
        engine.update_weights([("lm_head.weight", base.lm_head.weight.detach())])
    merged.update_weights(_merged_pairs(base, adapter))
    got = _assert_serves_alike(reserved, unreserved)
    want_on = merged.generate(_requests(), SAMPLED)  # the base's head, the adapter's factors
    for c, on, off in zip(got, want_on, want_off, strict=True):
        is_on = IS_ON[c.request_index]
        _assert_same(c, on if is_on else off, ATOL_F32 * is_on)
    # The next adapter turns the copy on again, in place.
    adapter, head = _adapter(base, 2), _head(base, 2)
    for engine in (reserved, unreserved):
        engine.update_weights([*_adapter_pairs(adapter), ("lm_head.weight.lora_saved", head)])
    _assert_serves_alike(reserved, unreserved)
    assert releases == []
    with pytest.raises(ValueError, match=r"lora_modules_to_save: 'no_such' names no Linear"):
        _engine(tiny_model_dir, "bs-rsave-bad", lora_modules_to_save=("no_such",))
    with pytest.raises(
        ValueError, match=r"lora_modules_to_save=\('lm_head',\) with lora_mode='merge'"
    ):
        EngineConfig(lora_mode="merge", lora_modules_to_save=("lm_head",))
    for engine in (reserved, unreserved, plain, merged):
        engine.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (graphs, compile)")
def test_cuda_a_reserved_module_to_save_keeps_the_graphs(tmp_path):
    """On a GPU, bf16, CUDA graphs and the compiled decode step: with the LM head's trained
    copy reserved (lora_modules_to_save), the graphs captured before any adapter serve an
    adapter with its head, and the head's full sync, with no recapture; adapter rows match a
    merged full sync's engine (bf16 tolerance), base rows a plain engine's."""
    from yatt.testing import make_tiny_causal_lm

    model_dir = tmp_path / "bf16"
    make_tiny_causal_lm(model_dir, arch="qwen2", seed=0, dtype=torch.bfloat16)
    base = _base(model_dir)
    kwargs = dict(dtype="bfloat16", device="cuda")
    reserved = _engine(
        model_dir, "rs-cuda", max_lora_rank=RANK, lora_modules_to_save=("lm_head",), **kwargs
    )
    merged = _engine(model_dir, "rs-cuda-m", mode="merge", **kwargs)
    plain = _engine(model_dir, "rs-cuda-p", **kwargs)
    want_base = plain.generate(_requests(), GREEDY)
    assert [c.response_ids for c in reserved.generate(_requests(), GREEDY)] == [
        c.response_ids for c in want_base
    ]
    releases = _spy_graph_releases(reserved)
    adapter, head = _adapter(base, 1), _head(base, 1)
    reserved.update_weights(
        (n, t.cuda()) for n, t in [*_adapter_pairs(adapter), ("lm_head.weight.lora_saved", head)]
    )
    full = dict(_merged_pairs(base, adapter))
    full["lm_head.weight"] = head
    merged.update_weights((n, t.cuda()) for n, t in full.items())
    got, want = reserved.generate(_requests(IS_ON), GREEDY), merged.generate(_requests(), GREEDY)
    for c, on, off in zip(got, want, want_base, strict=True):
        _assert_same(c, on if IS_ON[c.request_index] else off, 2e-2)
    reserved.update_weights([("lm_head.weight", base.lm_head.weight.detach().cuda())])
    assert releases == []
    for engine in (reserved, merged, plain):
        engine.close()
