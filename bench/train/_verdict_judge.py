"""A random-weight judge that writes a verdict genrm can read (bench/train/offpolicy_gpu.py).

A judge with random weights never writes "Yes" or "No" on a last line, so every verdict fails
and the trainer stops at step 0 (its check that a run can learn; the H200 run at 8d2b377). This
rewrites the judge's weights so that, sampled at temperature 1 (genrm samples its votes so
when reward.votes > 1), its generation is a Markov chain on the current token:

    reasoning:  each token is one of the reasoning bytes (uniform), or "\\n" with probability
                `newline_hazard`: a geometric chain of thought, median `reasoning_median`
    "\\n":       "Y" or "N", one half each
    "Y" -> "e" -> "s" -> EOS;  "N" -> "o" -> EOS

so every generation is "<reasoning>\\nYes" or "<reasoning>\\nNo": one line of reasoning, then the
verdict line, parsed by genrm's default YesNoParser. The verdict is a coin: the reward is the
judge's noise, as before, but now it reaches the trainer. The judge's compute is a 1.5B
model's: every GEMM runs at its shape, only its output is decided.

How: every layer's o_proj and down_proj are zero, so the residual stream is the token embedding
all the way up. Each token's embedding is sqrt(hidden) times a one-hot vector of its state
(reasoning, newline, Y, e, s, N, o), so the final norm (weights 1) returns it unchanged, and an
untied lm_head holds one column of logits per state, divided by sqrt(hidden). The prompt's
last token is a reasoning-state token (the judge tokenizer's chat template ends its generation
prompt in "Reasoning:"), so each generation opens with its chain of thought.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from _longtail_policy import copy_model  # bench/train: beside this file
from safetensors.torch import load_file, save_file

# The chat template the shaped judge's tokenizer gets: the test tokenizer's, with a generation
# prompt that ends in a reasoning-state character (":"), not "\n" (the newline state would
# start with the verdict).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\nReasoning:' }}{% endif %}"
)
STATES = ("reasoning", "newline", "Y", "e", "s", "N", "o")
SUPPRESSED = -40.0  # a logit no sampled token has (e^-40 x 152k tokens ~ 1e-12)


@dataclass(frozen=True)
class VerdictChain:
    """What the shaped judge writes: reasoning of geometric length, then a coin verdict."""

    reasoning_median: int = 32

    def __post_init__(self) -> None:
        if self.reasoning_median < 1:
            raise ValueError(f"reasoning_median={self.reasoning_median}: give at least 1")

    @property
    def newline_hazard(self) -> float:
        """P("\\n") per reasoning token: median length ln 2 / hazard."""
        return math.log(2) / self.reasoning_median

    def newline_logit(self, num_reasoning_tokens: int) -> float:
        """The newline's logit over reasoning tokens at logit 0: e^a / (e^a + K) = hazard."""
        h = self.newline_hazard
        return math.log(h * num_reasoning_tokens / (1 - h))

    def reasoning_quantile(self, q: float) -> int:
        """The q-quantile of the reasoning's token count (0, 1, ...: geometric)."""
        return math.ceil(math.log(1 - q) / math.log(1 - self.newline_hazard)) - 1


def token_id(tokenizer, text: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"{text!r} is {len(ids)} tokens in the judge's vocabulary, not one")
    return ids[0]


def shape_state(state: dict[str, torch.Tensor], *, tokenizer, chain: VerdictChain
                ) -> dict[str, torch.Tensor]:  # fmt: skip
    """The judge's tensors rewritten into the chain (module docstring); adds lm_head.weight."""
    state = dict(state)
    embed = state["model.embed_tokens.weight"]
    vocab, hidden = embed.shape
    dtype = embed.dtype
    scale = math.sqrt(hidden)
    ids = {name: token_id(tokenizer, "\n" if name == "newline" else name) for name in STATES[1:]}
    state_of = torch.zeros(vocab, dtype=torch.long)  # every other id: the reasoning state
    for column, name in enumerate(STATES[1:], start=1):
        state_of[ids[name]] = column
    new_embed = torch.zeros(vocab, hidden)
    new_embed[torch.arange(vocab), state_of] = scale
    state["model.embed_tokens.weight"] = new_embed.to(dtype)
    state["model.norm.weight"] = torch.ones_like(state["model.norm.weight"])
    for name, tensor in state.items():
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            state[name] = torch.zeros_like(tensor)  # no layer writes the residual

    # Reasoning: the tokenizer's byte tokens other than the chain's own and the specials.
    special = set(tokenizer.all_special_ids)
    reasoning = [i for i in range(len(tokenizer)) if i not in special and i not in ids.values()]
    logits = torch.full((vocab, len(STATES)), SUPPRESSED)
    logits[reasoning, 0] = 0.0
    logits[ids["newline"], 0] = chain.newline_logit(len(reasoning))
    logits[[ids["Y"], ids["N"]], 1] = 0.0
    eos = tokenizer.eos_token_id
    for column, successor in ((2, ids["e"]), (3, ids["s"]), (4, eos), (5, ids["o"]), (6, eos)):
        logits[successor, column] = 0.0
    head = torch.zeros(vocab, hidden)
    head[:, : len(STATES)] = logits / scale
    state["lm_head.weight"] = head.to(dtype)
    return state


def shape_judge(src: Path, dst: Path, *, chain: VerdictChain) -> Path:
    """A copy of the judge folder `src` at `dst` with its weights, config (untied head) and
    tokenizer (chat template) shaped; `src` untouched."""
    weights, tokenizer = copy_model(src, dst)
    shaped = shape_state(load_file(weights), tokenizer=tokenizer, chain=chain)
    save_file(shaped, weights, metadata={"format": "pt"})
    config_path = dst / "config.json"
    config = json.loads(config_path.read_text())
    config["tie_word_embeddings"] = False
    config_path.write_text(json.dumps(config, indent=2))
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(dst)
    (dst / "verdict_chain.json").write_text(json.dumps(asdict(chain)))
    return dst
