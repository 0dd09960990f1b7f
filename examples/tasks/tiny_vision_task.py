"""The embedded image task (`task=vision`): count the dots in a tiny picture.

Built locally like the text task (tiny_task.py beside it), once, under out_dir/embedded-vision:

    images/         32 x 32 PNG pictures of 1-4 bright dots on a dark ground, each dot in its
                    own cell of a 4 x 4 grid (one vision patch per cell)
    prompts.jsonl   {"prompt": "How many dots?", "image": "images/train0.png", "answer": "3"},
                    the training split; image paths are relative to the file, as the loader reads
    eval.jsonl      held-out pictures (drawn from another seed), never in prompts.jsonl
    policy/         a tiny Qwen2-VL (yatt.testing.make_tiny_vlm, byte tokenizer + vision tokens)
                    fitted on *noisy* counts (right only part of the time): it learns to look,
                    not to be sure, so GRPO has something to improve and a signal to find

No judge model: the reward is the exact-match rule (reward.backend=none, reward.rule_weight=1,
the task's defaults). A tiny judge fitted as in tiny_task.py to compare the response with the
reference count confused some digit pairs (1 and 3, 2 and 4), and GRPO soon learnt to exploit
that; a judge of your own is reward.backend=builtin with reward.judge_dir.

The policy reads each picture as 4 image tokens (16 patches of 8 x 8 pixels, 2 x 2 merged), so
its vision tower costs little on a CPU.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import torch
from grpo_config import EMBEDDED_TASKS
from transformers import AutoModelForImageTextToText, AutoTokenizer

from tasks.tiny_task import is_prepared, locked_build, write_rows
from yatt import core
from yatt.testing import make_tiny_vlm

logger = logging.getLogger("train_grpo")
QUESTION = "How many dots?"
MAX_DOTS = 4
IMAGE_SIZE = 32  # pixels per side
CELL = 8  # pixels per grid cell = the vision patch size
# The rows' image field, as the config knows it (grpo_config.EMBEDDED_TASKS["vision"] also
# holds its columns and its config defaults: the exact-match rule as the reward).
IMAGE_KEY = EMBEDDED_TASKS["vision"].image_key
NUM_ROWS = 512
NUM_EVAL_ROWS = 64


def draw_dots(num_dots: int, rng: random.Random):
    """A 32 x 32 RGB picture of `num_dots` dots, each in its own grid cell."""
    from PIL import Image, ImageDraw

    ground = tuple(rng.randint(0, 60) for _ in range(3))
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), ground)
    draw = ImageDraw.Draw(image)
    cells = rng.sample(range((IMAGE_SIZE // CELL) ** 2), num_dots)
    for cell in cells:
        row, col = divmod(cell, IMAGE_SIZE // CELL)
        radius = rng.randint(2, 3)
        cx = col * CELL + rng.randint(radius, CELL - 1 - radius)
        cy = row * CELL + rng.randint(radius, CELL - 1 - radius)
        colour = tuple(rng.randint(150, 255) for _ in range(3))
        draw.ellipse([cx - radius, cy - radius, cx + radius, cy + radius], fill=colour)
    return image


def dot_rows(workdir: Path, num_rows: int, seed: int, *, split: str) -> list[dict[str, str]]:
    """Rows of one split, their pictures written under workdir/images."""
    rng = random.Random(seed)
    (workdir / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(num_rows):
        num_dots = rng.randint(1, MAX_DOTS)
        name = f"images/{split}{i}.png"
        draw_dots(num_dots, rng).save(workdir / name)
        rows.append({"prompt": QUESTION, IMAGE_KEY: name, "answer": str(num_dots)})
    return rows


def chat_prompt(tokenizer, text: str, num_images: int) -> list[int]:
    """The policy's prompt ids: one user turn, its images first (one placeholder each)."""
    content = [{"type": "image"}] * num_images + [{"type": "text", "text": text}]
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def build_policy(
    model_dir: Path,
    rows: list[dict[str, str]],
    image_dir: Path,
    *,
    seed: int,
    p_correct: float = 0.25,
    clean_steps: int = 250,
    steps: int = 450,
    batch_size: int = 32,
    lr: float = 3e-3,
    noisy_lr: float = 3e-4,
) -> float:
    """A "base model" that answers a count, right about p_correct of the time (else a random
    digit): fitted on the training split's pictures, `clean_steps` of right answers, then noisy
    ones until `steps`."""
    from PIL import Image

    make_tiny_vlm(
        model_dir,
        arch="qwen2_vl",
        hidden_size=64,
        num_layers=2,
        patch_size=CELL,
        min_pixels=IMAGE_SIZE * IMAGE_SIZE,
        max_pixels=IMAGE_SIZE * IMAGE_SIZE,
        max_position_embeddings=256,
        seed=seed,
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    image_processor = core.load_image_processor(model_dir)
    image_token_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    encoded = []  # (prompt ids, pixel_values, image_grid_thw, answer) per training row
    for row in rows:
        with Image.open(image_dir / row[IMAGE_KEY]) as image:
            ids, vision = core.encode_vision_prompt(
                chat_prompt(tokenizer, row["prompt"], 1),
                [image.convert("RGB")],
                image_processor=image_processor,
                image_token_id=image_token_id,
            )
        encoded.append((ids, vision, int(row["answer"])))

    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    # Cosine decay over the clean steps, then a low constant rate for the noisy ones: enough to
    # unlearn the model's certainty, too little to unlearn what its vision tower sees.
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(
        optimizer, T_max=clean_steps, eta_min=lr / 20
    )
    loss_value = float("nan")
    for step in range(steps):
        if step == clean_steps:  # the vision tower keeps what it learnt to see
            model.model.visual.requires_grad_(False)
            for group in optimizer.param_groups:
                group["lr"] = noisy_lr
        picks = [rng.choice(encoded) for _ in range(batch_size)]
        sequences = []
        for ids, _, count in picks:
            # First clean answers (the vision tower learns to see the dots), then noisy ones
            # (any digit): the model keeps seeing but is no longer sure.
            is_right = step < clean_steps or rng.random() < p_correct
            answer = count if is_right else rng.randint(0, 9)
            completion = tokenizer(str(answer), add_special_tokens=False)["input_ids"]
            sequences.append((ids, [*completion, tokenizer.eos_token_id]))
        ids, labels, mask = _pad(sequences, tokenizer.pad_token_id)
        loss = model(
            input_ids=ids,
            attention_mask=mask,
            mm_token_type_ids=(ids == image_token_id).to(torch.int32),  # M-RoPE's image runs
            labels=labels,
            pixel_values=torch.cat([vision.pixel_values for _, vision, _ in picks]),
            image_grid_thw=torch.cat([vision.image_grid_thw for _, vision, _ in picks]),
        ).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step < clean_steps:
            schedule.step()
        loss_value = loss.item()
        if step % 50 == 0:
            logger.info(
                "fitting the embedded vision policy: step %d/%d, loss %.3f", step, steps, loss_value
            )
    model.eval()
    model.save_pretrained(model_dir)
    return loss_value


def _pad(sequences: list[tuple[list[int], list[int]]], pad_id: int):
    """Right-padded (ids, labels on the completion only, attention mask)."""
    width = max(len(p) + len(c) for p, c in sequences)
    ids = torch.full((len(sequences), width), pad_id)
    labels = torch.full((len(sequences), width), -100)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, (prompt, completion) in enumerate(sequences):
        n = len(prompt) + len(completion)
        ids[i, :n] = torch.tensor(prompt + completion)
        labels[i, len(prompt) : n] = torch.tensor(completion)
        mask[i, :n] = 1
    return ids, labels, mask


def prepare(workdir: str | Path, render: object = None, *, seed: int = 0) -> dict[str, Path]:
    """Build (or reuse) the pictures and the base VLM policy under `workdir` (`render`, the
    judge prompt renderer tiny_task.locked_build passes, is unused: no judge)."""
    workdir = Path(workdir)
    paths = {
        "prompts": workdir / "prompts.jsonl",
        "eval": workdir / "eval.jsonl",
        "policy": workdir / "policy",
    }
    if is_prepared(workdir):
        return paths
    workdir.mkdir(parents=True, exist_ok=True)
    rows = dot_rows(workdir, NUM_ROWS, seed, split="train")
    write_rows(paths["prompts"], rows)
    write_rows(paths["eval"], dot_rows(workdir, NUM_EVAL_ROWS, seed + 1, split="eval"))
    build_policy(paths["policy"], rows, workdir, seed=seed)
    (workdir / "READY").write_text("ok\n")
    return paths


def prepare_locked(workdir: Path, template) -> dict[str, Path]:
    """`prepare` under the file lock tiny_task uses (the first process builds, others wait)."""
    return locked_build(workdir, template, prepare)
