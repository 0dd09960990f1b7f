"""yatt.core's prompt encoding does each expensive thing once: the loader counts a prompt's
tokens through the encoder, which keeps the ids for encode(), so a prompt is tokenized once;
a row's images go through the image processor once. Chat templates get the configured
variables (chat_template_kwargs); a template that refuses a row makes a counted skip."""

NUM_GPUS = 0

import copy
import json
from pathlib import Path

import pytest

from yatt import core
from yatt.testing import CountingImageProcessor, CountingTokenizer, make_tokenizer

MAX_SEQ_LEN, MAX_NEW_TOKENS = 256, 4


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory) -> Path:
    from yatt.testing import make_tiny_vlm

    path = tmp_path_factory.mktemp("qwen2_vl")
    make_tiny_vlm(path, arch="qwen2_vl")
    return path


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory) -> Path:
    from yatt.testing import make_tiny_causal_lm

    path = tmp_path_factory.mktemp("llama")
    make_tiny_causal_lm(path, arch="llama")
    return path


def _encoder(model_dir: Path, *, image_key: str | None = None, **kwargs) -> core.PromptEncoder:
    from transformers import AutoTokenizer

    tokenizer = CountingTokenizer(AutoTokenizer.from_pretrained(model_dir))
    return core.PromptEncoder(
        tokenizer,
        model_dir=str(model_dir),
        image_key=image_key,
        max_images=4,
        max_prompt_tokens=MAX_SEQ_LEN - MAX_NEW_TOKENS,
        **kwargs,
    )


def _loader(path: Path, encoder, num_rows: int, **images) -> core.ShardedLoader:
    return core.ShardedLoader(
        str(path), batch_size=num_rows, seed=0, prompt_encoder=encoder, **images
    )


def _write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_a_prompt_the_loader_counted_is_not_tokenized_again(tmp_path, text_dir):
    encoder = _encoder(text_dir)
    messages = [{"role": "system", "content": "Add."}, {"role": "user", "content": "3+4="}]
    rows = [{"prompt": f"{i}+1="} for i in range(5)] + [{"prompt": messages}]
    loader = _loader(_write_rows(tmp_path / "rows.jsonl", rows), encoder, len(rows))
    assert loader.max_prompt_tokens == MAX_SEQ_LEN - MAX_NEW_TOKENS  # the encoder's
    prompts = encoder.encode(loader.next_batch())
    assert len(prompts) == len(rows)
    # One tokenizer call per prompt (the loader's count and the encoder's ids were two).
    assert sum(encoder.tokenizer.texts.values()) == len(rows)
    assert set(encoder.tokenizer.texts.values()) == {1}
    # The kept ids are the prompt's own: its chat-templated text, tokenized.
    plain = encoder.tokenizer.tokenizer
    for prompt in prompts:
        value = prompt.row["prompt"]
        chat = value if isinstance(value, list) else [{"role": "user", "content": value}]
        text = plain.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        assert prompt.ids == plain(text, add_special_tokens=False)["input_ids"]
        assert prompt.request_fields() == {
            "prompt_ids": prompt.ids,
            "images": None,
            "image_inputs": None,
        }
    assert not encoder._counted  # nothing kept once encoded


def test_a_prompt_not_counted_is_tokenized_when_encoded(text_dir):
    encoder = _encoder(text_dir)
    (prompt,) = encoder.encode([{"prompt": "2+2=", core.ROW_INDEX_KEY: 0}])
    assert sum(encoder.tokenizer.texts.values()) == 1 and prompt.ids


def test_the_loader_skips_a_prompt_longer_than_the_encoder_allows(tmp_path, text_dir):
    encoder = _encoder(text_dir)
    rows = [{"prompt": "1+1="}, {"prompt": "word " * 400}]
    loader = _loader(_write_rows(tmp_path / "rows.jsonl", rows), encoder, 2)
    assert [r["prompt"] for r in loader.next_batch()] == ["1+1="]
    assert loader.skipped_by_cause()["too_long"] == 1
    with pytest.raises(ValueError, match="prompt_encoder or count_tokens, not both"):
        core.ShardedLoader(
            str(tmp_path / "rows.jsonl"), batch_size=1, prompt_encoder=encoder, count_tokens=len
        )


# A chat template with a variable of its own, as Qwen3's enable_thinking.
THINKING_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% endif %}{% endif %}"
)


