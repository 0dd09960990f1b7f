"""The reference trainer's config: its sections, their checks, and reading them from the CLI.

    cfg, should_resume = read_config(sys.argv[1:])

`--config run.yaml` gives fields as YAML and `key.sub=value` arguments override them. The whole
config is built and checked before the runtime, models or engines start: values are typed
(exact conversions only: YAML reads 1e-3 as a string, which becomes 0.001), ranges checked,
unknown keys refused with the closest known one, vLLM/SGLang backends checked for installation.
Empty paths (policy.model_dir, data.path, reward.judge_dir) point at the embedded task
(tiny_task.py), built under out_dir/embedded once every check has passed, then reused.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tiny_task
import yaml
from grpo_data import SAMPLE_FIELDS

from yatt import core, genrm, rollout
from yatt.ckpt import CkptConfig

ENGINE_CONFIGS = {"vllm": rollout.VLLMConfig, "sglang": rollout.SGLangConfig}
# The trainer's policy defaults: the embedded task's tiny model (help lists them as defaults).
DEFAULT_POLICY = {"lr": 2e-3, "dtype": "float32", "max_tokens_per_microbatch": 512}


def check_at_least(name: str, value: float, minimum: float) -> None:
    if value < minimum:
        raise ValueError(f"{name}={value!r}: must be >= {minimum}")


def check_engine_backend(name: str, backend: str, options: dict) -> None:
    """Before anything loads: a known engine, installed, with options its config knows."""
    if backend == "builtin":
        if options:
            section = name.partition(".")[0]
            raise ValueError(
                f"{name}_options={options!r}: only for {name}='vllm' or 'sglang'; the built-in "
                f"engine takes {section}.engine fields"
            )
        return
    if backend not in ENGINE_CONFIGS:
        raise ValueError(f"{name}={backend!r}: use 'builtin', 'vllm' or 'sglang'")
    if importlib.util.find_spec(backend) is None:
        raise ValueError(
            f"{name}={backend!r} needs {backend}: pip install 'yatt-rollout[{backend}]'"
        )
    try:
        ENGINE_CONFIGS[backend](**options)
    except TypeError as exc:  # an unknown option
        raise ValueError(f"{name}_options={options!r}: {exc}") from None


@dataclass(kw_only=True)
class DataConfig:
    path: str = ""  # JSONL/Parquet prompts; "" = the embedded task's prompts
    prompt_key: str = "prompt"  # row field holding the prompt: text or [{role, content}, ...]
    answer_key: str = "answer"  # row field holding the reference answer ("" = none)
    prompts_per_rank: int = 8  # GRPO groups per rank per step
    # Message lists always go through the policy's chat template; True: plain text too.
    apply_chat_template: bool = False

    def __post_init__(self) -> None:
        check_at_least("data.prompts_per_rank", self.prompts_per_rank, 1)


@dataclass(kw_only=True)
class RolloutConfig:
    samples_per_prompt: int = 8  # GRPO group size n
    temperature: float = 1.0  # sampling temperature; the policy's logprobs use the same
    max_new_tokens: int = 4  # response length cap
    max_sampling_rounds: int = 3  # DAPO dynamic sampling: rollout rounds to fill the batch
    backend: str = "builtin"  # "builtin", or "vllm"/"sglang" (GPU; yatt-rollout[vllm|sglang])
    engine: rollout.EngineConfig = field(
        default_factory=lambda: rollout.EngineConfig(max_seq_len=64)
    )
    backend_options: dict = field(default_factory=dict)  # VLLMConfig/SGLangConfig fields

    def __post_init__(self) -> None:
        # GRPO's advantage is a sample's reward against its group's: one sample has none.
        check_at_least("rollout.samples_per_prompt", self.samples_per_prompt, 2)
        check_at_least("rollout.temperature", self.temperature, 0.0)
        check_at_least("rollout.max_new_tokens", self.max_new_tokens, 1)
        check_at_least("rollout.max_sampling_rounds", self.max_sampling_rounds, 1)
        check_engine_backend("rollout.backend", self.backend, self.backend_options)


@dataclass(kw_only=True)
class RewardConfig:
    judge_dir: str = ""  # the judge's model directory; "" = the embedded task's judge
    # The judge's prompt (str.format): {prompt}, {response}, {reference} (the row's answer)
    # and any other column of the data rows.
    judge_template: str = "{prompt}{response} ref {reference}"
    votes: int = 1  # judge samples per response, averaged
    rule_weight: float = 0.0  # weight of an exact-match rule reward added to the judge's
    backend: str = "builtin"  # the judge's engine: "builtin", or "vllm"/"sglang" (GPU)
    engine: rollout.EngineConfig = field(
        default_factory=lambda: rollout.EngineConfig(max_seq_len=96, region_prefix="genrm")
    )
    backend_options: dict = field(default_factory=dict)  # VLLMConfig/SGLangConfig fields

    def __post_init__(self) -> None:
        check_at_least("reward.votes", self.votes, 1)
        check_engine_backend("reward.backend", self.backend, self.backend_options)
        try:
            genrm.JudgeTemplate(user=self.judge_template)
        except ValueError as exc:
            raise ValueError(f"reward.judge_template={self.judge_template!r}: {exc}") from None


@dataclass(kw_only=True)
class TrainConfig:
    seed: int = 0  # seeds the data order, the rollouts and the models
    num_steps: int = 120  # GRPO steps (0: build the embedded task and stop)
    out_dir: str = "runs/grpo"  # metrics, plot and checkpoints
    placement: str = "full"  # "full": phases in turn; "partial": rollout + GenRM resident
    offload: str = "always"  # "auto": a role sleeps only when the next phase would not fit
    backend: str = "torch"  # policy backend: "torch" or "megatron" (CUDA; yatt-core[megatron])
    # The backend's config fields (TorchPolicyConfig or MegatronPolicyConfig); a dict here is
    # turned into that class, its temperature taken from rollout.temperature.
    policy: dict | core.TorchPolicyConfig | core.MegatronPolicyConfig = field(default_factory=dict)
    # One optimizer step per batch: the loss takes old logprobs from its own forward pass.
    loss: core.PolicyLoss = field(
        default_factory=lambda: core.PolicyLoss(clip_high=0.28, is_on_policy=True)
    )
    ckpt: CkptConfig = field(default_factory=lambda: CkptConfig(every_steps=20, phases=("train",)))
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)

    def __post_init__(self) -> None:
        check_at_least("num_steps", self.num_steps, 0)
        for key, allowed in (("placement", ("full", "partial")), ("offload", ("always", "auto"))):
            if getattr(self, key) not in allowed:
                raise ValueError(f"{key}={getattr(self, key)!r}: use one of {allowed}")
        fields = genrm.JudgeTemplate(user=self.reward.judge_template).fields
        if "reference" in fields and not self.data.answer_key:
            raise ValueError(
                f"reward.judge_template={self.reward.judge_template!r} reads {{reference}} but "
                "data.answer_key is '': name the rows' answer field, or drop {reference}"
            )
        if self.policy is None:
            raise ValueError("config section 'policy' is empty; give it fields or remove the line")
        if isinstance(self.policy, Mapping):
            self.policy = self._make_policy_config(self.policy)
        if self.policy.temperature != self.rollout.temperature:
            raise ValueError(
                f"policy.temperature={self.policy.temperature} != rollout.temperature="
                f"{self.rollout.temperature}: the policy's logprobs must use the sampling "
                "temperature; build the policy config with temperature=rollout.temperature"
            )

    def _make_policy_config(self, values: Mapping[str, Any]):
        if "temperature" in values:  # one source: rollout and policy can never disagree
            raise ValueError(
                f"policy.temperature={values['temperature']!r}: set rollout.temperature instead "
                "(the policy's logprobs use the sampling temperature)"
            )
        values = {**DEFAULT_POLICY, **values, "temperature": self.rollout.temperature}
        # Unknown keys fail here, naming the backend's config class.
        return core.policy_config_from_dict(self.backend, values)


def read_config(argv: list[str]) -> tuple[TrainConfig, bool]:
    """The config from the command line (see the module doc), and whether to resume."""
    parser = argparse.ArgumentParser(
        description="Reference GRPO trainer (examples/train_grpo.py)",
        epilog=describe_fields(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help="YAML file of TrainConfig fields")
    parser.add_argument("--resume", action="store_true", help="continue from out_dir's checkpoint")
    parser.add_argument("overrides", nargs="*", help="e.g. rollout.temperature=0.7")
    args = parser.parse_intermixed_args(argv)
    raw = yaml.safe_load(Path(args.config).read_text()) if args.config else {}
    if not isinstance(raw, dict):
        raise ValueError(f"--config {args.config}: must hold a mapping of fields, got {raw!r}")
    for item in args.overrides:
        raw = with_override(raw, item)
    return build_config(raw), args.resume


def with_override(raw: dict, item: str) -> dict:
    """`raw` with one `key.sub=value` override; `raw` is not changed. The value is read as YAML
    (1e-3, true, [a, b]), or as text where it is not YAML (a template "{prompt}{response}");
    the field's type then checks it."""
    dotted, sep, text = item.partition("=")
    if not sep or not dotted:
        raise ValueError(f"override {item!r} must look like key.sub=value")
    key, _, rest = dotted.partition(".")
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        value = text
    if rest:
        section = raw.get(key) or {}
        if not isinstance(section, dict):
            raise ValueError(f"override {item!r}: {key}={section!r} is not a section")
        value = with_override(section, f"{rest}={text}")
    return {**raw, key: value}


