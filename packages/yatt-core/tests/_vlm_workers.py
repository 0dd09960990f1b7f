"""Vision-language policy scenarios, one process per rank (see test_vlm_policy.py).

    python _vlm_workers.py OUT_DIR KWARGS_JSON     (torchrun-style env vars set)

Builds the same global batch of image and text samples on every rank, keeps this rank's
shard, rebalances it across ranks (the images travel with their samples), then runs the
logprobs pass and one train step; rank R writes OUT_DIR/rank{R}.pt.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from yatt.core import (
    VISION_INPUTS_KEY,
    Batch,
    PolicyLoss,
    TorchPolicy,
    TorchPolicyConfig,
    compute_grpo_advantages,
    encode_vision_prompt,
    init_runtime,
    load_image_processor,
    rollout_batch,
    rollout_samples,
)

# Images per prompt of the global batch (0: text only); two completions per prompt.
IMAGES_PER_PROMPT = (1, 0, 2, 1, 0, 1)
# Rank 1 holds only text samples at first: its micro-batches run the dummy image until the
# rebalance brings it images.
SHARDS = {1: [list(range(12))], 2: [[0, 1, 4, 5, 6, 7, 10, 11], [2, 3, 8, 9]]}


class _Completion:
    def __init__(self, prompt_ids: list[int], response_ids: list[int]) -> None:
        self.prompt_ids = prompt_ids
        self.response_ids = response_ids
        self.logprobs = [-1.5] * len(response_ids)


def make_global_batch(
    model_dir: str, images_per_prompt: tuple[int, ...] = IMAGES_PER_PROMPT, seed: int = 0
) -> Batch:
    """Two samples per prompt with images of different sizes, and advantages. Without any
    image, the samples carry no vision_inputs field at all (a text-only trainer's batch)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    image_processor = load_image_processor(model_dir)
    image_token_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    rng = np.random.default_rng(seed)
    completions, visions = [], []
    for p, num_images in enumerate(images_per_prompt):
        content = [{"type": "image"}] * num_images + [{"type": "text", "text": f"count {p}"}]
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer(ids, add_special_tokens=False)["input_ids"]
        vision = None
        if num_images:
            images = [
                rng.integers(0, 256, (8 + 8 * ((p + k) % 3), 16, 3), dtype=np.uint8)
                for k in range(num_images)
            ]
            ids, vision = encode_vision_prompt(
                ids, images, image_processor=image_processor, image_token_id=image_token_id
            )
        for s in range(2):
            response = rng.integers(10, 200, 3 + 2 * s + p % 3).tolist()
            completions.append(_Completion(list(ids), response))
            visions.append(vision)
    rewards = rng.random(len(completions)).tolist()
    groups = [i // 2 for i in range(len(completions))]
    if not any(images_per_prompt):
        visions = None
    samples = rollout_samples(completions, rewards, groups, vision_inputs=visions)
    for i, sample in enumerate(samples):
        sample["sample_id"] = i
    batch = rollout_batch(samples)
    batch.samples["advantages"] = compute_grpo_advantages(batch["reward"], batch["group_id"])
    return batch


def policy_config(model_dir: str, parallel: str, max_tokens: int, **overrides) -> TorchPolicyConfig:
    return TorchPolicyConfig(
        model_dir=model_dir,
        lr=1e-3,
        grad_clip=None,
        dtype="float32",
        parallel=parallel,
        max_tokens_per_microbatch=max_tokens,
        **overrides,
    )


def run_step(policy: TorchPolicy, batch: Batch) -> dict:
    # Micro-batches without an image (dummies included) run the tower on a dummy image.
    bins = policy.plan_micro_batches(batch)  # collective under FSDP2, as in the step
    visions = batch[VISION_INPUTS_KEY] if VISION_INPUTS_KEY in batch else [None] * len(batch)
    num_text_only = sum(all(visions[i] is None for i in index) for index in bins)
    batch.tokens["old_logprobs"] = policy.logprobs(batch)
    metrics = policy.train_step(batch, PolicyLoss(clip_high=0.28))
    weights = {name: t.cpu().clone() for name, t in policy.named_weights()}
    return {
        "metrics": metrics,
        "weights": weights,
        "old_logprobs": batch["old_logprobs"],
        "sample_ids": batch["sample_id"].tolist(),
        "num_text_only_micro_batches": num_text_only,
    }


def main() -> None:
    out_dir, kwargs = Path(sys.argv[1]), json.loads(sys.argv[2])
    model_dir, runs = kwargs["model_dir"], kwargs["runs"]
    out: dict = {}
    with init_runtime(seed=0) as rt:
        full = make_global_batch(model_dir)
        local = full.select(SHARDS[rt.dp_size][rt.dp_rank])
        out["own_ids"] = local["sample_id"].tolist()
        for parallel, should_train_vision in runs:
            policy = TorchPolicy(
                policy_config(
                    model_dir, parallel, max_tokens=120, should_train_vision=should_train_vision
                ),
                rt,
            )
            lengths = local.lengths.tolist()
            from yatt.core import image_patches_of

            costs = policy.estimate_costs(lengths, image_patches=image_patches_of(local))
            batch, _ = local.rebalance(group=rt.dp_group, group_key="group_id", costs=costs)
            # The images arrived with their samples, bit for bit.
            by_id = dict(zip(full["sample_id"].tolist(), full[VISION_INPUTS_KEY], strict=True))
            for sample_id, vision in zip(
                batch["sample_id"].tolist(), batch[VISION_INPUTS_KEY], strict=True
            ):
                expected = by_id[sample_id]
                assert (vision is None) == (expected is None), sample_id
                if vision is not None:
                    assert torch.equal(vision.pixel_values, expected.pixel_values)
                    assert torch.equal(vision.image_grid_thw, expected.image_grid_thw)
            out[parallel, should_train_vision] = run_step(policy, batch)
        dist.barrier()
        torch.save(out, out_dir / f"rank{rt.rank}.pt")


if __name__ == "__main__":
    main()
