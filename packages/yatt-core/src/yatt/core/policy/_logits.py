"""Token logprobs and entropy from a causal LM's logits, matching the rollout engine's definition.

Shape legend (suffixes on tensor names):
    B  sequences;  T  token positions (right-padded);  V  vocabulary
The logits at position t predict token t + 1. Outputs are aligned with `input_ids`:
`logprobs_BT[:, t]` is log p(input_ids[:, t] | input_ids[:, :t]); position 0 has no prediction
and holds 0 (it is a prompt token, never in the loss).

The rollout engines report log softmax(logits / temperature) of the sampled token, without
top-p/top-k truncation, and unscaled logits at temperature 0 (greedy); so do these functions.
"""

from __future__ import annotations

import torch


def _scale(logits_BTV: torch.Tensor, temperature: float) -> torch.Tensor:
    logits_BTV = logits_BTV.float()
    # Temperature 0 means greedy sampling; the engines then report unscaled logprobs.
    if temperature > 0 and temperature != 1.0:
        logits_BTV = logits_BTV / temperature
    return logits_BTV


def compute_token_logprobs(
    logits_BTV: torch.Tensor, input_ids_BT: torch.Tensor, *, temperature: float = 1.0
) -> torch.Tensor:
    """log softmax(logits / temperature) of each next input token, [B, T] float32, position 0 = 0."""
    if logits_BTV.shape[:2] != input_ids_BT.shape:
        raise ValueError(
            f"logits {tuple(logits_BTV.shape)} and input_ids {tuple(input_ids_BT.shape)} must "
            "agree on [B, T]"
        )
    pred_BTV = _scale(logits_BTV[:, :-1], temperature)
    # log_softmax(x)[y] = x[y] - logsumexp(x): gathering first avoids a second [B, T, V] tensor.
    picked_BT = pred_BTV.gather(-1, input_ids_BT[:, 1:, None]).squeeze(-1)
    logprobs_BT = picked_BT - torch.logsumexp(pred_BTV, dim=-1)
    return torch.nn.functional.pad(logprobs_BT, (1, 0), value=0.0)


def compute_entropy(logits_BTV: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of the next-token distribution, aligned like `compute_token_logprobs`, [B, T]."""
    pred_BTV = _scale(logits_BTV[:, :-1], temperature)
    log_p_BTV = torch.log_softmax(pred_BTV, dim=-1)
    entropy_BT = -(log_p_BTV.exp() * log_p_BTV).sum(-1)
    return torch.nn.functional.pad(entropy_BT, (1, 0), value=0.0)
