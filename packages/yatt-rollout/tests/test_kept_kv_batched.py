"""Kept-KV continuations (Request.session_id) run batched: every waiting continuation enters
in as few forwards as max_prefill_tokens allows, and each layer attends all of a forward's
rows in one call (a per-row loop left a kept turn host-bound on a GPU, 3x a prefill's time per
token: bench/results/multiturn_kv_nvidia_h200.md). The batched attention is checked against
attention written out by hand, and whole conversations against a fresh prefill of them."""

NUM_GPUS = 0

import pytest
import torch

from yatt.rollout import BuiltinEngine, EngineConfig, Request, SamplingParams
from yatt.rollout.builtin import _static_kv
from yatt.rollout.builtin._static_kv import ContinueWrite, StaticKVCache

# Appended between turns, a different length per conversation (so continuation rows pad).
OBSERVATIONS = {"a": [20, 21, 22], "b": [23], "c": [24, 25, 26, 27, 28, 29], "d": [30, 31]}
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)


def _reference_attention(query, keys_by_row, values_by_row, starts, scale):
    """Row b's query t (cache position starts[b] + t) over its keys at positions
    <= starts[b] + t; query head h reads KV head h // (H_q / H_kv). float64, by hand."""
    outs = []
    for q_HTD, k_HPD, v_HPD, start in zip(query, keys_by_row, values_by_row, starts, strict=True):
        group = q_HTD.shape[0] // k_HPD.shape[0]
        k_HPD = k_HPD.double().repeat_interleave(group, dim=0)
        v_HPD = v_HPD.double().repeat_interleave(group, dim=0)
        scores = q_HTD.double() @ k_HPD.transpose(1, 2) * scale  # [H_q, n, P]
        n, P = scores.shape[1:]
        at = {"device": scores.device}  # the mask beside the scores (CUDA in the GPU case)
        visible = torch.arange(P, **at)[None, :] <= start + torch.arange(n, **at)[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        outs.append(torch.softmax(scores, dim=-1) @ v_HPD)  # [H_q, n, D]
    return outs


def _check_continue_write(device, dtype, kernel, atol):
    torch.manual_seed(0)
    S, H_kv, H_q, L, D = 4, 2, 4, 32, 16
    cache = StaticKVCache(
        num_layers=1,
        num_slots=S,
        num_kv_heads=H_kv,
        max_seq_len=L,
        head_dim=D,
        dtype=dtype,
        device=torch.device(device),
    )
    for buffer in (cache.keys[0], cache.values[0]):
        buffer.copy_(torch.randn_like(buffer))
    before_keys = cache.keys[0].clone()
    slots, starts, lengths = [2, 0, 3], [5, 9, 1], [4, 1, 6]
    B, T = len(slots), max(lengths)
    query = torch.randn(B, H_q, T, D, device=device, dtype=dtype)
    key = torch.randn(B, H_kv, T, D, device=device, dtype=dtype)
    value = torch.randn(B, H_kv, T, D, device=device, dtype=dtype)
    span = max(s + n for s, n in zip(starts, lengths, strict=True))
    write = ContinueWrite(
        cache=cache, slots=slots, starts=starts, lengths=lengths, span=span, kernel=kernel
    )
    caches = (cache.keys[0], cache.values[0])  # layer 0's
    out = write.write_and_attend(caches, query, key, value, None, 0.3)  # [B, T, H_q, D]
    assert out.shape == (B, T, H_q, D)
    # The cache: each row's new keys at its positions in its slot; everything else untouched.
    expected_keys = before_keys.clone()
    for b, (slot, start, n) in enumerate(zip(slots, starts, lengths, strict=True)):
        expected_keys[slot, :, start : start + n] = key[b, :, T - n :]
    torch.testing.assert_close(cache.keys[0], expected_keys, atol=0, rtol=0)
    keys_by_row = [
        torch.cat([before_keys[slot, :, :start], key[b, :, T - n :]], dim=1)
        for b, (slot, start, n) in enumerate(zip(slots, starts, lengths, strict=True))
    ]
    values_by_row = [
        cache.values[0][slot, :, : start + n]
        for slot, start, n in zip(slots, starts, lengths, strict=True)
    ]
    queries = [query[b, :, T - n :] for b, n in enumerate(lengths)]
    expected = _reference_attention(queries, keys_by_row, values_by_row, starts, 0.3)
    for b, n in enumerate(lengths):  # padding columns are never read
        got = out[b, T - n :].transpose(0, 1).double()  # [H_q, n, D]
        torch.testing.assert_close(got, expected[b], atol=atol, rtol=0)


def test_dense_continuation_attention_matches_attention_by_hand():
    _check_continue_write("cpu", torch.float32, "dense", atol=1e-5)


def test_dense_continuation_attention_split_into_groups_is_the_same(monkeypatch):
    # A budget of one row's scores: one SDPA call per row, the same numbers.
    monkeypatch.setattr(_static_kv, "DENSE_SCORES_BUDGET", 1)
    _check_continue_write("cpu", torch.float32, "dense", atol=1e-5)


def test_varlen_packing_matches_attention_by_hand_where_flash_is_missing(monkeypatch, caplog):
    # On CPU the packed-sequence flash kernel is missing: the varlen path logs it once and
    # attends per sequence over the same packed queries/keys, which checks the packing (rows
    # of the cache gathered per row, cumulative lengths, the output scattered back).
    monkeypatch.setattr(_static_kv, "_VARLEN_BROKEN", [])
    with caplog.at_level("WARNING"):
        _check_continue_write("cpu", torch.float32, "varlen", atol=1e-5)
    assert "packed sequences failed" in caplog.text
    assert _static_kv._VARLEN_BROKEN


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (flash attention, varlen)")
@pytest.mark.parametrize("kernel", ["varlen", "dense"])
def test_continuation_attention_on_cuda_matches_attention_by_hand(kernel, monkeypatch):
    # bf16 inputs, float32 accumulation: a few bf16 ulps of outputs of magnitude <= ~3. The
    # flash kernel itself ran (no per-sequence fallback), and an engine would pick it.
    monkeypatch.setattr(_static_kv, "_VARLEN_BROKEN", [])
    _check_continue_write("cuda", torch.bfloat16, kernel, atol=3e-2)
    assert _static_kv._VARLEN_BROKEN == []
    cache = StaticKVCache(
        num_layers=1, num_slots=1, num_kv_heads=2, max_seq_len=8, head_dim=64,
        dtype=torch.bfloat16, device=torch.device("cuda"),
    )  # fmt: skip
    assert _static_kv._can_use_varlen(cache)


def _engine(model_dir, prefix, **config):
    engine = BuiltinEngine(
        model_dir,
        config=EngineConfig(
            **{"max_batch_size": 4, "max_seq_len": 256, "region_prefix": prefix, **config}
        ),
    )
    runner = engine._runner
    # Per continuation forward: its rows and its padded tokens.
    forwards: list[dict[str, int]] = []
    original = runner.prefill_continuations

    def counting(items, slots, starts, flags):
        new = [len(it.request.prompt_ids) - s for it, s in zip(items, starts, strict=True)]
        forwards.append({"rows": len(items), "padded_tokens": len(items) * max(new)})
        return original(items, slots, starts, flags)

    runner.prefill_continuations = counting
    return engine, forwards


def _conversations(engine, sampling, *, should_keep, num_turns=3, names="abcd"):
    seqs = {name: [5 + i, 6, 7 + i] for i, name in enumerate(names)}
    out = []
    for _ in range(num_turns):
        requests = [
            Request(prompt_ids=list(seq), session_id=name if should_keep else None)
            for name, seq in seqs.items()
        ]
        for name, completion in zip(seqs, engine.generate(requests, sampling), strict=True):
            out.append(completion)
            seqs[name] = seqs[name] + completion.response_ids + OBSERVATIONS[name]
    return out


def _assert_same_samples(got, expected):
    assert [c.response_ids for c in got] == [c.response_ids for c in expected]
    torch.testing.assert_close(
        torch.tensor([c.logprobs for c in got]),
        torch.tensor([c.logprobs for c in expected]),
        atol=1e-4,  # float32 sums in another order (cached prefix vs one prefill)
        rtol=0,
    )


# compile_scope="layers": every forward (prefill, continuation, decode) through decoder layers
# compiled once; the caches reach each layer bound to its attention module.
COMPILED_LAYERS = {"compile_prefill": True, "compile_decode": True, "compile_scope": "layers"}


@pytest.mark.parametrize("kept_config", [{}, COMPILED_LAYERS], ids=["eager", "compiled-layers"])
def test_waiting_continuations_share_one_forward_and_sample_what_a_fresh_prefill_does(
    tiny_model_dir, kept_config
):
    fresh_engine, _ = _engine(tiny_model_dir, "batched-fresh")
    kept_engine, forwards = _engine(tiny_model_dir, "batched-kept", **kept_config)
    try:
        expected = _conversations(fresh_engine, GREEDY, should_keep=False)
        got = _conversations(kept_engine, GREEDY, should_keep=True)
    finally:
        fresh_engine.close()
        kept_engine.close()
    # Turns 2 and 3: the four conversations (2 to 7 new tokens each, left-padded to the
    # longest) in one forward per turn, not one per conversation.
    assert [f["rows"] for f in forwards] == [4, 4]
    _assert_same_samples(got, expected)


def test_continuation_forward_calls_attention_once_per_layer(tiny_model_dir, monkeypatch):
    engine, forwards = _engine(tiny_model_dir, "batched-calls")
    num_layers = engine.model.config.num_hidden_layers
    runner = engine._runner
    original = runner.prefill_continuations
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    state = {"inside": False}

    def inside(*args):
        state["inside"] = True
        try:
            return original(*args)
        finally:
            state["inside"] = False

    def counting_sdpa(*args, **kwargs):
        if state["inside"]:
            calls.append(args[0].shape[0])  # the rows of the query batch
        return sdpa(*args, **kwargs)

    runner.prefill_continuations = inside
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting_sdpa)
    try:
        _conversations(engine, GREEDY, should_keep=True, num_turns=2)
    finally:
        engine.close()
    assert [f["rows"] for f in forwards] == [4]
    assert calls == [4] * num_layers


