NUM_GPUS = 0

import pytest
import torch

from yatt.rollout._keys import derive_key
from yatt.rollout.builtin import sample_tokens
from yatt.rollout.builtin._sampling import (
    _block_size,
    inverse_cdf,
    penalize_repeats,
    seen_tokens,
    uniform_from_counter,
)


def _sample(
    logits_V,
    num_draws,
    *,
    temperature=1.0,
    top_p=1.0,
    top_k=0,
    min_p=0.0,
    greedy=False,
    penalty=1.0,
    seen=(),
):
    logits_SV = logits_V.expand(num_draws, -1)
    S = num_draws
    truncated = top_p < 1.0 or top_k > 0 or min_p > 0
    seen_SV = None
    if penalty != 1.0:
        seen_V = torch.zeros(logits_V.shape[-1], dtype=torch.bool)
        seen_V[list(seen)] = True
        seen_SV = seen_V.expand(S, -1)
    return sample_tokens(
        logits_SV,
        temperature_S=torch.full((S,), temperature),
        top_p_S=torch.full((S,), top_p),
        top_k_S=torch.full((S,), top_k),
        key_S=torch.tensor([derive_key(0, i, 0) for i in range(S)]),
        counter_S=torch.zeros(S, dtype=torch.long),
        is_greedy=greedy,
        is_truncated=truncated,
        min_p_S=torch.full((S,), min_p),
        repetition_penalty_S=torch.full((S,), penalty),
        seen_SV=seen_SV,
    )


LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0], ids=["t1", "t0.5", "t2"])
def test_frequencies_follow_the_tempered_distribution(temperature):
    tokens, logprobs = _sample(LOGITS, 20000, temperature=temperature)
    expected = torch.softmax(LOGITS / temperature, -1)
    freq = torch.bincount(tokens, minlength=6).float() / len(tokens)
    # 20k draws: the standard error of each frequency is below 0.0036.
    torch.testing.assert_close(freq, expected, atol=0.015, rtol=0)
    torch.testing.assert_close(logprobs, torch.log(expected)[tokens])


def test_top_k_and_top_p_renormalise_over_the_kept_tokens():
    tokens, logprobs = _sample(LOGITS, 20000, top_k=2)
    probs = torch.softmax(LOGITS, -1)
    assert set(tokens.tolist()) == {0, 1}
    freq0 = (tokens == 0).float().mean()
    torch.testing.assert_close(freq0, probs[0] / probs[:2].sum(), atol=0.015, rtol=0)
    # Logprobs stay those of the untruncated distribution (what a trainer recomputes).
    torch.testing.assert_close(logprobs, torch.log(probs)[tokens])
    # top-p 0.8: mass before token 2 is 0.79 < 0.8, so tokens 0..2 are kept; token 3 is not.
    tokens, _ = _sample(LOGITS, 20000, top_p=0.8)
    assert set(tokens.tolist()) == {0, 1, 2}


# min-p keeps token i when p_i >= min_p * p_max, i.e. exp((l_i - l_max) / T) >= min_p. For
# LOGITS that ratio is exp(l_i - 2) = 1, .37, .22, .14, .05, .007 at T = 1 and
# exp((l_i - 2) / 2) = 1, .61, .47, .37, .22, .08 at T = 2.
@pytest.mark.parametrize(
    ("temperature", "min_p", "kept"),
    [(1.0, 0.2, [0, 1, 2]), (1.0, 0.5, [0]), (2.0, 0.3, [0, 1, 2, 3]), (2.0, 0.05, range(6))],
    ids=["t1-0.2", "t1-0.5", "t2-0.3", "t2-0.05"],
)
def test_min_p_keeps_tokens_within_the_ratio_of_the_top_one(temperature, min_p, kept):
    kept = list(kept)
    tokens, logprobs = _sample(LOGITS, 20000, temperature=temperature, min_p=min_p)
    assert set(tokens.tolist()) == set(kept)
    probs = torch.softmax(LOGITS / temperature, -1)
    freq = torch.bincount(tokens, minlength=6).float() / len(tokens)
    expected = torch.zeros(6)
    expected[kept] = probs[kept] / probs[kept].sum()  # renormalised over the kept tokens
    torch.testing.assert_close(freq, expected, atol=0.015, rtol=0)
    # Logprobs stay those of the untruncated tempered distribution, as with top-p/top-k.
    torch.testing.assert_close(logprobs, torch.log(probs)[tokens])


def test_min_p_intersects_with_top_k():
    # top_k=4 keeps 0..3; min_p=0.2 keeps 0..2: together 0..2.
    tokens, _ = _sample(LOGITS, 5000, top_k=4, min_p=0.2)
    assert set(tokens.tolist()) == {0, 1, 2}
    # top_k=2 and a min_p that keeps 0..2: together 0..1.
    tokens, _ = _sample(LOGITS, 5000, top_k=2, min_p=0.2)
    assert set(tokens.tolist()) == {0, 1}


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits_SV = torch.tensor([[2.0, -1.0, 0.5, 1.0, -0.5]])
    seen_SV = torch.tensor([[True, True, False, False, True]])
    got = penalize_repeats(logits_SV, seen_SV, torch.tensor([2.0]))
    # By hand: 2 / 2, -1 * 2, unseen, unseen, -0.5 * 2.
    torch.testing.assert_close(got, torch.tensor([[1.0, -2.0, 0.5, 1.0, -1.0]]))
    # A penalty below 1 rewards repeats: 2 / 0.5 and -1 * 0.5.
    got = penalize_repeats(logits_SV, seen_SV, torch.tensor([0.5]))
    torch.testing.assert_close(got, torch.tensor([[4.0, -0.5, 0.5, 1.0, -0.25]]))