def build_config(raw: Mapping[str, Any]) -> TrainConfig:
    """A checked TrainConfig from plain values; empty paths point at the embedded task.

    Every field is checked first, the embedded policy's against a stand-in directory (that
    policy may not be built yet), and only then is the embedded task built (once).
    """
    policy = raw.get("policy", {})
    if not isinstance(policy, Mapping):  # None ("policy:" alone) is refused by TrainConfig
        return core.config_from_dict(TrainConfig, raw)
    if policy.get("model_dir"):
        checked = core.config_from_dict(TrainConfig, raw)
    else:
        with stand_in_model_dir() as stand_in:
            checked = core.config_from_dict(
                TrainConfig, {**raw, "policy": {**policy, "model_dir": stand_in}}
            )
    if policy.get("model_dir") and checked.data.path and checked.reward.judge_dir:
        return checked
    template = genrm.JudgeTemplate(user=checked.reward.judge_template)
    if not checked.data.path:  # before building: the judge is fitted on this template
        unknown = template.fields - set(SAMPLE_FIELDS) - set(tiny_task.COLUMNS)
        if unknown:
            raise ValueError(
                f"reward.judge_template={template.user!r} reads {sorted(unknown)}; the embedded "
                f"task's rows have {list(tiny_task.COLUMNS)} (and {list(SAMPLE_FIELDS)})"
            )
    paths = tiny_task.prepare_locked(Path(checked.out_dir) / "embedded", template)
    filled = {
        **raw,
        "policy": {**policy, "model_dir": policy.get("model_dir") or str(paths["policy"])},
        "data": {**raw.get("data", {}), "path": checked.data.path or str(paths["prompts"])},
        "reward": {
            **raw.get("reward", {}),
            "judge_dir": checked.reward.judge_dir or str(paths["judge"]),
        },
    }
    return core.config_from_dict(TrainConfig, filled)


