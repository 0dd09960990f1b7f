"""The reference trainer's config: its sections, their checks, and reading them from the CLI.

    cfg, args = read_config(sys.argv[1:])      # args: --resume, --export, --step

`--config run.yaml` gives fields as YAML and `key.sub=value` arguments override them (read by
yatt.core's config family: duplicate keys, malformed files and alias bombs refused by file and
line; an override's " #" kept as typed). The whole config is built and checked before the
runtime, models or engines start: values are typed (exact conversions only), every number
in a range that fits what it controls, unknown keys refused with the closest known one. This module only reads values: it opens no
file (but --config's), imports no task or reward module and reads no environment. What the
values point at (folders, reward modules, API keys, installed engines, checkpoints) is
checked by grpo_preflight.preflight, first in main; empty paths (policy.model_dir, data.path,
reward.judge_dir, eval.path) point at the embedded task that `task` names ("text",
"vision" or "tools", examples/tasks/), which preflight builds under out_dir once, then reuses.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import logging
import math
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path, PurePath
from typing import Any, ClassVar

from grpo_data import SAMPLE_FIELDS

from yatt import core, genrm, rollout
from yatt.ckpt import CkptConfig

logger = logging.getLogger("train_grpo")
EXPORT_DTYPES = ("", "float32", "bfloat16", "float16")
POLICY_CONFIGS = {"torch": core.TorchPolicyConfig, "megatron": core.MegatronPolicyConfig}


@dataclass(frozen=True)
class EmbeddedTask:
    """What the config knows of an embedded task (examples/tasks/ builds it, in preflight)."""

    folder: str  # where under out_dir it is built
    columns: tuple[str, ...]  # the fields of its rows (a judge template may read them)
    image_key: str = ""  # the rows' image field; "" = text prompts
    has_judge: bool = True  # a judge model is built with it (else its reward is a rule)
    # Config defaults under task=<name> (a run's own values win).
    defaults: Mapping[str, Any] = field(default_factory=dict)


# The embedded tasks' folder (examples/tasks/): named here, imported only by preflight.
TASKS_DIR = Path(__file__).resolve().parent / "tasks"
# The demo's own values (a tiny policy answering single-digit sums in a few tokens), in force
# only under task=<name>; a run of your own model starts from the defaults of the fields.
DEMO_DEFAULTS: Mapping[str, Any] = {
    "policy": {"lr": 2e-3, "dtype": "float32", "max_tokens_per_microbatch": 512},
    "rollout": {"max_new_tokens": 4, "engine": {"max_seq_len": 64}},
    "reward": {
        "engine": {"max_seq_len": 96},
        "judge_template": "{prompt}{response} ref {reference}",
        "accuracy": "exact_match",  # the sum is right or not: reward/accuracy
    },
}
EMBEDDED_TASKS = {
    "text": EmbeddedTask(folder="embedded", columns=("prompt", "answer"), defaults=DEMO_DEFAULTS),
    "vision": EmbeddedTask(
        folder="embedded-vision",
        columns=("prompt", "image", "answer"),
        image_key="image",
        has_judge=False,  # the exact-match rule is the reward
        defaults={
            **DEMO_DEFAULTS,
            "reward": {**DEMO_DEFAULTS["reward"], "backend": "none", "rule_weight": 1.0},
        },
    ),
    # Guess a number with a `guess` tool (examples/tasks/tools_task.py): multi-turn, the
    # environment's get_reward() is the reward; these are that task's values.
    "tools": EmbeddedTask(
        folder="embedded-tools",
        columns=("prompt", "secret"),
        has_judge=False,
        defaults={
            # lr 2e-3 (the text demo's) loses the tool-call format within 3 steps; 2e-4 learns
            # slowly (reward 0.29 -> 0.37 over 30 steps), 6e-4: 0.31 -> 0.45 over 40
            "policy": {"lr": 6e-4, "dtype": "float32", "max_tokens_per_microbatch": 4096},
            "data": {"prompts_per_rank": 8},
            # evaluate() is single-turn: held-out games need the multi-turn kind there too
            "eval": {"every_steps": 0},
            "rollout": {
                "environment": [f"{TASKS_DIR / 'guess_env.py'}:GuessEnv"],
                "samples_per_prompt": 8,
                "max_new_tokens": 96,  # one turn: a tool call is about 60 tokens
                "max_turns": 4,  # binary search over 0..7 needs at most 4 guesses
                "max_trajectory_tokens": 480,
                "tool_timeout_s": 10.0,
                "max_tool_output_tokens": 16,
                "max_sampling_rounds": 4,
                "engine": {"max_seq_len": 512},  # the tiny policy's positions
            },
            # the environment's reward (rollout.env_reward_weight) and a function over the
            # whole trajectory: -0.1 per failed tool call
            "reward": {
                "backend": "none",
                "rule_weight": 0.0,
                "functions": [f"{TASKS_DIR / 'guess_env.py'}:tool_error_penalty"],
                "function_weights": [0.1],
            },
        },
    ),
}
# --help lines for TorchPolicyConfig's memory options, whose own comments run to several lines.
POLICY_HELP = {
    "max_tokens_per_microbatch": (
        "cap per forward/backward on padded tokens; null = chosen from the GPU's free memory "
        "at the first train step (8192 on CPU)"
    ),
    "gradient_checkpointing": (
        "recompute each decoder layer in backward: ~1/10 of the activations, ~1/3 more compute"
    ),
    "should_offload_optimizer": (
        "AdamW's state in pinned host memory except during the optimizer step (large "
        "policies on one GPU beside their engines)"
    ),
}
# Upper bounds on sizes that multiply the run's work; past them a typo (votes=1e9), not a plan.
# Group sizes in published GRPO/DAPO runs are 4-64 (a few use 256-512): 1024 leaves room.
MAX_SAMPLES_PER_PROMPT = 1024
# Dynamic sampling's draw factor: at 64 prompts per kept group the reward is nearly constant.
MAX_OVERSAMPLE = 64.0
ON_UNFILLED = ("train", "error")  # core.DynamicSampler's on_unfilled
SAMPLING_MODES = ("rounds", "stream")  # core.DynamicSampler's mode
# Seeds fit a signed 32-bit int: what numpy's legacy seeding, torch and the serving engines take.
MAX_SEED = 2**31 - 1
# The policy's logprobs divide the logits by the sampling temperature: below this they overflow
# or every group is greedy (no reward variance, every step skipped); past the top, noise.
MIN_TEMPERATURE, MAX_TEMPERATURE = 0.01, 10.0
# Rollout rounds per step: each is a whole generate + judge; a step of 64 is already stuck.
MAX_SAMPLING_ROUNDS = 64


def check_at_least(name: str, value: float, minimum: float) -> None:
    if value < minimum:
        raise ValueError(f"{name}={value!r}: must be >= {minimum}")


def check_at_most(name: str, value: float, maximum: float, why: str) -> None:
    if value > maximum:
        raise ValueError(f"{name}={value!r}: must be <= {maximum} ({why})")


@dataclass(kw_only=True)
class DataConfig:
    path: str = ""  # JSONL/Parquet prompts; "" = the embedded task's prompts
    prompt_key: str = "prompt"  # row field holding the prompt: text or [{role, content}, ...]
    answer_key: str = "answer"  # row field holding the reference answer ("" = none)
    # A split of a `datasets` DatasetDict saved with save_to_disk: read path/split.
    split: str = ""
    prompts_per_rank: int = 8  # GRPO groups per rank per step
    # Message lists always go through the policy's chat template; True: plain text too.
    apply_chat_template: bool = False
    # Row field holding the prompt's image(s): a path (relative to the data file), bytes, a
    # `datasets` Image, or a list of them; needs a vision-language policy. "" = text prompts.
    image_key: str = ""
    max_images: int = 4  # rows with more images are skipped (data/skipped_rows/too_many_images)
    max_image_pixels: int = 4096 * 4096  # rows with a larger image (width x height) are skipped
    # Rows are measured before they are read whole or tokenized; past these, counted skips.
    max_row_bytes: int = 64 << 20  # a longer JSONL line is skipped unread (too_long)
    # A prompt of more UTF-8 bytes is skipped before the tokenizer sees it (too_long);
    # 0 = 128 bytes per token of rollout.engine.max_seq_len - rollout.max_new_tokens.
    max_prompt_bytes: int = 0
    max_image_bytes: int = 32 << 20  # a larger image file is skipped unread (image_too_large)
    # Keyword arguments of the policy's chat template, e.g. {enable_thinking: false} (Qwen3).
    chat_template_kwargs: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_at_least("data.prompts_per_rank", self.prompts_per_rank, 1)
        check_at_least("data.max_images", self.max_images, 1)
        check_at_least("data.max_image_pixels", self.max_image_pixels, 1)
        check_at_least("data.max_row_bytes", self.max_row_bytes, 1)
        check_at_least("data.max_prompt_bytes", self.max_prompt_bytes, 0)
        check_at_least("data.max_image_bytes", self.max_image_bytes, 1)
        check_split("data", self.path, self.split)
        kwargs = self.chat_template_kwargs
        if not isinstance(kwargs, Mapping) or not all(isinstance(key, str) for key in kwargs):
            raise ValueError(
                f"data.chat_template_kwargs={kwargs!r}: a mapping of the chat template's "
                "keyword arguments, e.g. {enable_thinking: false}"
            )


def check_split(section: str, path: str, split: str) -> None:
    """A split names a folder of a DatasetDict saved with save_to_disk: it needs that folder
    (preflight reads path/split, naming the splits there when it has none such)."""
    if split and not path:
        raise ValueError(f"{section}.split={split!r} needs {section}.path (a save_to_disk folder)")


@dataclass(kw_only=True)
class RolloutConfig(rollout.EngineSpec):
    """The rollout: its engine (rollout.EngineSpec's backend, engine and backend_options:
    checked and built by yatt-rollout), GRPO's group size and dynamic sampling."""

    section: ClassVar[str] = "rollout"  # errors name rollout.backend, rollout.engine.*

    samples_per_prompt: int = 8  # GRPO group size n
    temperature: float = 1.0  # sampling temperature; the policy's logprobs use the same
    top_p: float = 1.0  # nucleus sampling: the smallest set of tokens of this mass; 1 = off
    top_k: int = 0  # sample among the k likeliest tokens; 0 = off
    min_p: float = 0.0  # tokens below min_p x the top token's probability dropped; 0 = off
    repetition_penalty: float = 1.0  # logits of tokens already seen divided by it; 1 = off
    max_new_tokens: int = 1024  # response length cap (tokens)
    max_sampling_rounds: int = 3  # DAPO dynamic sampling: rollout rounds to fill the batch
    # Dynamic sampling's draw (core.DynamicSampler): prompts per missing group at first, then
    # adapted to the keep rate up to max_oversample (1.0 and 1.0: exactly the missing number).
    oversample: float = 1.0  # prompts drawn per missing group before a keep rate is known
    max_oversample: float = 1.0  # the adapted factor's ceiling (>= oversample)
    # null: draw (rounds) or keep in flight (stream) the expected number of groups, which fills
    # the batch about half the time; q in (0, 1), e.g. 0.9: the fewest that fill it with
    # probability q at the keep rate, up to max_oversample x missing (a stream: over-sample
    # and cut the long tail).
    fill_probability: float | None = None  # null: the mean; q in (0, 1): fills with probability q
    on_unfilled: str = "train"  # unfilled after max_sampling_rounds: "train" on it, or "error"
    # "rounds": generate, judge, keep, per round. "stream" (placement=partial/separate): prompts
    # keep entering the engine while verdicts come back; once every rank has its groups the
    # rollout and the judge are aborted (the long tail cut, counted).
    sampling_mode: str = "rounds"  # "rounds" or "stream" (placement=partial or separate)
    # stream: the groups the abort cut are finished first in the next step, their old tokens
    # and logprobs kept (off-policy by a step: needs loss.rollout_correction); else dropped.
    keep_partial: bool = False
    # Off-policy steps (issue 48): rollout and judge of the next prompts run in worker threads
    # while the trainer trains, under weights up to max_staleness versions (steps) old; each
    # token keeps the version that sampled it, the loss weighs it by pi_prox / pi_behaviour
    # (loss.rollout_correction). 0: today's on-policy step. Needs placement='partial' (or
    # 'separate': the trainer on its GPU, the engines on theirs),
    # backend='torch', loss.old_logprobs_from='trainer'; refuses keep_partial and stream.
    # Multi-turn (environment/tools): each turn's tokens keep the version that ran the turn.
    max_staleness: int = 0
    # -- multi-turn environments and tools (yatt.rollout.env); either set: the multi-turn
    # rollout kind (rollout_multiturn in grpo_multiturn.py), rounds of whole trajectories, or with
    # sampling_mode=stream each trajectory judged as it ends and the tail cut.
    # "my_env.py:MathEnv" (one instance per trajectory: reset(**row), public methods are
    # tools, optional get_reward()), several routed by the row field `route_key`.
    environment: list = field(default_factory=list)
    tools: list = field(default_factory=list)  # plain function tools: ["my_tools.py:search"]
    max_turns: int = 4  # assistant turns per trajectory (the last one's tool calls still run)
    max_trajectory_tokens: int = 2048  # prompt + turns + observations (< engine.max_seq_len)
    tool_timeout_s: float = 10.0  # one tool call (or reset/get_reward); then an error observation
    max_tool_output_bytes: int = 8192  # a tool's output cut to this many UTF-8 bytes ...
    max_tool_output_tokens: int = 512  # ... then to this many tokens
    tool_parser: str = "hermes"  # how calls are read: "hermes" (<tool_call>{json}</tool_call>)
    route_key: str = ""  # the row field naming the environment class when several are listed
    env_reward_weight: float = 1.0  # get_reward()'s weight, added to reward.* (judge, functions)

    @property
    def is_multiturn(self) -> bool:
        """An environment or tools are set: the trainer's rollout kind is the multi-turn one."""
        return bool(self.environment or self.tools)

    def env_config(self, chat_template_kwargs: dict | None = None) -> rollout.EnvConfig:
        """The package's EnvConfig from these fields and the chat template's keyword arguments
        (data.chat_template_kwargs, as the single-turn prompts get them); its errors name
        rollout.<field>."""
        try:
            return rollout.EnvConfig(
                environment=tuple(self.environment),
                tools=tuple(self.tools),
                max_turns=self.max_turns,
                max_trajectory_tokens=self.max_trajectory_tokens,
                tool_timeout_s=self.tool_timeout_s,
                max_tool_output_bytes=self.max_tool_output_bytes,
                max_tool_output_tokens=self.max_tool_output_tokens,
                tool_parser=self.tool_parser,
                route_key=self.route_key,
                chat_template_kwargs=dict(chat_template_kwargs or {}),
            )
        except ValueError as exc:
            raise ValueError(str(exc).replace("EnvConfig.", "rollout.")) from None

    def check_environment(self) -> None:
        """What rollout.environment and rollout.tools point at: each spec imports, every
        environment has tools, every tool has type hints and a docstring, no two share a name
        (ValueError naming the field); nothing when neither is set."""
        if not self.is_multiturn:
            return
        from yatt.rollout.env import build_env_kinds

        try:
            build_env_kinds(tuple(self.environment), tuple(self.tools))
        except ValueError as exc:
            raise ValueError(str(exc).replace("EnvConfig.", "rollout.")) from None

    def __post_init__(self) -> None:
        super().__post_init__()  # the engine: backend, options, sizes
        if not math.isfinite(self.env_reward_weight):
            raise ValueError(
                f"rollout.env_reward_weight={self.env_reward_weight!r}: must be a finite number"
            )
        if self.is_multiturn:
            self.env_config()  # max_turns >= 1, limits, parser known: before any model loads
            # stream (placement=partial): each trajectory judged as it ends, the tail cut once
            # every rank is full; a cut trajectory is dropped (its environment's state would
            # have to travel with it), so nothing is kept to resume
            if self.keep_partial:
                raise ValueError(
                    "rollout.keep_partial=True with rollout.environment or rollout.tools: a "
                    "multi-turn trajectory the stream cuts is dropped (counted), not resumed; "
                    "set rollout.keep_partial=false"
                )
            if self.max_trajectory_tokens >= self.engine.max_seq_len:
                raise ValueError(
                    f"rollout.max_trajectory_tokens={self.max_trajectory_tokens} does not fit "
                    f"rollout.engine.max_seq_len={self.engine.max_seq_len}: lower it or raise "
                    "rollout.engine.max_seq_len"
                )
        # GRPO's advantage is a sample's reward against its group's: one sample has none.
        check_at_least("rollout.samples_per_prompt", self.samples_per_prompt, 2)
        check_at_most(
            "rollout.samples_per_prompt",
            self.samples_per_prompt,
            MAX_SAMPLES_PER_PROMPT,
            "responses per prompt and step; GRPO groups are 4-64 in practice",
        )
        if not MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(
                f"rollout.temperature={self.temperature!r}: must be in [{MIN_TEMPERATURE}, "
                f"{MAX_TEMPERATURE}] (the policy's logprobs divide by it; GRPO needs varied "
                "samples: 0.6-1.0 is usual)"
            )
        self.check_sampling_knobs()
        check_at_least("rollout.max_new_tokens", self.max_new_tokens, 1)
        if self.max_new_tokens >= self.engine.max_seq_len:
            raise ValueError(
                f"rollout.max_new_tokens={self.max_new_tokens} leaves no room for a prompt in "
                f"rollout.engine.max_seq_len={self.engine.max_seq_len} (prompt + response "
                "tokens): raise rollout.engine.max_seq_len or lower rollout.max_new_tokens"
            )
        check_at_least("rollout.max_sampling_rounds", self.max_sampling_rounds, 1)
        check_at_most(
            "rollout.max_sampling_rounds",
            self.max_sampling_rounds,
            MAX_SAMPLING_ROUNDS,
            "rollout rounds per step, each a whole generate and judge",
        )
        check_at_least("rollout.oversample", self.oversample, 1.0)
        check_at_least("rollout.max_oversample", self.max_oversample, self.oversample)
        check_at_most(
            "rollout.max_oversample",
            self.max_oversample,
            MAX_OVERSAMPLE,
            "prompts drawn per missing group; past it most of the rollout is thrown away",
        )
        if self.fill_probability is not None and not 0 < self.fill_probability < 1:
            raise ValueError(
                f"rollout.fill_probability={self.fill_probability!r}: must be null (draw the "
                "expected number of groups) or in (0, 1), e.g. 0.9"
            )
        if self.on_unfilled not in ON_UNFILLED:
            raise ValueError(f"rollout.on_unfilled={self.on_unfilled!r}: use one of {ON_UNFILLED}")
        if self.sampling_mode not in SAMPLING_MODES:
            raise ValueError(
                f"rollout.sampling_mode={self.sampling_mode!r}: use one of {SAMPLING_MODES}"
            )
        if not isinstance(self.keep_partial, bool):
            raise ValueError(f"rollout.keep_partial={self.keep_partial!r}: must be true or false")
        if self.keep_partial and self.sampling_mode != "stream":
            raise ValueError(
                "rollout.keep_partial=True resumes what a stream's abort cut: set "
                "rollout.sampling_mode='stream' (rounds abort nothing)"
            )

    def check_sampling_knobs(self) -> None:
        """top_p, top_k, min_p, repetition_penalty in range, and taken by this backend."""
        self.sampling_knobs()

    def sampling_knobs(self) -> dict[str, Any]:
        """The rollout's sampling knobs as rollout.SamplingParams fields (checked)."""
        return self.sampling_kwargs(
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
        )

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt the rollout takes: its context less the response's room."""
        return self.engine.max_seq_len - self.max_new_tokens


