"""Images from tools (a vision-language policy): a tool's PIL image becomes a tool message with
an image part, its placeholder expanded to the image processor's token count on Qwen2-VL's own
chat template, and the trajectory (and every later request) carries the image; an image over
the observation cap, or for a policy without images, is an error observation."""

NUM_GPUS = 0

import asyncio
import json
import pickle
import textwrap

import pytest
import torch

from yatt.rollout import SamplingParams
from yatt.rollout.env import ChatTokens, EnvConfig, MultiTurnRollout, PoolToolRunner
from yatt.rollout.env.testing import QWEN2_VL_CHAT_TEMPLATE, ScriptedEngine
from yatt.testing import VISION_TOKENS, make_tokenizer

Image = pytest.importorskip("PIL.Image")

PATCH = 4  # the processor's patch side: a 16 x 16 image is 4 x 4 patches, 4 tokens (2 x 2 merged)


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = make_tokenizer(extra_special_tokens=VISION_TOKENS)
    tokenizer.chat_template = QWEN2_VL_CHAT_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def image_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    return Qwen2VLImageProcessorPil(
        patch_size=PATCH, merge_size=2, temporal_patch_size=2, min_pixels=64, max_pixels=32 * 32
    )


def _picture(side, shade=90):
    return Image.new("RGB", (side, side), (shade, 2 * shade % 256, 30))


def _tokens_of(image_processor, image):
    grid = image_processor(images=[image], return_tensors="pt")["image_grid_thw"]
    return int(grid.prod()) // 4


def test_an_image_tool_message_on_the_qwen2_vl_template(tokenizer, image_processor):
    """The appended ids are the template's, each image placeholder expanded to the image's
    tokens: prompt + turn + appended = the whole conversation rendered and expanded as the
    model's processor expands a prompt (every <|image_pad|> repeated)."""
    image_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    tokens = ChatTokens(tokenizer, image_token_id=image_id)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    small, large = _picture(16), _picture(32, shade=200)
    counts = [_tokens_of(image_processor, small), _tokens_of(image_processor, large)]
    assert counts == [4, 16]
    messages = [
        {"role": "user", "content": "Look at the picture."},
        {"role": "assistant", "content": "Let me look."},
    ]
    tool = {
        "role": "tool",
        "content": [
            {"type": "image", "image": small},
            {"type": "text", "text": "and a larger one:"},
            {"type": "image", "image": large},
        ],
    }
    appended = tokens.appended_ids(messages, [tool], end_token_id=im_end, image_tokens=counts)
    full = tokens.render([*messages, tool], add_generation_prompt=True)
    assert full.count("<|vision_start|><|image_pad|><|vision_end|>") == 2
    expanded = iter(counts)
    pieces = full.split("<|image_pad|>")
    text = pieces[0] + "".join("<|image_pad|>" * next(expanded) + p for p in pieces[1:])
    prev = tokens.encode(tokens.render(messages, add_generation_prompt=False))
    turn_end = len(prev) - prev[::-1].index(im_end)  # the assistant's turn, through <|im_end|>
    assert prev[:turn_end] + appended.ids == tokens.encode(text)
    assert appended.is_prefix_exact
    runs = "".join("i" if t == image_id else "." for t in appended.ids).split(".")
    assert [len(r) for r in runs if r] == counts
    # The first prompt expands its own images the same way.
    first = [
        {
            "role": "user",
            "content": [{"type": "image", "image": small}, {"type": "text", "text": "hi"}],
        }
    ]
    ids = tokens.prompt_ids(first, image_tokens=[4])
    assert ids.count(image_id) == 4
    with pytest.raises(ValueError, match="wrote 1 image placeholder"):
        tokens.prompt_ids(first, image_tokens=[])


