NUM_GPUS = 0

import pytest
import torch

from yatt.rollout._keys import derive_key
from yatt.rollout.builtin import sample_tokens
from yatt.rollout.builtin._sampling import _block_size, inverse_cdf, uniform_from_counter


def _sample(logits_V, num_draws, *, temperature=1.0, top_p=1.0, top_k=0, greedy=False):
    logits_SV = logits_V.expand(num_draws, -1)
    S = num_draws
    truncated = top_p < 1.0 or top_k > 0
    return sample_tokens(
        logits_SV,
        temperature_S=torch.full((S,), temperature),
        top_p_S=torch.full((S,), top_p),
        top_k_S=torch.full((S,), top_k),
        key_S=torch.tensor([derive_key(0, i, 0) for i in range(S)]),
        counter_S=torch.zeros(S, dtype=torch.long),
        is_greedy=greedy,
        is_truncated=truncated,
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