@dataclass(kw_only=True)
class RewardConfig(genrm.JudgeSpec):
    """The reward: genrm.JudgeSpec's fields (the judge's backend and engine, template, verdict
    format, votes, reward functions, rule, endpoint), checked and built by yatt-genrm."""

    section: ClassVar[str] = "reward"  # errors name reward.backend, reward.votes, ...

    # The judge's model directory (a local folder or a Hub id in the HF cache); under task=<name>
    # "" = the embedded task's judge. "policy": a self-judging GenRM, the policy's base model on
    # the policy's engine with the LoRA adapter off (no second copy of the weights); needs
    # policy.lora, rollout.backend=builtin and rollout.engine.lora_mode=beside (reward.engine
    # is then unused: the judge shares rollout.engine's context and slots).
    judge_dir: str = ""


@dataclass(kw_only=True)
class EvalConfig:
    every_steps: int = 20  # evaluate after every N steps and after the last (0: never)
    # Held-out prompts (JSONL, Parquet, save_to_disk folder); "" = the embedded task's eval
    # split when data.path is the embedded task's too, else no evaluation.
    path: str = ""
    split: str = ""  # a split of a DatasetDict saved with save_to_disk: read path/split
    num_prompts: int = 64  # the file's first prompts, shared over the ranks
    samples_per_prompt: int = 1  # responses per prompt
    temperature: float = 0.0  # 0: greedy; above it, rollout.top_p/top_k/min_p/... apply too

    def __post_init__(self) -> None:
        check_at_least("eval.every_steps", self.every_steps, 0)
        check_at_least("eval.num_prompts", self.num_prompts, 1)
        check_at_least("eval.samples_per_prompt", self.samples_per_prompt, 1)
        check_at_most(
            "eval.samples_per_prompt",
            self.samples_per_prompt,
            MAX_SAMPLES_PER_PROMPT,
            "responses per held-out prompt",
        )
        check_at_least("eval.temperature", self.temperature, 0.0)
        check_split("eval", self.path, self.split)


