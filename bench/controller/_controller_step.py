"""bench/controller/controller.py --full-step: one whole GRPO step with a tiny vision-language model, per mode.

Each rank holds the same tiny Qwen2-VL twice, as a step needs it: the built-in rollout engine and a
TorchPolicy under DDP. The prompts are locally drawn images of 1-4 shapes (PNG files that the
JSONL rows point to) with the question "How many shapes?"; the judge is a reward function
(yatt.genrm.RewardFunction: 1 for the right count as the response's first number, 0.2 for any
number, else 0). The random tiny policy samples vision special tokens now and then: a response
ends before one (counted as num_cut_responses), since TorchPolicy refuses an image token that
has no image. One step, per mode:

    yatt-step      every rank: ShardedLoader reads its own rows -> decodes its own images ->
                   image processor -> the trainer's own round (examples/train_grpo.py:
                   generate_and_score, the built-in engine with the images in the requests,
                   each response judged as it lands; to_batch) -> GRPO advantages (a group
                   lives on one rank) -> Batch.rebalance by the policy's costs (images move
                   with the samples the plan moves) -> old logprobs -> train step -> weights
                   to its engine -> all-reduced stats
    driver-step    rank 0 is also the driver of a single-controller framework (a Ray driver in
                   verl), the other ranks its workers: the driver reads every rank's rows,
                   decodes and processes every image (the dataset runs in the driver) and
                   scatters each rank's prompts with their images (pickled, as objects travel);
                   every rank generates its share and sends the completions back; the driver
                   judges all, computes advantages, partitions the samples by cost over the
                   ranks (verl's seqlen balancing) and scatters each rank's training batch
                   (images included); every rank trains, syncs its engine, and sends its
                   metrics to the driver

Generation runs on every rank in both modes (as verl's rollout workers do): what differs is only
where the data goes. Measured per process over the timed steps (after warm-up steps that pay the
one-time costs: AdamW state, lazy imports, allocator growth): peak RSS above its RSS before them,
and on CUDA torch.cuda.max_memory_allocated above the allocation before them.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

IMAGE_SIZE = 448  # pixels per side of each drawn image (RGB uint8: 588 KiB decoded)
QUESTION = "How many shapes are in the image? Answer with a number."
# The tiny VLM's image processor resizes to at most 224 x 224: 16 x 16 patches of 14 pixels
# (1176 floats each: 3 channels x 2 temporal x 14 x 14), 64 image tokens after the 2 x 2 merge.
# Small enough for 2 CPU cores, large enough that a prompt's tensors are not lost in RSS noise.
VLM_PATCH_SIZE = 14
VLM_MAX_PIXELS = 224 * 224
STEP_MODES = ("yatt-step", "driver-step")


def rss_kib(field: str) -> int:
    """A memory field of /proc/self/status in KiB (VmRSS: now, VmHWM: the peak)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak_rss() -> None:
    """Reset VmHWM to the current RSS (Linux >= 4.0), so the peak excludes what came before."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


# -- data and model (the parent process makes them once) ---------------------------------------


def make_shape_dataset(root: Path, num_rows: int, *, seed: int = 0) -> Path:
    """`num_rows` PNG images of 1-4 filled circles and squares, and a JSONL of prompts to them."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    path = root / "shapes.jsonl"
    with open(path, "w") as f:
        for i in range(num_rows):
            image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), tuple(rng.integers(0, 64, 3)))
            draw = ImageDraw.Draw(image)
            num_shapes = int(rng.integers(1, 5))
            for _ in range(num_shapes):
                x, y = rng.integers(0, IMAGE_SIZE - 96, 2)
                size = int(rng.integers(40, 96))
                box = [int(x), int(y), int(x) + size, int(y) + size]
                colour = tuple(int(c) for c in rng.integers(128, 256, 3))
                if rng.random() < 0.5:
                    draw.ellipse(box, fill=colour)
                else:
                    draw.rectangle(box, fill=colour)
            image_path = root / f"shapes{i}.png"
            image.save(image_path)
            row = {"prompt": QUESTION, "image": str(image_path), "answer": str(num_shapes)}
            f.write(json.dumps(row) + "\n")
    return path


def make_vlm(path: Path) -> Path:
    """The tiny Qwen2-VL both modes load, with 224 x 224 images (256 patches each)."""
    from yatt.testing import make_tiny_vlm

    make_tiny_vlm(
        path,
        arch="qwen2_vl",
        patch_size=VLM_PATCH_SIZE,
        min_pixels=56 * 56,
        max_pixels=VLM_MAX_PIXELS,
        max_position_embeddings=512,
    )
    return path


