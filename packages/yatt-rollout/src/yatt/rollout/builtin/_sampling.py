"""Token sampling on the device, with counter-based randomness and no host syncs.

Each sampled slot carries a 31-bit `key` derived from (seed, request_index, sample_index) (see
yatt/rollout/_keys.py) and a `counter` (tokens generated so far). The uniform number for a draw
is a hash of (key, counter), so a sample's tokens do not depend on which slot it ran in, which
other requests shared its batch, or how many steps ran between host checks; and the whole step
stays capturable in a CUDA graph (torch.Generator objects per row would not be).

Shapes: S = slots, V = vocabulary. All tensors live on the model's device.
"""

from __future__ import annotations

import math

import torch

from yatt.rollout._keys import GOLDEN, MASK31, mix31


def uniform_from_counter(key_S: torch.Tensor, counter_S: torch.Tensor) -> torch.Tensor:
    """One float32 uniform in (0, 1) per slot; the 23-bit grid plus 0.5 is exact in float32."""
    h_S = mix31((key_S ^ mix31((counter_S + GOLDEN) & MASK31)) & MASK31)
    return ((h_S >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def penalize_repeats(
    logits_SV: torch.Tensor, seen_SV: torch.Tensor, penalty_S: torch.Tensor
) -> torch.Tensor:
    """CTRL's repetition penalty (Keskar et al. 2019, sec. 4.1, in the form HF's
    RepetitionPenaltyLogitsProcessor and vLLM apply): the logit of a seen token is divided by
    the penalty when positive and multiplied by it otherwise, so a penalty > 1 always lowers it.
    seen_SV: bool, the tokens of the slot's prompt and response so far."""
    penalty_S1 = penalty_S[:, None]
    penalized_SV = torch.where(logits_SV > 0, logits_SV / penalty_S1, logits_SV * penalty_S1)
    return torch.where(seen_SV, penalized_SV, logits_SV)


def sample_tokens(
    logits_SV: torch.Tensor,
    *,
    temperature_S: torch.Tensor,
    top_p_S: torch.Tensor,
    top_k_S: torch.Tensor,
    key_S: torch.Tensor,
    counter_S: torch.Tensor,
    is_greedy: bool,
    is_truncated: bool,
    min_p_S: torch.Tensor | None = None,
    repetition_penalty_S: torch.Tensor | None = None,
    seen_SV: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled token ids [S] (int64) and their logprobs [S] (float32).

    The token is drawn from softmax(penalized logits / temperature) truncated by top-k, top-p
    and min-p, renormalised. Each truncation rule is applied to that whole tempered
    distribution and a token is kept when every rule keeps it: top-k keeps the k likeliest,
    top-p the smallest prefix (likeliest first) whose mass reaches p, min-p the tokens of
    probability >= min_p x the top token's (a ratio, so renormalising first changes nothing).
    The repetition penalty (penalize_repeats; seen_SV and repetition_penalty_S, both or
    neither) applies before the temperature, as in HF and vLLM; greedy takes the argmax of the
    penalized logits.

    The logprob is log softmax(logits / temperature) of the chosen token from the model's own
    logits: before the repetition penalty and before top-p/top-k/min-p truncation (unscaled
    logits when greedy). That is what a trainer recomputes from a forward pass
    (yatt.core.policy's token logprobs): the ratio of trainer to engine logprobs then measures
    the numerical mismatch only, and never sees these knobs (as with top-p/top-k since the
    start). `is_greedy` and `is_truncated` are Python flags, so each combination (and whether a
    penalty is given) is its own graph; min_p_S is read only when is_truncated.
    """
    logits_SV = logits_SV.float()
    if seen_SV is not None:
        assert repetition_penalty_S is not None, "seen_SV needs repetition_penalty_S"
        sampled_SV = penalize_repeats(logits_SV, seen_SV, repetition_penalty_S)
    else:
        sampled_SV = logits_SV
    if is_greedy:
        token_S = sampled_SV.argmax(dim=-1)
        logprob_SV = torch.log_softmax(logits_SV, dim=-1)
        return token_S, logprob_SV.gather(-1, token_S[:, None])[:, 0]
    logprob_SV = torch.log_softmax(logits_SV / temperature_S[:, None], dim=-1)
    if sampled_SV is logits_SV:
        probs_SV = logprob_SV.exp()
    else:
        probs_SV = torch.softmax(sampled_SV / temperature_S[:, None], dim=-1)
    u_S = uniform_from_counter(key_S, counter_S)
    if is_truncated:
        sorted_SV, order_SV = probs_SV.sort(dim=-1, descending=True)
        rank_V = torch.arange(sorted_SV.shape[-1], device=sorted_SV.device)
        # top-k 0 means off; top-p keeps the smallest prefix whose mass reaches p (at least one).
        k_S = torch.where(top_k_S > 0, top_k_S, sorted_SV.shape[-1])
        mass_before_SV = sorted_SV.cumsum(dim=-1) - sorted_SV
        keep_SV = (rank_V[None, :] < k_S[:, None]) & (mass_before_SV < top_p_S[:, None])
        if min_p_S is not None:
            # min-p 0 keeps every token (p >= 0); the top token is always kept (p_max >= min_p
            # x p_max for min_p <= 1).
            keep_SV &= sorted_SV >= min_p_S[:, None] * sorted_SV[:, :1]
        kept_SV = torch.where(keep_SV, sorted_SV, 0.0)
        cdf_SV = kept_SV.cumsum(dim=-1)
        pick_S = torch.searchsorted(cdf_SV, (u_S * cdf_SV[:, -1])[:, None])[:, 0]
        pick_S = pick_S.clamp(max=sorted_SV.shape[-1] - 1)
        token_S = order_SV.gather(-1, pick_S[:, None])[:, 0]
    else:
        # Inverse CDF in vocabulary order: no sort needed when nothing is truncated.
        token_S = inverse_cdf(probs_SV, u_S)
    return token_S, logprob_SV.gather(-1, token_S[:, None])[:, 0]


def seen_tokens(history_SL: torch.Tensor, length_S: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[S, V] bool: the tokens in history_SL[s, :length_S[s]] (a slot's prompt and response
    so far), built by one scatter; columns past a slot's length go to a spare column V that is
    dropped (a fixed shape, so it stays capturable in a CUDA graph)."""
    S, L = history_SL.shape
    is_valid_SL = torch.arange(L, device=history_SL.device)[None, :] < length_S[:, None]
    is_valid_SL &= history_SL < vocab_size  # an id past the LM head's width has no logit
    column_SL = torch.where(is_valid_SL, history_SL, vocab_size)
    seen_SV = torch.zeros(S, vocab_size + 1, dtype=torch.bool, device=history_SL.device)
    seen_SV.scatter_(1, column_SL, True)
    return seen_SV[:, :vocab_size]


def _block_size(vocab_size: int) -> int | None:
    """Largest divisor of V up to sqrt(V), if it is big enough to be worth two levels."""
    for size in range(math.isqrt(vocab_size), 15, -1):
        if vocab_size % size == 0:
            return size
    return None


def inverse_cdf(probs_SV: torch.Tensor, u_S: torch.Tensor) -> torch.Tensor:
    """First token (vocabulary order) whose cumulative probability reaches u * total, per row.

    Two levels (C-token blocks: block masses, then one block's tokens) instead of a cumulative
    sum over the whole vocabulary: a scan over [S, V] is one slow kernel (0.3 ms of a 5 ms
    decode step at S=256, V=152k on an H200); a block reduction and two short scans are not.
    Tokens of probability 0 are never returned.
    """
    S, V = probs_SV.shape
    C = _block_size(V)
    if C is None:
        cdf_SV = probs_SV.cumsum(dim=-1)
        token_S = torch.searchsorted(cdf_SV, (u_S * cdf_SV[:, -1])[:, None])[:, 0]
        return token_S.clamp(max=V - 1)
    blocks_SBC = probs_SV.view(S, V // C, C)
    mass_SB = blocks_SBC.sum(dim=-1)
    cdf_SB = mass_SB.cumsum(dim=-1)
    target_S = u_S * cdf_SB[:, -1]
    # The first block whose cumulative mass reaches the target has mass > 0 (target > 0).
    block_S = torch.searchsorted(cdf_SB, target_S[:, None])[:, 0].clamp(max=V // C - 1)
    before_S = (cdf_SB - mass_SB).gather(-1, block_S[:, None])[:, 0]
    inner_SC = blocks_SBC.gather(1, block_S[:, None, None].expand(S, 1, C))[:, 0]
    inner_cdf_SC = inner_SC.cumsum(dim=-1)
    # Rounding may put the target a hair outside the block's own sums: clamping into
    # (0, block total] keeps the pick on a token of the block with probability > 0.
    rest_S = (target_S - before_S).clamp(min=torch.finfo(inner_cdf_SC.dtype).tiny)
    rest_S = torch.minimum(rest_S, inner_cdf_SC[:, -1])
    offset_S = torch.searchsorted(inner_cdf_SC, rest_S[:, None])[:, 0].clamp(max=C - 1)
    return block_S * C + offset_S