@dataclass(kw_only=True)
class ExportConfig:
    # The final policy as a Hugging Face folder (config, safetensors, tokenizer, generation
    # config): a folder name under out_dir, replaced only if it is yatt's earlier export; "" =
    # none. `--export` writes one from a checkpoint.
    dir: str = "export"
    dtype: str = ""  # "float32", "bfloat16" or "float16"; "" = the model's own

    def __post_init__(self) -> None:
        if self.dtype not in EXPORT_DTYPES:
            raise ValueError(f"export.dtype={self.dtype!r}: use one of {EXPORT_DTYPES}")
        if self.dir:
            check_export_name(self.dir)


RESOLVED_CONFIG_NAME = "config.yaml"  # the run's resolved config (see RESOLVED_CONFIG)
# What the trainer writes under out_dir besides the export (embedded tasks, checkpoints,
# RunLog's metrics, TensorBoard and W&B): an export there would replace or hide them.
RUN_OUTPUTS = (
    "checkpoints",
    "tensorboard",
    "wandb",
    "metrics.jsonl",
    "metrics.png",
    "wandb_run_id",
    RESOLVED_CONFIG_NAME,
    *(task.folder for task in EMBEDDED_TASKS.values()),
)


def check_export_name(name: str) -> None:
    """export.dir is one plain folder name under out_dir: replacing the folder (the end of a
    run, `--export`) must never reach outside out_dir or into what the run itself wrote."""
    problem = ""
    if name in (".", "..") or name.startswith("."):
        problem = "a plain folder name (not '.', '..' or hidden)"
    elif PurePath(name).is_absolute() or PurePath(name).name != name or "\\" in name:
        problem = "a folder name under out_dir, not a path"
    elif name in RUN_OUTPUTS:
        problem = f"the run writes {name!r} itself ({', '.join(RUN_OUTPUTS)})"
    if problem:
        raise ValueError(f"export.dir={name!r}: {problem}; use e.g. 'export', or '' for none")