def test_chat_template_kwargs_reach_the_template(tmp_path):
    tokenizer = make_tokenizer()
    tokenizer.chat_template = THINKING_TEMPLATE
    kwargs = {"model_dir": str(tmp_path), "max_prompt_tokens": 200}  # no config: a text policy
    thinking = core.PromptEncoder(tokenizer, **kwargs)
    quiet = core.PromptEncoder(tokenizer, chat_template_kwargs={"enable_thinking": False}, **kwargs)
    row = {"prompt": "3+4=", core.ROW_INDEX_KEY: 0}
    (with_thinking,) = thinking.encode([row])
    (without,) = quiet.encode([row])
    assert tokenizer.decode(with_thinking.ids).endswith("<|im_start|>assistant\n")
    assert tokenizer.decode(without.ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    count = core.prompt_token_counter(tokenizer, True, {"enable_thinking": False})
    assert count("3+4=") == len(without.ids)
    with pytest.raises(ValueError, match=r"chat_template_kwargs=.*must be a mapping"):
        core.PromptEncoder(tokenizer, chat_template_kwargs="enable_thinking=false", **kwargs)


# Qwen3's chat template in its parts that matter here (written for this test, tools left
# out): an assistant turn before the last user query loses its <think> block, and the
# generation prompt opens the assistant turn, followed by an empty <think> block when the
# caller passes enable_thinking=False (Qwen3's documented switch for non-thinking mode).
QWEN3_TEMPLATE = (
    "{%- set ns = namespace(last_query=messages|length - 1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{%- set content = m.content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- if loop.index0 > ns.last_query %}{%- set content = m.content %}{%- endif %}"
    "{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)


def _qwen3_tokenizer():
    tokenizer = make_tokenizer(extra_special_tokens=("<think>", "</think>"))
    tokenizer.chat_template = QWEN3_TEMPLATE
    return tokenizer


@pytest.mark.parametrize(
    "prompt",
    [
        "3+4=",
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "2+2="},
            {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
            {"role": "user", "content": "3+4="},
        ],
    ],
    ids=["text", "messages"],
)
def test_enable_thinking_false_appends_the_templates_empty_think_block(tmp_path, prompt):
    tokenizer = _qwen3_tokenizer()
    kwargs = {"model_dir": str(tmp_path), "max_prompt_tokens": 400}
    row = {"prompt": prompt, core.ROW_INDEX_KEY: 0}
    default = core.PromptEncoder(tokenizer, **kwargs)
    thinking = core.PromptEncoder(
        tokenizer, chat_template_kwargs={"enable_thinking": True}, **kwargs
    )
    quiet = core.PromptEncoder(tokenizer, chat_template_kwargs={"enable_thinking": False}, **kwargs)
    (base,) = default.encode([row])
    (on,) = thinking.encode([row])
    # Counted first (the loader's length check), then encoded from the kept ids.
    num_counted = quiet.count_tokens(prompt)
    (off,) = quiet.encode([row])
    # By the template: the same prompt, then <think>, two newlines, </think>, two newlines; each
    # tag one special token, each newline one byte token.
    think, end_think = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    (newline,) = tokenizer.encode("\n", add_special_tokens=False)
    assert tokenizer.decode(base.ids).endswith("3+4=<|im_end|>\n<|im_start|>assistant\n")
    assert on.ids == base.ids  # thinking is Qwen3's default
    assert off.ids == [*base.ids, think, newline, newline, end_think, newline, newline]
    assert num_counted == len(off.ids)
    count = core.prompt_token_counter(tokenizer, True, {"enable_thinking": False})
    assert count(prompt) == len(off.ids)


def test_chat_template_kwargs_are_fixed_and_checked(tmp_path):
    tokenizer = _qwen3_tokenizer()
    kwargs = {"model_dir": str(tmp_path), "max_prompt_tokens": 400}
    encoder = core.PromptEncoder(
        tokenizer, chat_template_kwargs={"enable_thinking": False}, **kwargs
    )
    # The kept token counts were rendered with these variables: they cannot change under them.
    with pytest.raises(TypeError):
        encoder.chat_template_kwargs["enable_thinking"] = True
    with pytest.raises(AttributeError):
        encoder.chat_template_kwargs = {"enable_thinking": True}
    copied = copy.deepcopy(encoder)  # still copies (a trainer may copy or pickle its encoder)
    assert copied.chat_template_kwargs == {"enable_thinking": False}
    with pytest.raises(ValueError, match=r"chat_template_kwargs=\{1: True\} must be a mapping"):
        core.PromptEncoder(tokenizer, chat_template_kwargs={1: True}, **kwargs)
    with pytest.raises(ValueError, match=r"\['add_generation_prompt'\] are set by the prompt"):
        core.PromptEncoder(
            tokenizer, chat_template_kwargs={"add_generation_prompt": False}, **kwargs
        )


# A strict chat template (Gemma and Mistral raise like this on a role they do not know).
STRICT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
    "{{ raise_exception('Conversation roles must be user/assistant') }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_a_chat_template_that_refuses_a_row_makes_it_a_counted_bad_prompt_skip(tmp_path):
    tokenizer = make_tokenizer()
    tokenizer.chat_template = STRICT_TEMPLATE
    encoder = core.PromptEncoder(
        tokenizer, model_dir=str(tmp_path), should_apply_chat_template=False
    )
    tool = [{"role": "tool", "content": "42"}, {"role": "user", "content": "3+4="}]
    with pytest.raises(core.PromptError, match=r"refused roles \['tool', 'user'\]: Conv"):
        core.prompt_ids(tool, tokenizer, should_apply_chat_template=False)
    rows = [
        {"prompt": tool, core.ROW_INDEX_KEY: 0},
        {"prompt": [{"role": "user", "content": "3+4="}], core.ROW_INDEX_KEY: 1},
        {"prompt": "1+1=", core.ROW_INDEX_KEY: 2},  # plain text: no template
    ]
    prompts = encoder.encode(rows)
    assert [p.row[core.ROW_INDEX_KEY] for p in prompts] == [1, 2]
    assert encoder.skipped == {"bad_prompt": 1}
    assert tokenizer.decode(prompts[1].ids) == "1+1="
    with pytest.raises(ValueError, match=r"none of its first 2 usable rows .*bad_prompt"):
        encoder.check([rows[0], rows[0]], source="data.path='x'")


def test_a_nested_prompt_field_is_read_by_the_loader_and_the_encoder(tmp_path):
    tokenizer = make_tokenizer()
    encoder = core.PromptEncoder(
        tokenizer, model_dir=str(tmp_path), prompt_key="extra.question", max_prompt_tokens=200
    )
    rows = [{"extra": {"question": "3+4="}, "reward_model": {"ground_truth": "7"}}]
    path = _write_rows(tmp_path / "rows.jsonl", rows)
    loader = core.ShardedLoader(
        str(path),
        batch_size=1,
        prompt_key="extra.question",
        required_keys=["reward_model.ground_truth"],
        prompt_encoder=encoder,
    )
    (prompt,) = encoder.encode(loader.next_batch())
    assert tokenizer.decode(prompt.ids).endswith("3+4=<|im_end|>\n<|im_start|>assistant\n")


def _image_rows(tmp_path: Path, images_per_row) -> list[dict]:
    import numpy as np
    from PIL import Image

    rows = []
    for i, num_images in enumerate(images_per_row):
        names = []
        for k in range(num_images):
            name = f"img{i}_{k}.png"
            pixels = np.random.default_rng(10 * i + k).integers(0, 256, (16, 16 + 8 * k, 3))
            Image.fromarray(pixels.astype(np.uint8)).save(tmp_path / name)
            names.append(name)
        rows.append({"prompt": f"how many dots? {i}", "image": names[0] if k == 0 else names})
    return rows


def test_an_image_row_is_tokenized_once_and_its_images_processed_once(tmp_path, vlm_dir):
    encoder = _encoder(vlm_dir, image_key="image")
    spy = CountingImageProcessor(encoder.image_processor)
    encoder.image_processor = spy
    rows = _image_rows(tmp_path, images_per_row=(1, 1, 1))
    loader = _loader(_write_rows(tmp_path / "rows.jsonl", rows), encoder, 3, image_key="image")
    prompts = encoder.encode(loader.next_batch())
    assert len(prompts) == 3
    assert sum(encoder.tokenizer.texts.values()) == 3  # one call per prompt
    assert spy.num_images == 3  # each image once, in the encoder
    for prompt in prompts:
        fields = prompt.request_fields()
        assert fields["image_inputs"] is prompt.vision and fields["images"] == prompt.images
        assert prompt.vision.num_images == 1


def test_a_row_of_several_images_counts_with_one_placeholder_then_encodes_with_all(
    tmp_path, vlm_dir
):
    """The loader counts before a row's images are opened, so with one image placeholder (a
    lower bound); a row of two images is tokenized again with both (the one second call)."""
    encoder = _encoder(vlm_dir, image_key="image")
    rows = _image_rows(tmp_path, images_per_row=(2,))
    loader = _loader(_write_rows(tmp_path / "rows.jsonl", rows), encoder, 1, image_key="image")
    (prompt,) = encoder.encode(loader.next_batch())
    assert sum(encoder.tokenizer.texts.values()) == 2
    assert len(prompt.images) == 2 and prompt.vision.num_images == 2


def test_a_lone_surrogate_in_a_role_or_text_is_a_bad_prompt_not_a_tokenizer_error(tmp_path):
    tokenizer = make_tokenizer()
    encoder = core.PromptEncoder(tokenizer, model_dir=str(tmp_path), max_prompt_tokens=200)
    rows = [
        {"prompt": [{"role": "us\ud800er", "content": "hi"}], core.ROW_INDEX_KEY: 0},
        {"prompt": "1+1=", core.ROW_INDEX_KEY: 1},
    ]
    assert encoder.count_tokens(rows[0]["prompt"]) == 0  # the loader keeps it for encode to skip
    assert [p.row[core.ROW_INDEX_KEY] for p in encoder.encode(rows)] == [1]
    assert encoder.skipped == {"bad_prompt": 1}
    with pytest.raises(core.PromptError, match="not valid Unicode"):
        core.prompt_ids("a\ud800", tokenizer, should_apply_chat_template=False)
