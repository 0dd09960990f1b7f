"""A tool that returns an image, end to end on the CPU: the multi-turn driver renders it through
Qwen2-VL-Instruct's own chat template, the built-in engine continues the kept conversation
with the image's features (mrope positions following the kept turn), and the policy's vision
forward over the whole trajectory (every image) recomputes the engine's sampled logprobs.

The tiny Qwen2-VL is fitted to end its turns: two to four letters of "abc", then <|im_end|>
(the letters drawn at random, so each sampled token's logprob is about -log 3, not 0: a wrong
position or a missing image feature shows in it). A parser that reads every turn as a call to
`look` makes each turn a tool call, so a trajectory is turn 1, the picture, turn 2."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from yatt.core import (
    TorchPolicy,
    TorchPolicyConfig,
    VisionInputs,
    load_image_processor,
    rollout_batch,
    rollout_samples,
)
from yatt.rollout import BuiltinEngine, EngineConfig, SamplingParams
from yatt.rollout.env import (
    ChatTokens,
    EnvConfig,
    MultiTurnRollout,
    ParsedTurn,
    ToolCall,
    register_tool_parser,
)
from yatt.rollout.env.testing import QWEN2_VL_CHAT_TEMPLATE

Image = pytest.importorskip("PIL.Image")

NUM_GPUS = 0
PROMPT = [{"role": "user", "content": "Look around."}]


class AlwaysLook:
    """Every turn is one call to `look` (its text the turn's content)."""

    def parse(self, text: str) -> ParsedTurn:
        return ParsedTurn(content=text, calls=[ToolCall(name="look", arguments={})])


register_tool_parser("always-look", AlwaysLook)


def picture(seed: int, size: tuple[int, int] = (16, 24)):
    """Random pixels: 16 wide, 24 high is 6 x 4 patches, 6 image tokens in 3 rows of 2."""
    rng = random.Random(seed)
    image = Image.new("RGB", size)
    image.putdata([tuple(rng.randrange(256) for _ in range(3)) for _ in range(size[0] * size[1])])
    return image


class Room:
    """`look` shows a picture (a new one each call) and a caption."""

    def reset(self, **row):
        self.calls = 0

    def look(self):
        """Look around."""
        self.calls += 1
        return [
            {"type": "text", "text": "You see:"},
            {"type": "image", "image": picture(self.calls)},
        ]


def _fit(path, steps=80):
    """A tiny Qwen2-VL (Qwen2-VL-Instruct's template) fitted to answer each assistant turn,
    after a picture too, with 2-4 random letters of "abc" and <|im_end|>."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from yatt.testing import make_tiny_vlm

    make_tiny_vlm(path, arch="qwen2_vl", max_position_embeddings=512)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = QWEN2_VL_CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    processor = load_image_processor(path)
    image_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    tokens = ChatTokens(tokenizer, image_token_id=image_id)
    rng = random.Random(0)
    examples = []
    for k in range(8):
        messages = list(PROMPT)
        ids = tokens.prompt_ids(messages)
        labels = [-100] * len(ids)
        images = []
        for turn in range(2):
            text = "".join(rng.choice("abc") for _ in range(rng.randint(2, 4)))
            turn_ids = [*tokens.encode(text), im_end]
            ids, labels = ids + turn_ids, labels + turn_ids
            messages.append({"role": "assistant", "content": text})
            image = picture(100 + 2 * k + turn)
            tool = {"role": "tool", "content": [{"type": "image", "image": image}]}
            grid = processor(images=[image], return_tensors="pt")["image_grid_thw"]
            appended = tokens.appended_ids(
                messages, [tool], end_token_id=im_end, image_tokens=[int(grid.prod()) // 4]
            ).ids
            messages.append(tool)
            images.append(image)
            ids, labels = ids + appended, labels + [-100] * len(appended)
        examples.append((ids, labels, images))
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    model.train()
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        ids, labels, images = examples[step % len(examples)]
        vision = processor(images=images, return_tensors="pt")
        input_ids = torch.tensor([ids])
        loss = model(
            input_ids=input_ids,
            labels=torch.tensor([labels]),
            mm_token_type_ids=(input_ids == image_id).int(),
            pixel_values=vision["pixel_values"],
            image_grid_thw=vision["image_grid_thw"],
        ).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    model.save_pretrained(path)


@pytest.fixture(scope="module")
def looker_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("looker")
    _fit(path)
    return str(path)


def test_a_tool_image_trajectory_trains_on_the_engines_logprobs(looker_dir):
    engine = BuiltinEngine(
        looker_dir,
        config=EngineConfig(device="cpu", dtype="float32", max_seq_len=512, max_batch_size=8),
    )
    continued = []
    prefill_continuations = engine._runner.prefill_continuations

    def counting(items, slots, starts, flags):
        continued.extend(
            len(item.request.prompt_ids) - s for item, s in zip(items, starts, strict=True)
        )
        return prefill_continuations(items, slots, starts, flags)

    engine._runner.prefill_continuations = counting
    im_end = engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
    image_id = engine.image_token_id
    try:
        rollout = MultiTurnRollout(
            engine,
            EnvConfig(max_turns=2, max_trajectory_tokens=400, tool_parser="always-look"),
            environments=[Room],
        )
        sampling = SamplingParams(
            n=4, temperature=1.0, max_new_tokens=12, stop_token_ids=(im_end,), seed=5
        )
        trajectories, stats = asyncio.run(rollout.run([{"messages": PROMPT}] * 2, sampling))
    finally:
        engine.close()
    assert len(trajectories) == 8
    # Each whose first turn ended: turn 1, the picture (its 6 tokens, off the loss), turn 2.
    two_turns = [t for t in trajectories if t.num_turns == 2]
    assert len(two_turns) >= 6, [t.end_cause for t in trajectories]
    for trajectory in two_turns:
        assert trajectory.image_inputs.image_grid_thw.tolist() == [[1, 6, 4]]
        image_at = [i for i, t in enumerate(trajectory.response_ids) if t == image_id]
        assert len(image_at) == 6 and all(trajectory.loss_mask[i] == 0 for i in image_at)
        assert sum(trajectory.loss_mask[image_at[-1] :]) > 0  # turn 2 follows the image
    # Every second turn continued its kept KV, the picture's tokens in its new tokens.
    assert len(continued) == len(two_turns) and min(continued) > 6
    assert stats.num_tool_calls == 8 + len(two_turns)

    samples = rollout_samples(
        trajectories,
        [0.0] * len(trajectories),
        [t.row_index for t in trajectories],
        vision_inputs=[
            None if t.image_inputs is None else VisionInputs(*t.image_inputs) for t in trajectories
        ],
    )
    batch = rollout_batch(samples)
    policy = TorchPolicy(
        TorchPolicyConfig(model_dir=looker_dir, parallel="none", dtype="float32", lr=1e-3)
    )
    logprobs = policy.logprobs(batch).cpu()
    on_loss = batch["loss_mask"].bool()
    sampled = batch["rollout_logprobs"][on_loss]
    # Not a confident model: the letters are drawn, so the logprobs carry the positions.
    assert float(sampled.mean()) < -0.3
    # float32 on the CPU, the same weights and pixels: the engine's kept-KV attention (SDPA
    # over the slot, the image's features from their own tower call) and the policy's padded
    # forward sum in other orders, so logprobs differ by rounding only: 1.2e-6 at most here
    # (about 10 float32 ulps of a logprob near -2, summed over two layers' reductions). 1e-5 is
    # the single-turn vision loop's bound (test_multimodal_loop); an mrope offset wrong by one
    # position after the picture moves them by up to 5.9.
    torch.testing.assert_close(logprobs[on_loss], sampled, atol=1e-5, rtol=0)


def test_the_trainers_multiturn_takes_the_policys_image_processor_whatever_the_engine(
    looker_dir, tmp_path
):
    """An engine that hands out no image processor (vLLM, SGLang; here a scripted one): the
    trainer's make_multiturn gives the multi-turn rollout the policy's, so a tool picture is
    expanded to the processor's image tokens (16 x 24 pixels: 6 tokens) instead of being an
    error observation."""
    import sys
    from pathlib import Path

    from transformers import AutoTokenizer

    from yatt.ckpt import ClosingStack
    from yatt.rollout.env.testing import ScriptedEngine

    examples = Path(__file__).resolve().parents[1] / "examples"
    sys.path.insert(0, str(examples))
    import grpo_config
    import train_grpo

    tools = tmp_path / "look_tools.py"
    tools.write_text(
        "from PIL import Image\n\n\ndef look() -> object:\n"
        '    """A 16 x 24 picture."""\n'
        "    return Image.new('RGB', (16, 24))\n"
    )
    args = train_grpo.parse_args(
        [
            f"policy.model_dir={looker_dir}",
            f"rollout.tools=[{tools}:look]",
            "rollout.max_turns=2",
            "rollout.max_trajectory_tokens=1024",
        ]
    )
    cfg = grpo_config.config_from_args(args)
    engine = ScriptedEngine(tokenizer=AutoTokenizer.from_pretrained(looker_dir), respond=str)
    with ClosingStack() as resources:  # closes the tool workers' pool
        multiturn = train_grpo.make_multiturn(cfg, engine, engine.tokenizer, resources)
    assert multiturn.images is not None
    assert multiturn.images.image_token_id == engine.tokenizer.convert_tokens_to_ids(
        "<|image_pad|>"
    )
    grid = multiturn.images.image_processor(images=[picture(0)], return_tensors="pt")
    assert int(grid["image_grid_thw"].prod()) // 4 == 6


def test_a_rows_image_opens_the_multiturn_conversation(looker_dir):
    """An image dataset (data.image_key) with tools: env_row puts the row's picture first in
    the first user turn (as the single-turn prompt shows it), so the first request holds its 6
    image tokens and the picture; a text row stays a text prompt."""
    import sys
    from pathlib import Path
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from yatt.core import Prompt
    from yatt.rollout.env.testing import ScriptedEngine

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import train_grpo

    cfg = SimpleNamespace(data=SimpleNamespace(prompt_key="question"), seed=0)
    row = {"question": "How many dots?", "image": "dots.png", "row_index": 3}
    with_picture = train_grpo.env_row(Prompt(row, [1], images=[picture(1)]), cfg, step=0)
    assert "prompt" not in with_picture
    (message,) = with_picture["messages"]
    assert message["role"] == "user"
    assert [p["type"] for p in message["content"]] == ["image", "text"]
    assert message["content"][1]["text"] == "How many dots?"
    text_only = train_grpo.env_row(Prompt(row, [1]), cfg, step=0)
    assert text_only["prompt"] == "How many dots?" and "messages" not in text_only

    tokenizer = AutoTokenizer.from_pretrained(looker_dir)
    tokenizer.chat_template = QWEN2_VL_CHAT_TEMPLATE
    engine = ScriptedEngine(tokenizer=tokenizer, respond=lambda text: "done")
    image_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    rollout = MultiTurnRollout(
        engine,
        EnvConfig(max_turns=1, max_trajectory_tokens=256, tool_parser="always-look"),
        environments=[Room],
        image_processor=load_image_processor(looker_dir),
        image_token_id=image_id,
    )
    asyncio.run(rollout.run([with_picture], SamplingParams(max_new_tokens=4)))
    (request,) = engine.requests
    assert request.prompt_ids.count(image_id) == 6  # 16 x 24 pixels: 6 merged patch groups
    assert len(request.images) == 1