@dataclass(kw_only=True)
class LogConfig:
    wandb_project: str = ""  # also log to Weights & Biases (pip install wandb); "" = no
    # Warn about failed judge verdicts at most once per this many steps (counts are metrics).
    warn_every_steps: int = 20

    def __post_init__(self) -> None:
        check_at_least("log.warn_every_steps", self.warn_every_steps, 1)


@dataclass(kw_only=True)
class TrainConfig:
    # "" (the default once policy.model_dir or data.path is given): your own model and data,
    # every path required and no demo values. "text" (single-digit addition, a tiny LM and
    # judge) or "vision" (count the dots in 32 x 32 pictures, a tiny Qwen2-VL): the embedded
    # demo, its own defaults (lr 2e-3, max_new_tokens 4, ...) and its models for empty paths;
    # "text" when no path is given at all.
    task: str = ""
    seed: int = 0  # seeds the data order, the rollouts and the models (0 .. 2**31 - 1)
    num_steps: int = 120  # GRPO steps (0: build the embedded task and stop)
    # Stop (an error naming the cause) after this many steps in a row that updated nothing:
    # no group with reward variance, or a skipped non-finite step. 0: never stop for it.
    max_idle_steps: int = 20
    out_dir: str = "runs/grpo"  # metrics, plot and checkpoints
    # "full": phases in turn; "partial": rollout + GenRM resident; "separate": rollout and
    # GenRM on GPUs of their own (rank r trains on GPU r, its engines run on GPU r + ranks per
    # node; weights copied GPU to GPU after each step), every role awake
    placement: str = "full"
    offload: str = "always"  # "auto": a role sleeps only when the next phase would not fit
    backend: str = "torch"  # policy backend: "torch" or "megatron" (CUDA; yatt-core[megatron])
    # The backend's config fields (TorchPolicyConfig or MegatronPolicyConfig): checked here by
    # name and type, built into that class by preflight once policy.model_dir is a folder (the
    # class reads it), its temperature then taken from rollout.temperature.
    policy: dict | core.TorchPolicyConfig | core.MegatronPolicyConfig = field(default_factory=dict)
    # The RL objective and its update: DAPO's token-mean loss, clip 0.2/0.28. One optimizer
    # step per batch by default, on-policy (old logprobs from the loss's own forward); with
    # loss.num_mini_batches x loss.num_epochs > 1, loss.is_on_policy defaults to False and the
    # trainer computes the old logprobs once, before the first update. With
    # loss.old_logprobs_from=engine they are the engine's (no forward), and is_on_policy and
    # rollout_correction default to False and 'none' (a rollout correction is refused).
    loss: core.PolicyLoss = field(
        default_factory=lambda: core.PolicyLoss(objective="dapo", is_on_policy=True)
    )
    # Responses cut at rollout.max_new_tokens: DAPO's soft punishment and overlong filter.
    overlong: core.OverlongConfig = field(default_factory=core.OverlongConfig)
    ckpt: CkptConfig = field(default_factory=lambda: CkptConfig(every_steps=20, phases=("train",)))
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def __post_init__(self) -> None:
        check_at_least("seed", self.seed, 0)
        check_at_most("seed", self.seed, MAX_SEED, "a signed 32-bit int, as the engines take")
        check_at_least("num_steps", self.num_steps, 0)
        check_at_least("max_idle_steps", self.max_idle_steps, 0)
        if self.task and self.task not in EMBEDDED_TASKS:
            raise ValueError(
                f"task={self.task!r}: use one of {tuple(EMBEDDED_TASKS)} (an embedded demo), "
                "or '' for your own model and data"
            )
        if self.data.image_key and self.backend != "torch":
            raise ValueError(
                f"data.image_key={self.data.image_key!r}: images train with backend='torch' "
                f"only (backend={self.backend!r} takes text prompts)"
            )
        placements = ("full", "partial", "separate")
        for key, allowed in (("placement", placements), ("offload", ("always", "auto"))):
            if getattr(self, key) not in allowed:
                raise ValueError(f"{key}={getattr(self, key)!r}: use one of {allowed}")
        if self.placement == "partial" and not self.uses_judge_model:
            raise ValueError(
                f"placement='partial' keeps the judge's engine beside the rollout's; "
                f"reward.backend={self.reward.backend!r} has none: use placement='full'"
            )
        if self.placement == "separate":
            engines = [("rollout.backend", self.rollout.backend)]
            if self.uses_judge_model:
                engines.append(("reward.backend", self.reward.backend))
            for name, backend in engines:
                if backend != "builtin":
                    raise ValueError(
                        f"placement='separate' with {name}={backend!r}: the trainer puts the "
                        "built-in engine on a GPU of its own; vLLM and SGLang pick their GPUs "
                        f"themselves here. Use {name}='builtin' or placement='partial'"
                    )
        if self.rollout.sampling_mode == "stream" and self.placement == "full":
            raise ValueError(
                "rollout.sampling_mode='stream' judges responses while the rollout runs, which "
                "needs the rollout and judge engines resident together: set placement='partial' "
                "or 'separate' (placement='full'), or rollout.sampling_mode='rounds'"
            )
        if self.rollout.keep_partial:
            core.check_partial_resumption(
                rollout_correction=self.loss.rollout_correction,
                field_name="loss.rollout_correction",
            )
        template_fields = self.reward.template.fields
        if (
            "reference" in template_fields
            and not self.data.answer_key
            and self.reward.backend != "none"
        ):
            raise ValueError(
                f"reward.judge_template={self.reward.judge_template!r} reads {{reference}} but "
                "data.answer_key is '': name the rows' answer field, or drop {reference}"
            )
        # The loss against the rollout: mini-batches of whole groups, Dr. GRPO's normaliser,
        # the overlong buffer inside max_new_tokens.
        try:
            self.loss.check_rollout(
                prompts_per_rank=self.data.prompts_per_rank,
                max_new_tokens=self.rollout.max_new_tokens,
            )
            self.overlong.check_rollout(max_new_tokens=self.rollout.max_new_tokens)
        except ValueError as exc:
            message = (
                str(exc).replace("PolicyLoss.", "loss.").replace("OverlongConfig.", "overlong.")
            )
            raise ValueError(
                message.replace("prompts_per_rank=", "data.prompts_per_rank=").replace(
                    "max_new_tokens=", "rollout.max_new_tokens="
                )
            ) from None
        if self.policy is None:
            raise ValueError("config section 'policy' is empty; give it fields or remove the line")
        if isinstance(self.policy, Mapping):
            self.policy = self._checked_policy_fields(self.policy)
        temperature = policy_field(self.policy, "temperature")
        if temperature is not None and temperature != self.rollout.temperature:
            raise ValueError(
                f"policy.temperature={temperature} != rollout.temperature="
                f"{self.rollout.temperature}: the policy's logprobs must use the sampling "
                "temperature; build the policy config with temperature=rollout.temperature"
            )
        if self.rollout.sampling_mode == "stream" and self.model_parallel_size > 1:
            raise ValueError(
                "rollout.sampling_mode='stream': each rank streams its own rollout, and the ranks "
                "of a model-parallel policy (policy.tp_size x pp x cp > 1) share one batch: use "
                "rollout.sampling_mode='rounds'"
            )
        self._check_embedded_task()

    def _check_embedded_task(self) -> None:
        """What the embedded task (empty paths) can give: its rows' columns to the judge's
        template, a judge model only where it has one."""
        if not self.task:
            return
        task = EMBEDDED_TASKS[self.task]
        if not self.data.path:  # the embedded judge is fitted on this template
            unknown = self.reward.template.fields - set(SAMPLE_FIELDS) - set(task.columns)
            if unknown:
                raise ValueError(
                    f"reward.judge_template={self.reward.judge_template!r} reads "
                    f"{sorted(unknown)}; the embedded task's rows have {list(task.columns)} "
                    f"(and {list(SAMPLE_FIELDS)})"
                )
        if self.uses_judge_model and not self.reward.judge_dir and not task.has_judge:
            raise ValueError(
                f"task={self.task!r} has no embedded judge (its reward is the exact-match rule): "
                "give reward.judge_dir, or leave reward.backend at the task's 'none'"
            )

    @property
    def uses_judge_model(self) -> bool:
        """The judge is a local model (reward.judge_dir) run by an engine."""
        return self.reward.uses_engine

    @property
    def model_parallel_size(self) -> int:
        """The ranks sharing one rollout batch: a megatron policy's tp x pp x cp, else 1."""
        if isinstance(self.policy, Mapping):
            names = ("tp_size", "pp_size", "cp_size") if self.backend == "megatron" else ()
            return math.prod(self.policy.get(name, 1) for name in names)
        size = getattr(self.policy, "model_parallel_size", None)
        return size or getattr(self.policy, "tp_size", 1)

    @property
    def needs_embedded_task(self) -> bool:
        """An empty path points at the embedded task: preflight builds it (once per out_dir).
        Never without task=<name>: your own run's empty path is an error (check_own_run)."""
        if not self.task:
            return False
        policy_dir = policy_field(self.policy, "model_dir")
        needs_judge = self.uses_judge_model and not self.reward.judge_dir
        return not policy_dir or not self.data.path or needs_judge

    def check_own_run(self, *, should_check_data: bool = True) -> None:
        """A run of your own model (task=''): every path it needs given, and a reward. No
        demo model is ever built for an empty path: each is an error naming the field and the
        ways to fill it. should_check_data=False (--export): the policy's folder only."""
        if self.task:
            return
        demo = "or task=text for the embedded demo"
        if not policy_field(self.policy, "model_dir"):
            raise ValueError(
                "policy.model_dir is empty: give your policy's folder (or a Hub id in the HF "
                f"cache), {demo}"
            )
        if not should_check_data:
            return
        if not self.data.path:
            raise ValueError(
                "data.path is empty: give your prompts (a JSONL or Parquet file, or a "
                f"save_to_disk folder), {demo}"
            )
        if self.uses_judge_model and not self.reward.judge_dir:
            raise ValueError(
                f"no reward: reward.backend={self.reward.backend!r} needs a judge model and "
                "reward.judge_dir is empty. Give one of: reward.judge_dir=<judge model folder or "
                "Hub id> (a generative judge); reward.functions=[rewards.py:score] (Python "
                "reward functions); reward.backend=openai with reward.openai={base_url: "
                "http://host:8000/v1, model: name} (a served judge)"
            )

    def _checked_policy_fields(self, values: Mapping[str, Any]) -> dict[str, Any]:
        if "temperature" in values:  # one source: rollout and policy can never disagree
            raise ValueError(
                f"policy.temperature={values['temperature']!r}: set rollout.temperature instead "
                "(the policy's logprobs use the sampling temperature)"
            )
        if "is_reference" in values:
            raise ValueError(
                "policy.is_reference: the trainer builds its KL reference itself; set "
                "loss.kl_coef > 0 for one"
            )
        # Unknown keys and wrong types fail here, naming the backend's config class; the
        # class's own range checks run when preflight builds it.
        # The temperature is added when the class is built (one source: rollout.temperature).
        values = check_policy_fields(self.backend, values)
        if values.get("lr_schedule") == "cosine" and values.get("num_decay_steps") is None:
            # Decay over the whole run: the schedule advances once per optimizer step, of which
            # a step of the run takes loss.num_updates_per_batch (a run of no steps still gets
            # a valid schedule).
            num_updates = self.num_steps * self.loss.num_updates_per_batch
            values["num_decay_steps"] = max(num_updates, values.get("num_warmup_steps", 0) + 1)
        return values