def test_continuations_are_chunked_by_max_prefill_tokens(tiny_model_dir):
    # max_prefill_tokens 64: rows of 21 new tokens go 3 to a forward (3 x 21 = 63), then 1.
    names = "abcd"
    sampling = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    config = {"max_seq_len": 64, "max_prefill_tokens": 64}
    fresh_engine, _ = _engine(tiny_model_dir, "chunk-fresh", **config)
    kept_engine, forwards = _engine(tiny_model_dir, "chunk-kept", **config)
    observation = list(range(40, 60))  # 20 tokens; + the last sampled token: 21 new

    def run(engine, should_keep):
        seqs = {name: [5 + i, 6] for i, name in enumerate(names)}
        out = []
        for _ in range(2):
            requests = [
                Request(prompt_ids=seq, session_id=name if should_keep else None)
                for name, seq in seqs.items()
            ]
            completions = engine.generate(requests, sampling)
            out += completions
            seqs = {
                n: seqs[n] + c.response_ids + observation
                for n, c in zip(names, completions, strict=True)
            }
        return out

    try:
        expected = run(fresh_engine, False)
        got = run(kept_engine, True)
    finally:
        fresh_engine.close()
        kept_engine.close()
    assert [f["rows"] for f in forwards] == [3, 1]
    assert all(f["padded_tokens"] <= 64 for f in forwards)
    _assert_same_samples(got, expected)


