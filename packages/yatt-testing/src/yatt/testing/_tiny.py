"""Tiny Hugging Face models and tokenizers built locally, so tests never download anything.

The tokenizer is byte-level (every UTF-8 string round-trips, 256 byte tokens plus a few special
tokens) and carries a chat template, so code paths that call `apply_chat_template` are exercised.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>")

# A ChatML-style template; `add_generation_prompt` opens the assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_ARCHS = {
    "llama": "LlamaConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
}


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer: ids 0..4 are special tokens, then one id per byte."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: len(SPECIAL_TOKENS) + i for i, ch in enumerate(alphabet)})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<|pad|>",
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_tiny_causal_lm(
    path: str | Path | None = None,
    *,
    arch: str = "llama",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> PreTrainedModel:
    """Build a randomly initialised causal LM (and save it with its tokenizer when `path` is set).

    The model's vocabulary matches `make_tokenizer()`, so the saved directory loads with
    `AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained` like a hub model.
    """
    import transformers

    if arch not in _ARCHS:
        raise ValueError(f"arch={arch!r} is not supported; use one of {sorted(_ARCHS)}")
    tokenizer = make_tokenizer()
    config_cls = getattr(transformers, _ARCHS[arch])
    config = config_cls(
        # Rounded up: some auto tokenizer classes (Qwen2's) add an <|endoftext|> token on load.
        vocab_size=-(-(len(tokenizer) + 1) // 8) * 8,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if arch == "qwen3":
        config.head_dim = hidden_size // num_heads
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    if path is not None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    return model