class Camera:
    """Shows pictures: `look` returns a PIL image, `caption` image parts with text."""

    def reset(self, **row):
        self.side = row.get("side", 16)
        return "What do you see?"

    def look(self, shade: int):
        """A picture.

        Args:
            shade: the red level
        """
        return _picture(self.side, shade)

    def caption(self, words: int):
        """A picture and a caption.

        Args:
            words: caption words
        """
        return [
            {"type": "image", "image": _picture(self.side)},
            {"type": "text", "text": "w " * words},
        ]

    def count(self) -> int:
        """A number (text, as before)."""
        return 7


def _calls(*calls):
    return "".join(
        f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'
        for name, args in calls
    )


def _rollout(tokenizer, script, *, image_processor, **config):
    """A rollout whose model calls script[turn] (then answers "done")."""

    def respond(text):
        turn = text.count("<|im_start|>assistant") - 1
        return _calls(*script[turn]) if turn < len(script) else "done"

    engine = ScriptedEngine(tokenizer=tokenizer, respond=respond)
    config = {"max_turns": 4, "max_trajectory_tokens": 4096, **config}
    image_token_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    rollout = MultiTurnRollout(
        engine,
        EnvConfig(**config),
        environments=[Camera],
        image_processor=image_processor,
        image_token_id=image_token_id if image_processor is not None else None,
    )
    return rollout, engine


def _image_runs(ids, image_id):
    runs = "".join("i" if t == image_id else "." for t in ids).split(".")
    return [len(r) for r in runs if r]


