"""A random-weight policy whose responses have a long-tail length mix (bench/train/offpolicy_gpu.py).

Random weights almost never sample EOS (about 1 in the vocabulary's 151936), so every response
runs to the cap. This rewrites two residual channels of the policy's weights file so that, at
temperature 1, the trainer's own rollout samples lengths from a known mix:

    mode:   the first response token is "long" with probability LONG_SHARE, else "short"; a
            response keeps its mode (switching takes a logit gap of MODE_GAP against it)
    short:  EOS per token with probability p = ln 2 / (cap / SHORT_MEDIAN_DIVISOR): geometric
            lengths, median cap / 8, so cap * 2**-8 (0.4%) of them reach the cap
    long:   EOS held down by the same gap: they run to the cap

so over all responses (LengthMix.quantile): median 75 of a 512 cap, 10.4% at the cap, p90 at
the cap. The bench/step long-tail mix's 90% short / 10% long, made by the model itself.

How: channel 0 of every token's embedding is a constant `bias` (EOS: twice it), channel 1 is
+1 for "long" tokens (every LONG_SHARE-th id), -1 for "short" ones and EOS, 0 for the
tokenizer's own ids (the prompt's bytes: a neutral mode). No layer writes either channel (their
rows of o_proj and down_proj zeroed), so at the last layer they still hold the current token's
values; the final norm's weights on them scale what they add to every logit (tied embeddings:
the same rows). Channel 0 adds the same to every token except EOS (softmax ignores a shift):
EOS gets `eos_gain` more. Channel 1 adds `mode_gain` to tokens of the current mode and
subtracts it from the others. The residual's scale varies by position, so eos_gain is
calibrated by sampling (`calibrate`), not derived.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

LONG_SHARE = 0.1  # responses in the long mode
SHORT_MEDIAN_DIVISOR = 8  # short responses' median: cap / 8
MODE_GAP = 16.0  # logit gap keeping a response in its mode (switching: ~1e-6 per token)
BIAS_CHANNEL, MODE_CHANNEL = 0, 1


@dataclass(frozen=True)
class LengthMix:
    """The response-length distribution the shaped policy is built for, capped at `cap`."""

    cap: int
    long_share: float = LONG_SHARE

    def __post_init__(self) -> None:
        if self.cap < SHORT_MEDIAN_DIVISOR:
            raise ValueError(f"--max-new-tokens={self.cap}: the long-tail mix needs at least 8")

    @property
    def short_hazard(self) -> float:
        """EOS probability per token of a short response (median cap / 8)."""
        return math.log(2) / (self.cap / SHORT_MEDIAN_DIVISOR)

    def cdf(self, length: int) -> float:
        """P(response length <= length): lengths 1..cap (a response ending in EOS at token k
        has k tokens, EOS included); long responses all at the cap."""
        if length >= self.cap:
            return 1.0
        return (1 - self.long_share) * (1 - (1 - self.short_hazard) ** length)

    def quantile(self, q: float) -> int:
        """The smallest length whose cdf reaches q."""
        return next(n for n in range(1, self.cap + 1) if self.cdf(n) >= q)

    @property
    def fraction_at_cap(self) -> float:
        return 1 - self.cdf(self.cap - 1)

    def summary(self) -> dict[str, float]:
        return {
            "median": self.quantile(0.5),
            "p90": self.quantile(0.9),
            "max": self.cap,
            "at_cap": self.fraction_at_cap,
        }


# The final residual's scale the two channels are divided by, as it acts on the logits:
# measured on the Qwen2.5-0.5B shape (24 random layers, bf16 weights) by sampling 40 tokens
# after 64 addition prompts at temperature 1: eos_gain 16.6 gave a short-mode EOS rate of
# 0.0111 per token against 0.0108 asked (cap 512), 9.4% long first tokens against 10%, no mode
# switch in 2496 tokens. Another shape needs its own measurement.
EFFECTIVE_RMS = 16.6 / math.log(LengthMix(cap=512).short_hazard * (1 - LONG_SHARE) * 151936)


@dataclass(frozen=True)
class Shaping:
    """The weights' knobs: channel values and the final norm's gains on them."""

    bias: float = 1.0  # channel 0 of every embedding row (EOS: 2 * bias): exact in bf16
    eos_gain: float = 16.6  # final-norm weight on channel 0 (x bias^2): EOS's extra, x rms
    mode_gain: float = MODE_GAP / 2 * EFFECTIVE_RMS  # final-norm weight on channel 1

    @classmethod
    def for_mix(cls, mix: LengthMix, *, vocab_size: int) -> Shaping:
        """EOS's extra logit b with e^b / (short tokens) = the short hazard, times the
        residual's scale (EFFECTIVE_RMS, the 0.5B shape's)."""
        short_tokens = (1 - mix.long_share) * vocab_size
        return cls(eos_gain=EFFECTIVE_RMS * math.log(mix.short_hazard * short_tokens))


def shape_state(state: dict[str, torch.Tensor], *, eos_id: int, num_tokenizer_ids: int,
                shaping: Shaping) -> dict[str, torch.Tensor]:  # fmt: skip
    """The policy's tensors with the two channels written (see the module docstring)."""
    state = dict(state)
    embed = state["model.embed_tokens.weight"].clone()
    if "lm_head.weight" in state:
        raise ValueError("lm_head.weight: the shaping needs tied embeddings (one row per token)")
    vocab = embed.shape[0]
    ids = torch.arange(vocab)
    is_long = ids % round(1 / LONG_SHARE) == 0
    mode = torch.where(is_long, 1.0, -1.0)
    mode[:num_tokenizer_ids] = 0.0  # the prompt's tokens: no mode yet
    mode[eos_id] = -1.0  # EOS is a short-mode token: held down in the long mode
    embed[:, BIAS_CHANNEL] = shaping.bias
    embed[eos_id, BIAS_CHANNEL] = 2 * shaping.bias
    embed[:, MODE_CHANNEL] = mode.to(embed.dtype)
    state["model.embed_tokens.weight"] = embed
    norm = state["model.norm.weight"].clone()
    # logit(t) += gain * x_c * embed[t, c] / rms; x_0 = bias, so EOS's extra is eos_gain * bias^2
    norm[BIAS_CHANNEL] = shaping.eos_gain / shaping.bias**2
    norm[MODE_CHANNEL] = shaping.mode_gain
    state["model.norm.weight"] = norm
    for name, tensor in state.items():
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            tensor = tensor.clone()
            tensor[[BIAS_CHANNEL, MODE_CHANNEL]] = 0  # no layer writes the two channels
            state[name] = tensor
    return state


def copy_model(src: Path, dst: Path) -> tuple[Path, Any]:
    """`src`'s model folder copied to `dst` (replaced): (its one weights file, its tokenizer),
    for a shaping to rewrite the copy; `src` untouched."""
    import shutil

    from transformers import AutoTokenizer

    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    files = sorted(dst.glob("*.safetensors"))
    if len(files) != 1:
        raise ValueError(f"{src}: expected one model.safetensors, found {len(files)}")
    return files[0], AutoTokenizer.from_pretrained(src)


def shape_policy(src: Path, dst: Path, *, shaping: Shaping) -> Path:
    """A copy of the policy folder `src` at `dst` with its weights shaped; `src` untouched."""
    weights, tokenizer = copy_model(src, dst)
    shaped = shape_state(
        load_file(weights),
        eos_id=tokenizer.eos_token_id,
        num_tokenizer_ids=len(tokenizer),
        shaping=shaping,
    )
    save_file(shaped, weights, metadata={"format": "pt"})
    (dst / "longtail_shaping.json").write_text(json.dumps(asdict(shaping)))
    return dst
