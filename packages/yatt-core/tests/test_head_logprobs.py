"""Logprobs computed inside the LM head, chunk by chunk: the same numbers and gradients as the
full logits, without keeping [tokens, vocab] float32 logits for the backward."""

import functools

import pytest
import torch
from torch._dynamo.utils import counters

import yatt.core.policy._head_logprobs as head_module
from yatt.core import compute_entropy, compute_token_logprobs
from yatt.core.policy._head_logprobs import head_logprobs, logprobs_in_head, supports_head_logprobs
from yatt.testing import make_tiny_causal_lm

NUM_GPUS = 0


def _ids(model, batch=3, length=11, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (batch, length), generator=gen)


def _plain(model, ids, temperature):
    logits = model(input_ids=ids).logits
    return (
        compute_token_logprobs(logits, ids, temperature=temperature),
        compute_entropy(logits, temperature=temperature),
    )


def _in_head(model, ids, temperature, chunk_tokens):
    with logprobs_in_head(
        model, ids, temperature=temperature, needs_entropy=True, chunk_tokens=chunk_tokens
    ):
        out = model(input_ids=ids).logits
    return out[..., 0], out[..., 1]


def _grads(model, logprobs, entropy):
    weights = torch.linspace(-1, 1, logprobs.numel()).view_as(logprobs)
    model.zero_grad(set_to_none=True)
    ((logprobs * weights).sum() + 0.3 * entropy.sum()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    ("arch", "tied"), [("llama", False), ("qwen2", True), ("qwen3", False), ("qwen3", True)]
)
@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_head_logprobs_match_the_logits_and_their_gradients(arch, tied, temperature):
    model = make_tiny_causal_lm(arch=arch, tie_word_embeddings=tied)
    model.train()
    ids = _ids(model)
    expected = _plain(model, ids, temperature)
    expected_grads = _grads(model, *expected)
    # 5 positions per chunk: 30 predicted positions make 6 chunks, the last one short.
    got = _in_head(model, ids, temperature, chunk_tokens=7)
    torch.testing.assert_close(got[0], expected[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(got[1], expected[1], atol=1e-5, rtol=0)
    assert (got[0][:, 0] == 0).all() and (got[1][:, 0] == 0).all()
    got_grads = _grads(model, *got)
    assert got_grads.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def _largest_saved(fn) -> int:
    """The most elements of any one tensor autograd keeps for the backward of fn()."""
    sizes = []

    def pack(tensor):
        sizes.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    return max(sizes)


def test_backward_keeps_no_full_vocabulary_logits():
    model = make_tiny_causal_lm(arch="qwen2")
    model.train()
    ids = _ids(model, batch=4, length=33)
    full = ids.shape[0] * (ids.shape[1] - 1) * model.config.vocab_size
    # The measure sees the plain path's [B, T, V] logits (so it can fail) ...
    assert _largest_saved(lambda: _plain(model, ids, 1.0)) >= full
    # ... and the head path keeps at most hidden states and weights (the vocab x hidden head).
    kept = _largest_saved(lambda: _in_head(model, ids, 1.0, chunk_tokens=16))
    head = model.config.vocab_size * model.config.hidden_size
    assert kept <= head < full


def test_the_head_is_restored_after_the_call_and_after_an_error():
    model = make_tiny_causal_lm(arch="llama")
    ids = _ids(model)
    head = model.get_output_embeddings()
    in_head = logprobs_in_head(model, ids, temperature=1.0, needs_entropy=False)
    with pytest.raises(RuntimeError, match="boom"), in_head:
        assert model(input_ids=ids).logits.shape == (*ids.shape, 1)
        raise RuntimeError("boom")
    assert "forward" not in vars(head)
    assert model(input_ids=ids).logits.shape == (*ids.shape, model.config.vocab_size)


def test_unsupported_models_keep_the_plain_path():
    model = make_tiny_causal_lm(arch="llama")
    assert supports_head_logprobs(model)
    # Soft-capped logits (Gemma 2 style) are post-processed after the head.
    model.config.final_logit_softcapping = 30.0
    assert not supports_head_logprobs(model)
    model.config.final_logit_softcapping = None
    model.config.model_type = "granite"  # divides the logits after the head
    assert not supports_head_logprobs(model)
    in_head = logprobs_in_head(model, _ids(model), temperature=1.0, needs_entropy=False)
    with pytest.raises(ValueError, match="compute_token_logprobs"), in_head:
        pass


def test_a_one_token_row_still_reaches_the_head_weight():
    # Dummy micro-batches (one token, zero loss) keep a rank in DDP's and FSDP2's collectives:
    # their backward must still give every parameter a (zero) gradient.
    model = make_tiny_causal_lm(arch="qwen2")
    model.train()
    ids = _ids(model, batch=1, length=1)
    logprobs, entropy = _in_head(model, ids, 1.0, chunk_tokens=4)
    assert logprobs.shape == entropy.shape == (1, 1) and logprobs.item() == 0.0
    grads = _grads(model, logprobs, entropy)
    head = model.get_output_embeddings()
    assert head.weight.grad is not None and (head.weight.grad == 0).all()
    assert len(grads) == len(list(model.parameters()))


@pytest.fixture
def fresh_compile():
    # Graphs of earlier tests count toward dynamo's recompile limit, past which it runs the
    # function eagerly (a warning): each test starts from an empty cache.
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _head_outputs(head, hidden_BTH, ids, weights, **kwargs):
    """Head logprobs (and entropy) and the gradients of a weighted sum of them."""
    hidden_BTH = hidden_BTH.clone().requires_grad_()
    head.zero_grad(set_to_none=True)
    out = head_logprobs(head, hidden_BTH, ids, chunk_tokens=7, **kwargs)
    (out * weights[..., : out.shape[-1]]).sum().backward()
    with torch.no_grad():  # the logprobs pass: no checkpoint, no backward graph
        inference = head_logprobs(head, hidden_BTH, ids, chunk_tokens=7, **kwargs)
    return out, inference, hidden_BTH.grad, head.weight.grad, head.bias.grad


@pytest.mark.parametrize("needs_entropy", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_compiled_chunks_give_the_eager_numbers_and_gradients(
    fresh_compile, temperature, needs_entropy
):
    gen = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, 50)
    with torch.no_grad():
        head.weight.copy_(0.3 * torch.randn(50, 16, generator=gen))
    hidden_BTH = torch.randn(3, 11, 16, generator=gen)
    ids = torch.randint(0, 50, (3, 11), generator=gen)
    weights = torch.linspace(-1, 1, 3 * 11 * 2).view(3, 11, 2)
    kwargs = dict(temperature=temperature, needs_entropy=needs_entropy)
    # 7 positions per chunk: 30 predicted positions make 5 chunks, the last one short.
    eager = _head_outputs(head, hidden_BTH, ids, weights, **kwargs)
    assert counters["stats"]["unique_graphs"] == 0
    compiled = _head_outputs(head, hidden_BTH, ids, weights, should_compile=True, **kwargs)
    # It did compile, in one graph (a graph break would run part of it eagerly).
    assert counters["stats"]["unique_graphs"] > 0 and not counters["graph_break"]
    names = ("logprobs", "no-grad logprobs", "hidden grad", "weight grad", "bias grad")
    for name, got, expected in zip(names, compiled, eager, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0, msg=name)


def test_compiled_chunks_run_while_another_thread_compiles(fresh_compile, monkeypatch):
    """torch's FX-tracing flag is process-wide: up while any thread compiles (an engine's first
    call beside the trainer). A compiled chunk called meanwhile, from another thread, gives the
    eager numbers instead of raising."""
    from concurrent.futures import ThreadPoolExecutor

    import torch.fx._symbolic_trace as symbolic_trace

    gen = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, 50)
    hidden_BTH = torch.randn(2, 9, 16, generator=gen)
    ids = torch.randint(0, 50, (2, 9), generator=gen)
    weights = torch.linspace(-1, 1, 2 * 9 * 2).view(2, 9, 2)
    kwargs = dict(temperature=1.0, needs_entropy=True)
    eager = _head_outputs(head, hidden_BTH, ids, weights, **kwargs)
    monkeypatch.setattr(symbolic_trace, "_is_fx_tracing_flag", True)  # the other thread's trace
    with ThreadPoolExecutor(1) as pool:  # a fresh thread: dynamo's default settings
        compiled = pool.submit(
            _head_outputs, head, hidden_BTH, ids, weights, should_compile=True, **kwargs
        ).result()
    names = ("logprobs", "no-grad logprobs", "hidden grad", "weight grad", "bias grad")
    for name, got, expected in zip(names, compiled, eager, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0, msg=name)


def test_compile_failures_name_the_config_field(fresh_compile, monkeypatch):
    def failing_backend(graph, example_inputs):
        raise RuntimeError("no C++ compiler")

    ids = torch.zeros(1, 3, dtype=torch.int64)
    call = functools.partial(
        head_logprobs, torch.nn.Linear(4, 5), torch.zeros(1, 3, 4), ids, temperature=1.0,
        needs_entropy=False, should_compile=True,
    )  # fmt: skip
    # Compiling fails at the first call ...
    monkeypatch.setattr(head_module, "_compiled_chunk_logprobs", None)
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=failing_backend))
    with pytest.raises(RuntimeError, match=r"(?s)compile_head_logprobs=True.*no C\+\+ compiler"):
        call()
    # ... or there is no torch.compile.
    monkeypatch.setattr(head_module, "_compiled_chunk_logprobs", None)
    monkeypatch.delattr(torch, "compile")
    with pytest.raises(RuntimeError, match="compile_head_logprobs=False for the eager path"):
        call()