def test_a_tool_image_joins_the_trajectory_and_every_later_request(tokenizer, image_processor):
    image_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    script = [[("look", {"shade": 10})], [("caption", {"words": 3}), ("count", {})]]
    rollout, engine = _rollout(tokenizer, script, image_processor=image_processor)
    (trajectory,), stats = asyncio.run(rollout.run([{"side": 16}], SamplingParams()))
    assert trajectory.end_cause == "stop" and trajectory.num_turns == 3
    assert not stats.tool_errors
    # Two images (4 tokens each) in the observations, off the loss.
    assert _image_runs(trajectory.response_ids, image_id) == [4, 4]
    assert all(
        m == 0
        for t, m in zip(trajectory.response_ids, trajectory.loss_mask, strict=True)
        if t == image_id
    )
    assert len(trajectory.images) == 2 and all(
        isinstance(im, Image.Image) for im in trajectory.images
    )
    inputs = trajectory.image_inputs
    assert inputs.image_grid_thw.tolist() == [[1, 4, 4], [1, 4, 4]]
    assert inputs.pixel_values.shape[0] == 32
    expected = image_processor(images=trajectory.images, return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(inputs.pixel_values, expected, rtol=0, atol=0)
    # The tool messages: image parts (the text result of `count` stays a string).
    tool_messages = [m for m in trajectory.messages if m["role"] == "tool"]
    assert [type(m["content"]).__name__ for m in tool_messages] == ["list", "list", "str"]
    assert tool_messages[1]["content"][1] == {"type": "text", "text": "w w w "}
    assert tool_messages[2]["content"] == "7"
    # Each request carries every image so far, raw and processed.
    first, second, third = engine.requests
    assert first.images is None and first.image_inputs is None
    assert len(second.images) == 1 and second.image_inputs.num_images == 1
    assert len(third.images) == 2 and third.image_inputs.num_images == 2
    assert _image_runs(third.prompt_ids, image_id) == [4, 4]
    # The trajectory pickles (it crosses process boundaries with its images).
    again = pickle.loads(pickle.dumps(trajectory))
    assert again.response_ids == trajectory.response_ids and len(again.images) == 2


def test_an_image_over_the_observation_cap_is_an_error_observation(tokenizer, image_processor):
    """A 32 x 32 picture is 16 tokens: refused under a cap of 8 (the run goes on); a 16 x 16
    one (4 tokens) leaves 4 of the 8 to its caption, which is cut."""
    image_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    rollout, engine = _rollout(
        tokenizer,
        [[("look", {"shade": 1})]],
        image_processor=image_processor,
        max_tool_output_tokens=8,
    )
    (trajectory,), stats = asyncio.run(rollout.run([{"side": 32}], SamplingParams()))
    assert dict(stats.tool_errors) == {"image_too_large": 1}
    assert trajectory.end_cause == "stop" and trajectory.num_turns == 2
    assert trajectory.images == [] and trajectory.image_inputs is None
    assert image_id not in trajectory.response_ids
    (tool,) = [m for m in trajectory.messages if m["role"] == "tool"]
    assert tool["content"].startswith("Error: look returned an image: the tool's image takes 16")
    assert engine.requests[1].images is None

    rollout, _ = _rollout(
        tokenizer,
        [[("caption", {"words": 10})]],
        image_processor=image_processor,
        max_tool_output_tokens=8,
    )
    (trajectory,), stats = asyncio.run(rollout.run([{"side": 16}], SamplingParams()))
    assert not stats.tool_errors
    (tool,) = [m for m in trajectory.messages if m["role"] == "tool"]
    assert tool["content"][1] == {"type": "text", "text": "w w " + " ...[output truncated]"}
    assert _image_runs(trajectory.response_ids, image_id) == [4]


def test_an_image_for_a_policy_without_images_is_an_error_observation(tokenizer):
    rollout, _ = _rollout(tokenizer, [[("look", {"shade": 1})]], image_processor=None)
    (trajectory,), stats = asyncio.run(rollout.run([{}], SamplingParams()))
    assert dict(stats.tool_errors) == {"image_unsupported": 1}
    assert trajectory.end_cause == "stop" and trajectory.images == []
    (tool,) = [m for m in trajectory.messages if m["role"] == "tool"]
    assert "the policy takes no images" in tool["content"]


@pytest.mark.parametrize("token", ["<|image_pad|>", "<|vision_start|>"])
def test_a_sampled_vision_token_ends_the_trajectory_before_it(tokenizer, image_processor, token):
    def respond(text):
        return f"ab{token}cd"

    engine = ScriptedEngine(tokenizer=tokenizer, respond=respond)
    image_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    rollout = MultiTurnRollout(
        engine,
        EnvConfig(max_turns=2),
        environments=[Camera],
        image_processor=image_processor,
        image_token_id=image_id,
        vision_token_ids=tokenizer.convert_tokens_to_ids(list(VISION_TOKENS)),
    )
    (trajectory,), _ = asyncio.run(rollout.run([{}], SamplingParams()))
    assert trajectory.end_cause == "image_token"
    assert tokenizer.decode(trajectory.response_ids) == "ab"
    assert trajectory.logprobs == [-0.01, -0.02] and trajectory.loss_mask == [1, 1]


ENV_FILE = '''
from PIL import Image


class Painter:
    def reset(self, **row):
        self.strokes = 0
        return "Paint."

    def paint(self, shade: int):
        """A canvas.

        Args:
            shade: the red level
        """
        self.strokes += 1
        return {"type": "image", "image": Image.new("RGB", (16, 16), (shade, 0, 0))}
'''


def test_an_image_from_a_worker_process(tokenizer, image_processor, tmp_path):
    """A tool in a UserCodePool worker returns its image across the process boundary (a PIL
    image pickles)."""
    path = tmp_path / "painter.py"
    path.write_text(textwrap.dedent(ENV_FILE))
    image_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")

    def respond(text):
        turn = text.count("<|im_start|>assistant") - 1
        return _calls(("paint", {"shade": 200})) if turn == 0 else "done"

    engine = ScriptedEngine(tokenizer=tokenizer, respond=respond)
    runner = PoolToolRunner.from_timeout(10.0, num_workers=1)
    try:
        rollout = MultiTurnRollout(
            engine,
            EnvConfig(environment=(f"{path}:Painter",), tool_timeout_s=10.0),
            runner=runner,
            image_processor=image_processor,
            image_token_id=image_id,
        )
        (trajectory,), stats = asyncio.run(rollout.run([{}], SamplingParams()))
    finally:
        runner.pool.close()
    assert not stats.tool_errors and trajectory.num_turns == 2
    assert _image_runs(trajectory.response_ids, image_id) == [4]
    assert trajectory.images[0].getpixel((0, 0)) == (200, 0, 0)