def measure_payload_mib(model_dir: Path, data: Path) -> dict[str, float]:
    """The first row's decoded image and its pixel_values from the model's processor, in MiB."""
    from PIL import Image

    from yatt.core import load_image_processor

    row = json.loads(data.read_text().splitlines()[0])
    with Image.open(row["image"]) as image:
        pixels = np.asarray(image.convert("RGB"))
    out = load_image_processor(model_dir)(images=[pixels], return_tensors="pt")
    return {
        "image_mib": pixels.nbytes / 2**20,
        "pixel_values_mib": out["pixel_values"].float().numpy().nbytes / 2**20,
    }


# -- the judge ---------------------------------------------------------------------------------


def count_reward(prompt: str, response: str, reference: str | None, row: dict) -> float:
    """1 when the response's first number is the shape count, 0.2 for another number, else 0."""
    match = re.search(r"\d+", response)
    if match is None:
        return 0.0
    return 1.0 if match.group() == reference else 0.2


# -- one rank --------------------------------------------------------------------------------
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def trainer() -> Any:
    """examples/train_grpo.py as a module: yatt-step runs the trainer's own round on it."""
    import sys

    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    import train_grpo

    return train_grpo


class _Rank:
    """What a rank loads once: tokenizer, image processor, engine, policy, judge, and what the
    trainer's functions read of a prompt encoder (takes_images, cut_token_ids) and a config
    (data: the rows' prompt and answer fields)."""

    takes_images = True

    def __init__(self, model_dir: str, runtime: Any, *, seed: int) -> None:
        from transformers import AutoTokenizer

        from yatt.core import TorchPolicy, TorchPolicyConfig, load_image_processor
        from yatt.genrm import RewardFunction
        from yatt.placement import Plan
        from yatt.rollout import BuiltinEngine, EngineConfig
        from yatt.testing import VISION_TOKENS

        self.trainer = trainer()  # imported before the measured steps, in both modes
        self.runtime = runtime
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.image_processor = load_image_processor(model_dir)
        self.image_token_id = self.tokenizer.convert_tokens_to_ids("<|image_pad|>")
        self.vision_token_ids = set(self.tokenizer.convert_tokens_to_ids(list(VISION_TOKENS)))
        # A response ends before a sampled vision token (TorchPolicy refuses an image token
        # without its image): generation stops there and the training sample is cut there.
        self.cut_token_ids = tuple(sorted(self.vision_token_ids))
        self.num_cut_responses = 0  # responses cut before a sampled vision token
        # What judge_view reads of the trainer's DataConfig: the rows' question and answer keys.
        self.data = SimpleNamespace(prompt_key="prompt", answer_key="answer")
        engine_config = EngineConfig(
            device=str(runtime.device), dtype="float32", max_seq_len=256, max_batch_size=64
        )
        self.engine = BuiltinEngine(model_dir, config=engine_config)
        self.policy = TorchPolicy(
            TorchPolicyConfig(model_dir=model_dir, parallel="ddp", dtype="float32", lr=1e-3),
            runtime,
        )
        self.judge = RewardFunction(count_reward, name="count")
        # Every role stays awake (nothing sleeps between phases): the bench measures where the
        # data goes, not placement.
        self.plan = Plan.separate(rollout=self.engine, train=self.policy)
        self.seed = seed

    def encode_prompt(self, row: dict) -> Any:
        """A row as the trainer's Prompt: ids (image placeholders expanded), the decoded image
        (the engine's input) and its VisionInputs (the policy's); the row keeps the fields the
        judge reads (the image travels decoded, not twice)."""
        from PIL import Image

        from yatt.core import encode_vision_prompt

        image = row["image"]
        if isinstance(image, list):
            (image,) = image
        if isinstance(image, str):  # a path; a loader that opens images gives PIL images
            image = Image.open(image)
        with image:
            pixels = np.asarray(image.convert("RGB"))  # a fresh HWC uint8 array per row
        content = [{"type": "image"}, {"type": "text", "text": row["prompt"]}]
        text = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        ids, vision = encode_vision_prompt(
            ids, [pixels], image_processor=self.image_processor, image_token_id=self.image_token_id
        )
        judged = {"prompt": row["prompt"], "answer": row["answer"]}
        return self.trainer.Prompt(row=judged, ids=ids, images=[pixels], vision=vision)

    def sampling(self, args: Any, step: int) -> Any:
        from yatt.rollout import SamplingParams

        return SamplingParams(
            n=args.group_size,
            temperature=1.0,
            max_new_tokens=args.max_new_tokens,
            seed=self.seed + step,
            stop_token_ids=self.cut_token_ids,
        )

    def count_cuts(self, completions: list[Any]) -> None:
        self.num_cut_responses += sum(
            any(t in self.vision_token_ids for t in c.response_ids) for c in completions
        )

    def generate(self, prompts: list[Any], args: Any, step: int) -> list[Any]:
        """driver-step: this rank's share generated, each response cut before a vision token."""
        from yatt.rollout import Request

        requests = [Request(prompt_ids=p.ids, images=p.images) for p in prompts]
        completions = self.engine.generate(requests, self.sampling(args, step))
        self.count_cuts(completions)
        return [self._cut_at_vision_token(c) for c in completions]

    def _cut_at_vision_token(self, completion: Any) -> Any:
        cut = next(
            (i for i, t in enumerate(completion.response_ids) if t in self.vision_token_ids), None
        )
        if cut is None:
            return completion
        return dataclasses.replace(
            completion,
            response_ids=completion.response_ids[:cut],
            logprobs=completion.logprobs[:cut],
        )

    def judge_rewards(self, prompts: list[Any], completions: list[Any]) -> list[float]:
        """driver-step: the driver judges every rank's responses (the trainer's judge view)."""
        samples = [
            self.trainer.judge_view(prompts[c.request_index], c, self.tokenizer, self.data)
            for c in completions
        ]
        return [verdict.reward for verdict in self.judge.score(samples)]

    def train(self, batch: Any) -> dict[str, float]:
        """Old logprobs, one optimizer step, then the trained weights into the engine."""
        from yatt.core import PolicyLoss

        batch = batch.to(self.runtime.device)
        batch.tokens["old_logprobs"] = self.policy.logprobs(batch)
        metrics = self.policy.train_step(batch, PolicyLoss())
        self.engine.update_weights(self.policy.named_weights())
        return metrics