def policy_field(policy: Mapping[str, Any] | Any, name: str) -> Any:
    """A field of the policy section: its checked fields (a dict; None where not given), or
    the built config class."""
    return policy.get(name) if isinstance(policy, Mapping) else getattr(policy, name)


def check_policy_fields(backend: str, values: Mapping[str, Any]) -> dict[str, Any]:
    """`values` checked against `backend`'s policy config class by name and scalar type (as
    core.config_from_dict does), without building it: the class reads policy.model_dir."""
    if backend not in POLICY_CONFIGS:
        raise ValueError(
            f"backend={backend!r} is not a policy backend; use one of {list(POLICY_CONFIGS)}"
        )
    cls = POLICY_CONFIGS[backend]
    known = {item.name for item in fields(cls) if item.init}
    hints = typing.get_type_hints(cls)
    checked = {}
    for key, value in values.items():
        if key not in known:
            close = difflib.get_close_matches(key, list(known), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {sorted(known)}"
            raise ValueError(f"unknown config key 'policy.{key}' for {cls.__name__}{hint}")
        checked[key] = core.coerce_value(value, hints[key], f"policy.{key}")
    return checked


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line: --config, the overrides, --traceback, and the run's flags: resume,
    export (write a Hugging Face folder from a checkpoint and stop), step (which one). An
    argparse error (`--num_steps 5`, told `num_steps=5`) exits 2."""
    parser = core.ConfigParser(
        description="Reference GRPO trainer (examples/train_grpo.py)", describe=describe_fields
    )
    parser.add_argument("--resume", action="store_true", help="continue from out_dir's checkpoint")
    parser.add_argument(
        "--export",
        action="store_true",
        help="write out_dir's newest checkpoint (or --step's) as a Hugging Face folder and stop",
    )
    parser.add_argument("--step", type=int, help="with --export: the checkpoint's step")
    args = parser.parse(argv)
    if args.step is not None and not args.export:
        parser.error("--step goes with --export")
    if args.export and args.resume:
        parser.error("--export writes a checkpoint out and stops; it does not --resume")
    return args


def read_config(argv: list[str]) -> tuple[TrainConfig, argparse.Namespace]:
    """The config from the command line (see the module doc) and the parsed flags
    (parse_args); ValueError naming the field, the file and line, or the override."""
    args = parse_args(argv)
    return config_from_args(args), args


# The run's resolved config, written into out_dir when it starts (grpo_setup.save_config):
# what --resume and --export read when no --config is given.
RESOLVED_CONFIG = RESOLVED_CONFIG_NAME


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The checked config of parsed arguments: --config's fields, then the overrides. With
    --resume or --export and no --config, the run's own resolved config (out_dir/config.yaml,
    where the run wrote one) takes --config's place, so the run's model, data and settings
    are the ones continued or exported."""
    config_path = args.config
    if config_path is None and (getattr(args, "resume", False) or getattr(args, "export", False)):
        out_dir = core.read_raw_config(None, args.overrides).get("out_dir")
        if out_dir is None:
            out_dir = TrainConfig.__dataclass_fields__["out_dir"].default
        saved = PurePath(str(out_dir)) / RESOLVED_CONFIG
        if os.path.isfile(saved):
            logger.info("reading the run's config %s (--config replaces it)", saved)
            config_path = str(saved)
    return build_config(core.read_raw_config(config_path, args.overrides))


def resolved_config_values(cfg: TrainConfig) -> dict[str, Any]:
    """`cfg` as plain values that build_config reads back to the same config: init fields
    only, tuples as lists, and the policy without the fields the trainer sets itself."""
    values = _plain_fields(cfg)
    policy = values.get("policy")
    if isinstance(policy, dict):
        for key in ("temperature", "is_reference"):  # rollout.temperature; loss.kl_coef
            policy.pop(key, None)
    return values


def _plain_fields(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            item.name: _plain_fields(getattr(value, item.name))
            for item in fields(value)
            if item.init
        }
    if isinstance(value, Mapping):
        return {key: _plain_fields(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain_fields(item) for item in value]
    return value


# The package's YAML and override readers, under the names this module always had.
load_yaml = core.load_yaml
with_override = core.with_override


def build_config(raw: Mapping[str, Any]) -> TrainConfig:
    """A checked TrainConfig from plain values (`raw` is not changed): the embedded task's
    defaults under task=<name> filled in, then every field typed and checked. Paths are kept
    as given (empty ones point at the embedded task): preflight resolves them."""
    raw = with_task_defaults(raw)
    raw = with_reward_defaults(raw)
    raw = with_loss_defaults(raw)
    return core.config_from_dict(TrainConfig, raw)


def _section(raw: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    section = raw.get(name)
    return section if isinstance(section, Mapping) else {}


def with_task_defaults(raw: Mapping[str, Any]) -> dict[str, Any]:
    """`raw` with its task decided and, under an embedded task, that demo's defaults filled
    in where `raw` has no value. No task given: "text" (the demo) when no model or data path
    is given at all, else "" (your own model and data: no demo value, no demo model)."""
    raw = dict(raw)
    if "task" not in raw:
        has_paths = _section(raw, "policy").get("model_dir") or _section(raw, "data").get("path")
        raw["task"] = "" if has_paths else "text"
    task_name = raw["task"]
    if isinstance(task_name, str) and task_name in EMBEDDED_TASKS:
        raw = with_defaults(raw, EMBEDDED_TASKS[task_name].defaults)
    return raw


def with_reward_defaults(raw: Mapping[str, Any]) -> dict[str, Any]:
    """Your own run (task='') whose reward is functions or the rule only: reward.backend
    defaults to 'none' (no judge model), said in one log line; a given backend is kept."""
    reward = _section(raw, "reward")
    has_rules = reward.get("functions") or reward.get("rule_weight")
    if raw.get("task") or "backend" in reward or reward.get("judge_dir") or not has_rules:
        return dict(raw)
    logger.info("reward.functions without reward.judge_dir: reward.backend='none' (no judge model)")
    return {**raw, "reward": {**reward, "backend": "none"}}


def with_loss_defaults(raw: Mapping[str, Any]) -> dict[str, Any]:
    """`raw` with the loss fields the rest of the loss section implies, where it leaves them
    unset: loss.is_on_policy False when it asks for several optimizer steps per batch (only
    one step per batch is on-policy, so the default's True holds for one step only), and
    with loss.old_logprobs_from='engine' (pi_old is the engine's, not the loss's own
    forward) also loss.rollout_correction 'none' (pi_old is then the engine's policy: there
    is nothing to correct). A value the user gave is never changed: PolicyLoss refuses a
    combination that cannot hold, naming the field."""
    loss = raw.get("loss")
    if not isinstance(loss, Mapping):
        return dict(raw)
    filled = dict(loss)
    num_updates = 1
    for key in ("num_mini_batches", "num_epochs"):
        value = loss.get(key, 1)
        if isinstance(value, int) and not isinstance(value, bool):
            num_updates *= value  # anything else: PolicyLoss names the field
    is_from_engine = loss.get("old_logprobs_from") == "engine"
    if (num_updates > 1 or is_from_engine) and "is_on_policy" not in loss:
        filled["is_on_policy"] = False
    if is_from_engine and "rollout_correction" not in loss:
        logger.info(
            "loss.old_logprobs_from='engine': loss.rollout_correction='none' (pi_old is the "
            "engine's own policy; the clip acts on pi / pi_engine)"
        )
        filled["rollout_correction"] = "none"
    is_dr_grpo = (
        loss.get("objective") == "dr_grpo" or loss.get("aggregation") == "seq_mean_token_sum_norm"
    )
    if is_dr_grpo and loss.get("max_response_tokens") is None:
        # Dr. GRPO divides by a constant length: the generation budget, which the rollout knows
        max_new_tokens = _section(raw, "rollout").get("max_new_tokens")
        if max_new_tokens is None:
            max_new_tokens = RolloutConfig.__dataclass_fields__["max_new_tokens"].default
        filled["max_response_tokens"] = max_new_tokens
    return {**raw, "loss": filled}


def with_defaults(raw: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """`raw` with `defaults` filled in where it has no value (sections merged, not replaced)."""
    out = dict(raw)
    for key, value in defaults.items():
        if isinstance(value, Mapping) and isinstance(out.get(key, {}), Mapping):
            out[key] = with_defaults(out.get(key) or {}, value)
        elif key not in out:
            out[key] = value
    return out


def describe_fields() -> str:
    """Every config field with its default and doc line, for --help (policy: the torch backend's)."""
    lines = [line for line in core.describe_config(TrainConfig) if not line.startswith("policy ")]
    for line in core.describe_config(core.TorchPolicyConfig, prefix="policy."):
        name, _, rest = line.partition(" = ")
        key = name.removeprefix("policy.")
        if key in ("temperature", "is_reference"):
            continue  # rollout.temperature is the one source; loss.kl_coef makes a reference
        if key == "model_dir":
            line = (
                f"{name} = ''  # a local folder or a Hub id in the HF cache; '' under "
                "task=text: the embedded demo's"
            )
        elif key == "num_decay_steps":
            line = (
                f"{name} = None  # cosine: optimizer steps (warm-up included) to its lowest "
                "lr; None = num_steps x loss.num_mini_batches x loss.num_epochs"
            )
        elif key in POLICY_HELP:
            line = f"{name} = {rest.partition('  # ')[0]}  # {POLICY_HELP[key]}"
        lines.append(line)
        if key == "lora":  # its sub-fields, settable one by one (policy.lora.rank=8 turns it on)
            lines.extend(core.describe_config(core.LoraConfig, prefix="policy.lora."))
    return (
        "config fields (YAML keys, or key.sub=value overrides; backend=megatron takes "
        "MegatronPolicyConfig's policy fields):\n  " + "\n  ".join(lines)
    )