@contextlib.contextmanager
def stand_in_model_dir() -> Iterator[str]:
    """A directory that passes the policy config's model_dir check (it reads config.json only),
    so the embedded policy's other fields are checked before that policy is built."""
    with tempfile.TemporaryDirectory(prefix="yatt-stand-in-") as path:
        (Path(path) / "config.json").write_text("{}\n")
        yield path


def describe_fields() -> str:
    """Every config field with its default and doc line, for --help (policy: the torch backend's)."""
    lines = [line for line in core.describe_config(TrainConfig) if not line.startswith("policy ")]
    for line in core.describe_config(core.TorchPolicyConfig, prefix="policy."):
        name, _, rest = line.partition(" = ")
        key = name.removeprefix("policy.")
        doc = rest.partition("  # ")[2]
        if key == "temperature":
            continue  # rollout.temperature is the one source
        if key == "model_dir":
            line = f"{name} = ''  # {doc}; '' = the embedded task's policy"
        elif key in DEFAULT_POLICY:
            line = f"{name} = {DEFAULT_POLICY[key]!r}  # {doc}"
        lines.append(line)
    return (
        "config fields (YAML keys, or key.sub=value overrides; backend=megatron takes "
        "MegatronPolicyConfig's policy fields):\n  " + "\n  ".join(lines)
    )
