"""Tiny Hugging Face models and tokenizers built locally, so tests never download anything.

The tokenizer is byte-level (every UTF-8 string round-trips, 256 byte tokens plus a few special
tokens) and carries a chat template, so code paths that call `apply_chat_template` are exercised.
`make_tiny_vlm` builds a vision-language model (Qwen2-VL or Qwen2.5-VL) with a tiny vision tower
and saves it with its image processor, so multimodal code paths run on the CPU too.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

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


def make_tokenizer(*, extra_special_tokens: Sequence[str] = ()) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer: ids 0..4 are special tokens, then one id per byte, then
    `extra_special_tokens` (e.g. a vision-language model's image placeholders) in order."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: len(SPECIAL_TOKENS) + i for i, ch in enumerate(alphabet)})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS) + list(extra_special_tokens))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<|pad|>",
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>", *extra_special_tokens],
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
    return _build_and_save(AutoModelForCausalLM, config, tokenizer, path, seed=seed, dtype=dtype)


def _build_and_save(
    auto_cls: Any,
    config: Any,
    tokenizer: Any,
    path: str | Path | None,
    *,
    seed: int,
    dtype: torch.dtype,
) -> PreTrainedModel:
    """The model of `config`, seeded without touching the caller's RNG, saved with its
    tokenizer under `path` when set."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = auto_cls.from_config(config, dtype=dtype)
    model.eval()
    if path is not None:
        Path(path).mkdir(parents=True, exist_ok=True)
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    return model


# Qwen2-VL's placeholders: the processor expands each image's <|image_pad|> to one token per
# merged patch, between <|vision_start|> and <|vision_end|>.
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

# ChatML as above; a message's content may also be a list of {"type": "image"} and
# {"type": "text", "text": ...} parts (the Hugging Face multimodal message format).
VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_VLM_ARCHS = ("qwen2_vl", "qwen2_5_vl")


def make_tiny_vlm(
    path: str | Path | None = None,
    *,
    arch: str = "qwen2_vl",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    vision_depth: int = 2,
    vision_hidden_size: int = 32,
    vision_num_heads: int = 2,
    patch_size: int = 4,
    min_pixels: int = 8 * 8,
    max_pixels: int = 32 * 32,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> PreTrainedModel:
    """Build a randomly initialised Qwen2-VL (or Qwen2.5-VL) with a tiny vision tower.

    When `path` is set the model, its tokenizer (byte-level plus VISION_TOKENS, with
    VLM_CHAT_TEMPLATE) and its image processor are saved there with save_pretrained, so
    `AutoModelForImageTextToText`, `AutoTokenizer` and `AutoImageProcessor` load the directory
    like a hub model. An image of at most `max_pixels` pixels becomes up to
    max_pixels / patch_size**2 patches, a quarter as many image tokens (2x2 patches merge).

    Qwen2VLProcessor itself is not saved: in transformers 5 it cannot be built without
    torchvision (its video processor needs it); the image processor and tokenizer are its parts.
    """
    import importlib.util

    if importlib.util.find_spec("PIL") is None:  # transformers' image processors need it
        raise ImportError("make_tiny_vlm needs Pillow: pip install 'yatt-testing[vision]'")
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    if arch not in _VLM_ARCHS:
        raise ValueError(f"arch={arch!r} is not supported; use one of {list(_VLM_ARCHS)}")
    head_dim = hidden_size // num_heads
    if head_dim % 2 or head_dim < 6:
        raise ValueError(
            f"hidden_size / num_heads = {head_dim} must be even and >= 6 (mrope splits it in 3)"
        )
    tokenizer = make_tokenizer(extra_special_tokens=VISION_TOKENS)
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    ids = dict(
        zip(VISION_TOKENS, tokenizer.convert_tokens_to_ids(list(VISION_TOKENS)), strict=True)
    )
    # mrope: the rotary half-dimensions split over (time, height, width).
    half = head_dim // 2
    mrope_section = [half - 2 * (half // 3), half // 3, half // 3]
    text_config = dict(
        vocab_size=-(-(len(tokenizer) + 1) // 8) * 8,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": mrope_section,
        },
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    vision_config: dict = dict(
        depth=vision_depth,
        num_heads=vision_num_heads,
        patch_size=patch_size,
        spatial_merge_size=2,
        temporal_patch_size=2,
    )
    if arch == "qwen2_vl":
        config_cls = transformers.Qwen2VLConfig
        vision_config.update(embed_dim=vision_hidden_size, hidden_size=hidden_size, mlp_ratio=2)
    else:
        config_cls = transformers.Qwen2_5_VLConfig
        vision_config.update(
            hidden_size=vision_hidden_size,
            out_hidden_size=hidden_size,
            intermediate_size=2 * vision_hidden_size,
            window_size=4 * patch_size,
            fullatt_block_indexes=[vision_depth - 1],
        )
    config = config_cls(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    auto_cls = transformers.AutoModelForImageTextToText
    model = _build_and_save(auto_cls, config, tokenizer, path, seed=seed, dtype=dtype)
    if path is not None:
        image_processor = Qwen2VLImageProcessorPil(
            patch_size=patch_size,
            merge_size=2,
            temporal_patch_size=2,
            min_pixels=min_pixels,
            max_pixels=max_pixels,
        )
        image_processor.save_pretrained(path)
    return model