def _yatt_step(rank: _Rank, loader: Any, step: int, args: Any) -> dict[str, float]:
    import torch

    from yatt.core import compute_grpo_advantages, reduce_metrics

    prompts = [rank.encode_prompt(row) for row in loader.next_batch()]  # own shard only
    # The trainer's own round: generate -> judge (a reward function scores each response as it
    # lands, as the trainer does without a judge engine) -> training samples, each response
    # cut before a vision token, each sample with its prompt's images.
    scored = rank.trainer.generate_and_score(
        prompts,
        rank.sampling(args, step),
        engine=rank.engine,
        scorer=rank.judge,
        plan=rank.plan,
        tokenizer=rank.tokenizer,
        data=rank.data,
        should_overlap=True,
        timings={},
    )
    rank.count_cuts([item.completion for item in scored])
    rewards = [item.verdict.reward for item in scored]
    batch = rank.trainer.to_batch(scored, rank.runtime, rank)
    del scored
    batch.samples["advantages"] = compute_grpo_advantages(batch["reward"], batch["group_id"])
    me = rank.runtime.dp_rank
    batch.samples["origin_rank"] = torch.full((len(batch),), me)
    costs = rank.policy.estimate_batch_costs(batch)
    # Lengths (costs) cross ranks; the samples the plan moves travel point-to-point.
    batch, _ = batch.rebalance(group=rank.runtime.dp_group, group_key="group_id", costs=costs)
    num_moved_in = int((batch["origin_rank"] != me).sum())
    metrics = rank.train(batch)
    reward = float(np.mean(rewards))
    out = reduce_metrics({"reward": reward, "loss": metrics["loss"]}, group=rank.runtime.dp_group)
    return {**out, "num_moved_in": num_moved_in}


def _training_samples(prompts: list[Any], completions: list[Any], rewards: list[float]):
    from yatt.core import rollout_samples

    return rollout_samples(
        completions,
        rewards,
        [c.request_index for c in completions],
        vision_inputs=[prompts[c.request_index].vision for c in completions],
    )


def _driver_step(rank: _Rank, loader: Any, step: int, args: Any) -> dict[str, float]:
    import torch.distributed as dist

    from yatt.balance import partition
    from yatt.core import compute_grpo_advantages, rollout_batch

    group = rank.runtime.dp_group
    world, me = rank.runtime.dp_size, rank.runtime.dp_rank
    chunks = None
    if me == 0:  # the driver: every rank's rows, images and processor outputs
        prompts = [rank.encode_prompt(row) for row in loader.next_batch()]
        chunks = [prompts[r::world] for r in range(world)]
    received: list[Any] = [None]
    dist.scatter_object_list(received, chunks, src=0, group=group)
    mine = received[0]
    completions = rank.generate(mine, args, step)
    gathered = [None] * world if me == 0 else None
    dist.gather_object(completions, gathered, dst=0, group=group)
    del received, mine, completions
    batches = None
    if me == 0:  # the driver judges, computes advantages and balances everything
        samples, rewards = [], []
        for r in range(world):
            local_rewards = rank.judge_rewards(chunks[r], gathered[r])
            local = _training_samples(chunks[r], gathered[r], local_rewards)
            for sample in local:
                sample["group_id"] += r * args.prompts_per_rank  # unique over the ranks
            samples += local
            rewards += local_rewards
        full = rollout_batch(samples)
        advantages = compute_grpo_advantages(full["reward"], full["group_id"])
        costs = rank.policy.estimate_batch_costs(full)
        parts = partition(costs, world, groups=full["group_id"].tolist())
        batches = []
        for part in parts:
            batch = rollout_batch([samples[i] for i in part])
            batch.samples["advantages"] = advantages[part]
            batches.append(batch)
        del full, samples
    received = [None]
    dist.scatter_object_list(received, batches, src=0, group=group)
    del batches, chunks, gathered
    metrics = rank.train(received[0])
    del received
    stats = [None] * world if me == 0 else None
    dist.gather_object(metrics, stats, dst=0, group=group)
    reward = float(np.mean(rewards)) if me == 0 else float("nan")
    loss = float(np.mean([s["loss"] for s in stats])) if me == 0 else 0.0
    return {"reward": reward, "loss": loss, "num_moved_in": 0}  # the driver placed every sample