def test_compiled_continuations_sample_what_eager_fresh_prefills_do(tiny_model_dir, caplog):
    # compile_prefill compiles the continuation forward too (dynamic shapes, the write and
    # attention one opaque op); a compile failure would fall back to eager with a warning.
    fresh_engine, _ = _engine(tiny_model_dir, "compiled-fresh")
    kept_engine, forwards = _engine(tiny_model_dir, "compiled-kept", compile_prefill=True)
    try:
        expected = _conversations(fresh_engine, GREEDY, should_keep=False)
        with caplog.at_level("WARNING"):
            got = _conversations(kept_engine, GREEDY, should_keep=True)
        assert kept_engine._runner._compiled_continue is not None
    finally:
        fresh_engine.close()
        kept_engine.close()
    assert "kept-KV continuation" not in caplog.text
    assert [f["rows"] for f in forwards] == [4, 4]
    _assert_same_samples(got, expected)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (device synchronisations)")
@pytest.mark.parametrize(
    "kept_config", [{"compile_prefill": True}, COMPILED_LAYERS], ids=["step", "layers"]
)
def test_continuations_never_wait_for_the_gpu(tmp_path, kept_config, recording_device_syncs):
    # A kept turn's continuation cost 1.5-2x a prefill's time per new token on an H200 under
    # compile_scope="layers" (bench/results/multiturn_kv_nvidia_h200_clayers.md): a host sync
    # inside it would leave the GPU idle while the host builds each chunk's next forward.
    # Turns 2 and 3 of a second round (the first compiles and captures), bf16 (the varlen
    # flash kernel); every synchronising call inside a continuation is recorded.
    from yatt.testing import make_tiny_causal_lm

    model_dir = tmp_path / "model"
    make_tiny_causal_lm(model_dir, arch="qwen2", seed=0)
    engine, forwards = _engine(
        model_dir,
        f"nosync-kept-{'layers' if 'compile_scope' in kept_config else 'step'}",
        device="cuda",
        dtype="bfloat16",
        **kept_config,
    )
    runner, syncs = engine._runner, []
    counted = runner.prefill_continuations  # _engine's counting wrapper
    try:
        _conversations(engine, GREEDY, should_keep=True)  # compiles and captures may sync
        engine.release_sessions(list("abcd"))
        forwards.clear()
        runner.prefill_continuations = recording_device_syncs(counted, syncs)
        _conversations(engine, GREEDY, should_keep=True)
    finally:
        engine.close()
    assert len(forwards) == 2, "turns 2 and 3 continue the kept conversations"
    assert not syncs, f"a continuation synchronised with the GPU {len(syncs)} times:\n" + "\n".join(
        sorted(set(syncs))
    )