@pytest.mark.parametrize("temperature", [1.0, 0.5], ids=["t1", "t0.5"])
def test_repetition_penalty_samples_from_the_penalized_distribution(temperature):
    # Tokens 0 (logit 2) and 4 (logit -1) seen, penalty 1.5: logits 2/1.5 and -1*1.5.
    penalized = torch.tensor([2.0 / 1.5, 1.0, 0.5, 0.0, -1.5, -3.0])
    tokens, logprobs = _sample(LOGITS, 20000, temperature=temperature, penalty=1.5, seen=[0, 4])
    freq = torch.bincount(tokens, minlength=6).float() / len(tokens)
    expected = torch.softmax(penalized / temperature, -1)
    torch.testing.assert_close(freq, expected, atol=0.015, rtol=0)
    # The logprob is the model's own (before the penalty): what the trainer recomputes.
    torch.testing.assert_close(logprobs, torch.log_softmax(LOGITS / temperature, -1)[tokens])


def test_greedy_takes_the_argmax_after_the_penalty():
    # LOGITS' argmax is token 0 (2.0); seen and penalized by 2 it is 1.0, tied with token 1:
    # a penalty of 2.5 leaves 0.8, so token 1 (1.0) wins.
    tokens, logprobs = _sample(LOGITS, 3, greedy=True, penalty=2.5, seen=[0])
    assert tokens.tolist() == [1, 1, 1]
    torch.testing.assert_close(logprobs, torch.log_softmax(LOGITS, -1)[1].expand(3))


def test_seen_tokens_are_the_history_up_to_each_length():
    history_SL = torch.tensor([[3, 1, 3, 0, 2], [4, 4, 0, 0, 0], [0, 2, 9, 1, 1]])
    length_S = torch.tensor([3, 2, 3])
    seen_SV = seen_tokens(history_SL, length_S, vocab_size=5)
    # Row 0: 3, 1, 3 (the 0 at position 3 is past its length); row 1: 4; row 2: 0, 2 (9 is
    # past the vocabulary: no logit to penalize).
    expected = torch.tensor(
        [[False, True, False, True, False], [False] * 4 + [True], [True, False, True, False, False]]
    )
    assert torch.equal(seen_SV, expected)


def test_greedy_takes_the_argmax_with_unscaled_logprob():
    tokens, logprobs = _sample(LOGITS.flip(0), 3, greedy=True)
    assert tokens.tolist() == [5, 5, 5]
    torch.testing.assert_close(logprobs, torch.log_softmax(LOGITS, -1)[0].expand(3))


def test_uniforms_are_in_the_open_interval_and_spread():
    keys = torch.tensor([derive_key(s, r, 0) for s in range(4) for r in range(250)])
    u = torch.cat([uniform_from_counter(keys, torch.full_like(keys, c)) for c in range(20)])
    assert u.min() > 0.0 and u.max() < 1.0
    hist = torch.histc(u, bins=10, min=0.0, max=1.0) / len(u)
    torch.testing.assert_close(hist, torch.full((10,), 0.1), atol=0.01, rtol=0)


def test_keys_differ_per_seed_request_and_sample():
    keys = {derive_key(seed, r, s) for seed in (0, 1, 2**40) for r in range(50) for s in range(4)}
    assert len(keys) == 3 * 50 * 4


def _flat_inverse_cdf(probs_SV, u_S):
    cdf_SV = probs_SV.cumsum(dim=-1)
    return torch.searchsorted(cdf_SV, (u_S * cdf_SV[:, -1])[:, None])[:, 0]


@pytest.mark.parametrize("vocab_size", [1000, 151936, 1009], ids=["blocks-25", "qwen", "prime"])
def test_two_level_inverse_cdf_picks_the_flat_cdf_token(vocab_size):
    g = torch.Generator().manual_seed(vocab_size)
    probs_SV = torch.softmax(3 * torch.randn(64, vocab_size, generator=g), dim=-1)
    u_S = torch.rand(64, generator=g).clamp(1e-6, 1 - 1e-6)
    assert _block_size(vocab_size) == {1000: 25, 151936: 128, 1009: None}[vocab_size]
    # Same token as one cumulative sum over the whole vocabulary (float64: no rounding ties).
    expected = _flat_inverse_cdf(probs_SV.double(), u_S.double())
    assert inverse_cdf(probs_SV, u_S).tolist() == expected.tolist()


def test_two_level_inverse_cdf_never_picks_a_zero_probability_token():
    # Blocks of 25: only a few scattered tokens have mass, whole blocks have none, and draws
    # near 0 and 1 probe the rounding clamps.
    probs_V = torch.zeros(1000)
    allowed = [3, 24, 25, 499, 500, 975, 999]
    probs_V[allowed] = torch.tensor([0.3, 1e-30, 0.2, 0.1, 0.15, 0.05, 0.2])
    u_S = torch.cat([torch.linspace(1e-7, 1 - 1e-7, 4000), torch.tensor([1e-30, 1 - 2**-24])])
    tokens = inverse_cdf(probs_V.expand(len(u_S), -1), u_S)
    assert set(tokens.tolist()) <= set(allowed)
    assert set(tokens.tolist()) >= set(allowed) - {24}  # every real mass is reachable