def run_worker(mode: str, data: str, out: str, args: Any) -> None:
    """One rank of `mode` (see the module docstring); writes out/rank<r>.json."""
    import torch
    import torch.distributed as dist

    from yatt.core import ShardedLoader, init_runtime

    if mode not in STEP_MODES:
        raise ValueError(f"mode={mode!r}: use one of {STEP_MODES}")
    with init_runtime(device=args.device) as rt:
        rank, world = rt.dp_rank, rt.dp_size
        is_cuda = rt.device.type == "cuda"
        state = _Rank(args.model_dir, rt, seed=1000 * rank)
        loader = None
        if mode == "yatt-step":
            loader = ShardedLoader(
                data,
                batch_size=args.prompts_per_rank,
                rank=rank,
                world_size=world,
                image_key="image",
                required_keys=("answer",),
            )
        elif rank == 0:
            loader = ShardedLoader(
                data,
                batch_size=args.prompts_per_rank * world,
                image_key="image",
                required_keys=("answer",),
            )
        step_fn = _yatt_step if mode == "yatt-step" else _driver_step
        times, rewards, moved_in = [], [], []  # moved_in: samples balancing brought
        for step in range(args.warmup + args.steps):
            if step == args.warmup:  # the measured window starts here, on every rank at once
                dist.barrier()
                if is_cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    start_gpu = torch.cuda.memory_allocated()
                start_rss = rss_kib("VmRSS")
                reset_peak_rss()
            t0 = time.perf_counter()
            metrics = step_fn(state, loader, step, args)
            dist.barrier()
            if step >= args.warmup:
                times.append(time.perf_counter() - t0)
                rewards.append(metrics["reward"])
                moved_in.append(metrics["num_moved_in"])
        result: dict[str, Any] = {
            "rank": rank,
            "peak_above_start_mib": (rss_kib("VmHWM") - start_rss) / 1024,
            "times": times,
            "rewards": rewards,
            "num_cut_responses": state.num_cut_responses,
            "moved_in": moved_in,
        }
        if is_cuda:
            torch.cuda.synchronize()
            result["gpu_peak_above_start_mib"] = (
                torch.cuda.max_memory_allocated() - start_gpu
            ) / 2**20
            result["gpu_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
        state.judge.close()


def busiest_process(mode: str, world: int, ranks: list[dict], first_step: int = 0) -> dict:
    """The fields every controller run reports from its ranks' JSON: peak host memory per
    rank and the busiest one, the median step time (the slowest rank's, from `first_step`)
    and the most samples a rank received in one step."""
    peaks = [r["peak_above_start_mib"] for r in ranks]
    num_steps = len(ranks[0]["times"])
    step_times = [max(r["times"][s] for r in ranks) for s in range(first_step, num_steps)]
    return {
        "mode": mode,
        "ranks": world,
        "busiest_peak_mib": max(peaks),
        "busiest_rank": int(np.argmax(peaks)),
        "per_rank_peak_mib": peaks,
        "step_s": float(np.median(step_times)),
        "max_moved_in_per_step": max((max(r["moved_in"], default=0) for r in ranks), default=0),
    }


def summarize_launch(mode: str, world: int, ranks: list[dict]) -> dict:
    """One (mode, world) full-step run from its ranks' JSON: the busiest process, the step
    time, the reward and the responses cut at a vision token."""
    out = busiest_process(mode, world, ranks)
    out["reward"] = float(np.nanmean([x for r in ranks for x in r["rewards"]]))
    out["num_cut_responses"] = sum(r["num_cut_responses"] for r in ranks)
    if "gpu_peak_mib" in ranks[0]:
        out["per_rank_gpu_peak_above_start_mib"] = [r["gpu_peak_above_start_mib"] for r in ranks]
        out["per_rank_gpu_peak_mib"] = [r["gpu_peak_mib"] for r in ranks]
    return out
