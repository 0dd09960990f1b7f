"""The judge as a config section: which judge (a local engine, an endpoint, none), its prompt,
verdict format, votes, reward functions and rule, checked when built.

    spec = JudgeSpec(judge_dir="Qwen/Qwen3-8B", votes=3, functions=["rewards.py:score"])
    check_judge_resources(spec)                  # reward code imports, parser builds, key set
    engine = rollout.build_engine(spec, spec.judge_dir, device="cuda:0")  # a local judge only
    scorer, exact_match = build_judge(spec, engine)    # genrm/_judge_build.py

A JudgeSpec is a rollout.EngineSpec (backend, engine, backend_options) whose backend may also be
"openai" (a served endpoint, reward.openai's fields) or "none" (reward functions and the rule
only). Building it checks every value and reads nothing (no file, module or environment
variable): `check_judge_resources` does that, once, before any model loads. Errors name the field as
the trainer's config spells it (`section`: "JudgeSpec" here, "reward" in the reference trainer).
"""

from __future__ import annotations

import math
import os
import string
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from yatt.genrm._openai import OpenAIJudgeConfig
from yatt.genrm._parsers import ScoreParser, YesNoParser
from yatt.genrm._stream import BatchingConfig
from yatt.genrm._templates import JudgeTemplate
from yatt.rollout import EngineConfig, EngineSpec

# Judges: an engine loading judge_dir, a served endpoint, or none (reward functions only).
JUDGE_BACKENDS = ("builtin", "vllm", "sglang", "openai", "none")
LOCAL_JUDGES = ("builtin", "vllm", "sglang")
VERDICT_FROM = ("auto", "label_logprobs", "text")  # GenRM's verdict_from values
# The built-in verdict formats (their fields: verdict_parser_options).
VERDICT_PARSERS: dict[str, type] = {"yes_no": YesNoParser, "score": ScoreParser}
# Each vote is one more judge generation per response; 64 votes already bring the standard
# error of the averaged verdict to 1/8 of one vote's.
MAX_VOTES = 64
# GRPO normalizes rewards within a group, so only the weights' ratios matter; past this a weight
# is a units mistake, and weight x reward may no longer fit the float32 the batch holds.
MAX_REWARD_WEIGHT = 1e6
# Tokens a judge may write per verdict; past this a reasoning judge's budget is a typo (1e9).
MAX_VERDICT_TOKENS = 1 << 16
# A reward function call longer than a day is a unit mistake (and past ~1e9 s asyncio's and the
# OS's timers overflow: every verdict an OverflowError).
MAX_FUNCTION_TIMEOUT_S = 86_400.0
# How a reward function is called (function_forms): yatt's per sample, TRL's batch, verl's
# compute_score; "auto" finds it from the parameter names (genrm._reward_forms).
FUNCTION_FORMS = ("auto", "sample", "trl", "verl")
# Worker processes of the reward pool per rank: each is a Python process (tens of MB, more with
# what the reward imports); past this a count is a typo, and it would oversubscribe any machine.
MAX_FUNCTION_WORKERS = 64
# Retries of one judge request: each waits up to max_backoff_s; 20 is minutes of a dead server.
MAX_OPENAI_RETRIES = 20
MAX_OPENAI_TIMEOUT_S = 3600.0  # one request, connect to last byte

# The exact-match rule's component name (genrm.ExactMatch.name): an accuracy signal always
# available, computed for the metric even when rule_weight is 0.
ACCURACY_RULE = "exact_match"

DEFAULT_JUDGE_TEMPLATE = (
    "Question: {prompt}\nReference answer: {reference}\nResponse: {response}\n"
    "Is the response correct? Answer Yes or No."
)


@dataclass(kw_only=True)
class JudgeSpec(EngineSpec):
    """The reward: a judge's verdict (a local engine, an endpoint, or none), plus reward
    functions and an exact-match rule, each with its weight."""

    section: ClassVar[str] = "JudgeSpec"

    # The judge: an engine loading judge_dir ("builtin", or "vllm"/"sglang" on a GPU), a served
    # OpenAI-compatible endpoint ("openai", see openai), or "none" (functions only).
    backend: str = "builtin"
    # The judge engine's context holds the template, a prompt and a whole response.
    engine: EngineConfig = field(
        default_factory=lambda: EngineConfig(max_seq_len=4096, region_prefix="genrm")
    )
    # The judge's model directory (a local folder or a Hub id in the cache). "policy": the
    # policy's own base model judges (self-judging GenRM), on the policy's built-in engine with
    # its LoRA adapter off (engine.without_adapter(): one resident copy of the weights and one
    # KV cache; `engine` here is then unused). Needs policy.lora and that engine's
    # lora_mode="beside"; with full fine-tuning the policy's weights change every step, so a
    # self-judge there needs a frozen copy: give the policy's model folder instead.
    judge_dir: str = ""
    # The judge's prompt (str.format): {prompt}, {response}, {reference} (the row's answer)
    # and any other column of the data rows.
    judge_template: str = DEFAULT_JUDGE_TEMPLATE
    votes: int = 1  # judge samples per response, averaged
    # How a verdict becomes a reward. The judge's last line is its verdict (by default the
    # label "Yes"/"No", optionally "Verdict: Yes"; see verdict_parser; anything else is
    # unparsable, counted). "label_logprobs" (yes/no labels only): the reward is 2 P(Yes) - 1
    # from the judge's probabilities at that label (no text decides); "text": what the parser
    # reads from the line written (+1/-1 for yes/no); "auto": label_logprobs for a yes/no
    # parser on an engine that gives them (builtin, vLLM, SGLang), else text.
    verdict_from: str = "auto"
    # How the judge's last line becomes a reward: yes_no, score, or a module:name parser.
    # With "yes_no" 'Yes'/'No' (or 'Verdict: Yes') -> +1/-1; "score": 'Score: N', N in 1..10
    # -> (N - 1) / 9; "module:name" or "file.py:name": a genrm.VerdictParser (an object with
    # parse(text) -> float | None), or a callable returning one.
    verdict_parser: str = "yes_no"
    # Fields of the yes_no/score parser (genrm.YesNoParser/ScoreParser). E.g. {yes_label:
    # Correct, no_label: Incorrect} or {low: 0, high: 5}.
    verdict_parser_options: dict = field(default_factory=dict)
    # Tokens the judge may write per verdict (4: the label and an end token). A judge that
    # reasons before its verdict needs room for the reasoning.
    verdict_max_tokens: int = 4
    rule_weight: float = 0.0  # weight of an exact-match rule reward added to the judge's
    # The signal reward/accuracy reads, per response (0/1 for a right/wrong answer): a verdict
    # component ("exact_match", the rule, computed for this even at rule_weight 0; a reward
    # function's name such as "rewards:score"; "judge") or a key a function returns in a dict
    # ("<function name>/<key>", e.g. "rewards:compute_score/acc"). "" = no accuracy metric:
    # reward/accuracy is neither logged nor plotted (the reward alone says nothing of it).
    accuracy: str = ""
    # How verdicts are grouped into the judge engine's calls: genrm.BatchingConfig fields
    # (max_batch_size 32, batch_window_millis 20, max_pending 256, max_inflight_batches 16);
    # {} = those defaults. Under placement=partial the judge takes responses as they finish:
    # a longer window makes fewer, larger calls, each step of a large judge reading its
    # weights for more verdicts. A local judge engine only.
    batching: dict = field(default_factory=dict)
    # Python reward functions, "module:fn" or "path/file.py:fn": fn(prompt, response,
    # reference, row) -> float, or None when it cannot score; added to the judge's reward.
    # A reward file is Python code that runs, with the trainer's permissions, when it loads.
    functions: list = field(default_factory=list)
    function_weights: list = field(default_factory=list)  # one per function; [] = 1.0 each
    # Seconds one reward function call may take: calls run in a worker process, killed past
    # this (that sample's verdict is an error, counted; the run goes on). 0 = no limit, calls
    # in the trainer's process (a call that never returns hangs the run).
    function_timeout_s: float = 60.0
    # Each function's calling form: sample, trl, verl or auto; [] = auto each. "sample":
    # fn(prompt, response, reference, row); "trl": TRL's batch form fn(prompts, completions,
    # **columns) -> list; "verl": compute_score(data_source, solution_str, ground_truth,
    # extra_info); "auto": found from the parameter names, never their count (a signature the
    # names cannot settle is an error asking for its form here).
    function_forms: list = field(default_factory=list)
    # Reward worker processes per rank, one pool for all functions; 0 = CPUs - 1, in 1..8.
    # 0 counts the CPUs this rank may use (shared with the ranks beside it) and leaves one to
    # the trainer, so a 2-core machine runs one worker. Raise it for rewards that mostly wait
    # (a sandbox, an HTTP call). Only with function_timeout_s > 0 (else calls run in process).
    function_workers: int = 0
    # backend=openai: OpenAIJudgeConfig fields (base_url, model, api_key_env, max_concurrency,
    # timeout_s, max_retries, extra_body); the key is read from the api_key_env variable.
    openai: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        section = self.section
        if self.backend not in JUDGE_BACKENDS:
            raise ValueError(f"{section}.backend={self.backend!r}: use one of {JUDGE_BACKENDS}")
        super().__post_init__()  # the engine's fields (check_engine)
        _check_range(f"{section}.votes", self.votes, 1, MAX_VOTES, "judge samples per response")
        _check_range(
            f"{section}.function_timeout_s",
            self.function_timeout_s,
            0.0,
            MAX_FUNCTION_TIMEOUT_S,
            "seconds one reward call may take; 0 = no limit",
        )
        check_weight(f"{section}.rule_weight", self.rule_weight)
        self.check_accuracy()
        self.check_verdict_format()
        if self.verdict_from not in VERDICT_FROM:
            raise ValueError(
                f"{section}.verdict_from={self.verdict_from!r}: use one of {VERDICT_FROM}"
            )
        if self.verdict_from == "label_logprobs" and not self.uses_engine:
            raise ValueError(
                f"{section}.verdict_from='label_logprobs' reads the judge engine's token "
                f"probabilities; {section}.backend={self.backend!r} gives text only: use "
                "'auto' or 'text'"
            )
        if self.batching and not self.uses_engine:
            raise ValueError(
                f"{section}.batching={self.batching!r}: groups a local judge engine's calls "
                f"({section}.backend in {LOCAL_JUDGES}), not {self.backend!r}"
            )
        self.batching_config()
        try:
            # The judge's prompt, built once here: everyone reads .template.
            self._template = JudgeTemplate(user=self.judge_template)
        except ValueError as exc:
            raise ValueError(f"{section}.judge_template={self.judge_template!r}: {exc}") from None
        check_no_format_specs(f"{section}.judge_template", self.judge_template)
        self.functions, self.function_weights = check_functions(
            self.functions, self.function_weights, section=section
        )
        self.function_forms = check_function_forms(
            self.function_forms, self.functions, section=section
        )
        self.check_function_workers()
        if self.backend == "openai":
            self.openai_config()  # the endpoint's fields (check_judge_resources reads its key)
        elif self.openai:
            raise ValueError(
                f"{section}.openai={self.openai!r}: only for {section}.backend='openai' "
                f"(it is {self.backend!r})"
            )
        if self.shares_policy and self.backend != "builtin":
            raise ValueError(
                f"{section}.judge_dir='policy' judges on the policy's built-in engine; "
                f"{section}.backend={self.backend!r} would load a second engine: set "
                f"{section}.backend=builtin, or give {section}.judge_dir a model folder"
            )
        if self.backend == "none" and not self.functions and not self.rule_weight:
            raise ValueError(
                f"{section}.backend='none' loads no judge: give {section}.functions (or "
                f"{section}.rule_weight > 0 for the exact-match rule), or a judge backend"
            )

    def check_accuracy(self) -> None:
        """accuracy names a signal this reward can carry: the rule, the judge (with one), or a
        reward function (its name, or "<name>/<key>" of a dict return). A function's name is
        only known once it loads: a name no verdict carries is counted by the trainer."""
        section, value = self.section, self.accuracy
        if not isinstance(value, str) or value != value.strip():
            raise ValueError(
                f"{section}.accuracy={value!r}: a signal name such as 'exact_match', "
                "'<function name>' or '<function name>/<key>'; '' = no accuracy metric"
            )
        name = value.partition("/")[0]
        if not value or name == ACCURACY_RULE:
            return
        if name == "judge" and self.backend == "none":
            raise ValueError(
                f"{section}.accuracy='judge': {section}.backend='none' has no judge; name "
                f"'{ACCURACY_RULE}' or a reward function's signal"
            )
        if name != "judge" and not self.functions:
            raise ValueError(
                f"{section}.accuracy={value!r}: no reward function gives it ({section}."
                f"functions is empty); use '{ACCURACY_RULE}', 'judge', a function's "
                "'<module>:<fn>' or '<module>:<fn>/<key>', or '' for none"
            )

    def check_engine(self) -> None:
        """A local judge's engine fields (EngineSpec's checks); an endpoint or none has none."""
        if self.uses_engine:
            super().check_engine()
        elif self.backend_options:
            raise ValueError(
                f"{self.section}.backend_options={self.backend_options!r}: only for "
                f"{self.section}.backend='vllm' or 'sglang' (the judge engine's options), "
                f"not {self.backend!r}"
            )

    def check_function_workers(self) -> None:
        """function_workers: in range, and only where a worker pool runs the functions."""
        section = self.section
        workers = self.function_workers
        if isinstance(workers, float) and workers.is_integer():
            workers = self.function_workers = int(workers)  # YAML's 4.0 / 1e1
        if isinstance(workers, bool) or not isinstance(workers, int):
            raise ValueError(
                f"{section}.function_workers={workers!r}: an int in [0, {MAX_FUNCTION_WORKERS}] "
                "(0 = sized from this rank's CPUs)"
            )
        _check_range(
            f"{section}.function_workers",
            workers,
            0,
            MAX_FUNCTION_WORKERS,
            "reward worker processes per rank; 0 = sized from this rank's CPUs",
        )
        if workers and not self.functions:
            raise ValueError(
                f"{section}.function_workers={workers}: sizes the reward functions' worker "
                f"pool, but {section}.functions is empty; list functions or leave it 0"
            )
        if workers and not self.function_timeout_s:
            raise ValueError(
                f"{section}.function_workers={workers}: with {section}.function_timeout_s=0 "
                "the functions run in the trainer's process (no workers); set "
                f"{section}.function_timeout_s > 0 to run them in {workers} worker processes, "
                "or leave function_workers 0"
            )

    @property
    def uses_engine(self) -> bool:
        """The judge is a local model (judge_dir) run by an engine."""
        return self.backend in LOCAL_JUDGES

    @property
    def shares_policy(self) -> bool:
        """The judge is the policy's base model on the policy's engine (judge_dir="policy")."""
        return self.judge_dir == "policy"

    @property
    def template(self) -> JudgeTemplate:
        """The judge's prompt, from judge_template (built once, when checked)."""
        return self._template

    def check_verdict_format(self) -> None:
        """verdict_parser, its options and the judge's verdict budget (a "module:name" parser
        is imported by check_judge_resources)."""
        section = self.section
        name, options = self.verdict_parser, self.verdict_parser_options
        _check_range(
            f"{section}.verdict_max_tokens",
            self.verdict_max_tokens,
            1,
            MAX_VERDICT_TOKENS,
            "tokens the judge writes per verdict",
        )
        if not isinstance(options, Mapping):
            raise ValueError(
                f"{section}.verdict_parser_options={options!r}: a mapping of the parser's fields"
            )
        if name in VERDICT_PARSERS:
            try:
                VERDICT_PARSERS[name](**options)
            except (TypeError, ValueError) as exc:  # an unknown field, or a bad value
                raise ValueError(
                    f"{section}.verdict_parser_options={dict(options)!r}: {exc}"
                ) from None
        elif not isinstance(name, str) or not is_object_spec(name):
            raise ValueError(
                f"{section}.verdict_parser={name!r}: use one of {tuple(VERDICT_PARSERS)}, or "
                "'module:name' / 'file.py:name' naming a genrm.VerdictParser"
            )
        elif options:
            raise ValueError(
                f"{section}.verdict_parser_options={dict(options)!r}: only for {section}."
                f"verdict_parser in {tuple(VERDICT_PARSERS)}; {name!r} builds its own parser"
            )
        if self.verdict_from == "label_logprobs" and name == "score":
            raise ValueError(
                f"{section}.verdict_from='label_logprobs' reads the probability of a yes/no "
                f"label; {section}.verdict_parser={name!r} writes none: use 'text' or 'auto'"
            )

    def batching_config(self) -> BatchingConfig | None:
        """batching as a BatchingConfig (None when empty: GenRM's defaults)."""
        if not isinstance(self.batching, Mapping):
            raise ValueError(
                f"{self.section}.batching={self.batching!r}: a mapping of "
                "genrm.BatchingConfig fields"
            )
        if not self.batching:
            return None
        try:
            return BatchingConfig(**self.batching)
        except TypeError as exc:  # an unknown field
            raise ValueError(f"{self.section}.batching={dict(self.batching)!r}: {exc}") from None
        except ValueError as exc:
            raise ValueError(f"{self.section}.batching: {exc}") from None

    def openai_config(self) -> OpenAIJudgeConfig:
        """The endpoint's config (backend=openai), its fields typed as declared (YAML's 1e9
        is a float; max_retries an int). Its key is read where it is used."""
        section = self.section
        if not isinstance(self.openai, Mapping):
            raise ValueError(
                f"{section}.openai={self.openai!r}: a mapping of OpenAIJudgeConfig fields"
            )
        try:
            config = OpenAIJudgeConfig(**_typed_ints(OpenAIJudgeConfig, self.openai))
        except TypeError as exc:  # a missing or unknown field
            raise ValueError(f"{section}.openai={dict(self.openai)!r}: {exc}") from None
        except ValueError as exc:
            raise ValueError(f"{section}.openai: {exc}") from None
        _check_range(
            f"{section}.openai.max_retries",
            config.max_retries,
            0,
            MAX_OPENAI_RETRIES,
            "tries after the first per request, each waiting up to max_backoff_s",
        )
        _check_range(
            f"{section}.openai.timeout_s",
            config.timeout_s,
            0.0,
            MAX_OPENAI_TIMEOUT_S,
            "seconds per request",
        )
        return config


def _check_range(name: str, value: float, low: float, high: float, what: str) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r}: a finite number in [{low}, {high}] ({what})")
    if value < low:
        raise ValueError(f"{name}={value!r}: must be >= {low}")
    if value > high:
        raise ValueError(f"{name}={value!r}: must be <= {high} ({what})")


def check_weight(name: str, value: Any) -> None:
    """A reward weight: finite, and small enough that weight x reward fits float32."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or abs(value) > MAX_REWARD_WEIGHT
    ):
        raise ValueError(
            f"{name}={value!r}: must be a finite number within +-{MAX_REWARD_WEIGHT:g} (GRPO "
            "normalizes rewards per group: only the weights' ratios matter)"
        )


def check_no_format_specs(name: str, template: str) -> None:
    """A judge template's fields are filled as they are: a format spec ("{prompt:>99999999}"
    pads the prompt to 100 MB per verdict) or a conversion has no use there."""
    for _, field_name, spec, conversion in string.Formatter().parse(template):
        if field_name is not None and (spec or conversion):
            written = "{" + field_name + (f"!{conversion}" if conversion else "")
            written += (f":{spec}" if spec else "") + "}"
            raise ValueError(
                f"{name}: {written} has a format spec or conversion; write the field as "
                f"{{{field_name}}} (fields are filled as they are)"
            )


def is_object_spec(spec: str) -> bool:
    """'module:name' or 'path/file.py:name' (dotted names allowed), by its shape alone."""
    source, sep, attr = spec.rpartition(":")
    return bool(sep and source and attr) and all(part.isidentifier() for part in attr.split("."))


def _as_float(value: Any, name: str) -> float:
    """A weight as YAML or a command line gives it: a number, or text of one ("1e-3")."""
    if isinstance(value, bool):
        raise ValueError(f"config {name}={value!r}: must be a float")
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            pass
    raise ValueError(f"config {name}={value!r}: must be a float")


def check_functions(
    specs: Any, weights: Any, *, section: str = "JudgeSpec"
) -> tuple[list[str], list[float]]:
    """The reward functions' specs and their weights (check_judge_resources imports them)."""
    if not isinstance(specs, list) or not all(isinstance(spec, str) for spec in specs):
        raise ValueError(f"{section}.functions={specs!r}: a list of 'module:fn' or 'file.py:fn'")
    if not isinstance(weights, list):
        raise ValueError(f"{section}.function_weights={weights!r}: a list of numbers")
    weights = [
        _as_float(weight, f"{section}.function_weights[{index}]")
        for index, weight in enumerate(weights)
    ]
    for index, weight in enumerate(weights):
        check_weight(f"{section}.function_weights[{index}]", weight)
    if weights and len(weights) != len(specs):
        raise ValueError(
            f"{section}.function_weights={weights!r}: one weight per {section}.functions "
            f"entry ({len(specs)}), or [] for 1.0 each"
        )
    seen: dict[tuple[str, str], str] = {}
    for spec in specs:
        key = function_identity(spec)
        if key in seen:
            raise ValueError(
                f"{section}.functions={specs!r}: {spec!r} is listed twice (as {seen[key]!r} "
                f"too); list it once and give it a larger weight in {section}.function_weights"
            )
        seen[key] = spec
    return specs, weights or [1.0] * len(specs)


def check_function_forms(forms: Any, specs: list[str], *, section: str = "JudgeSpec") -> list[str]:
    """The reward functions' calling forms, one per function ([] = "auto" each); whether each
    fits its function's signature is checked when it loads (check_judge_resources)."""
    if not isinstance(forms, list):
        raise ValueError(
            f"{section}.function_forms={forms!r}: a list with one of {FUNCTION_FORMS} per "
            f"{section}.functions entry, or [] to find each from its parameter names"
        )
    for index, form in enumerate(forms):
        if form not in FUNCTION_FORMS:
            raise ValueError(
                f"{section}.function_forms[{index}]={form!r}: use one of {FUNCTION_FORMS} "
                "('trl' is TRL's batch form, 'verl' verl's compute_score)"
            )
    if forms and len(forms) != len(specs):
        raise ValueError(
            f"{section}.function_forms={forms!r}: one form per {section}.functions entry "
            f"({len(specs)}), or [] for 'auto' each"
        )
    return list(forms) or ["auto"] * len(specs)


def function_identity(spec: str) -> tuple[str, str]:
    """What a 'module:fn' or 'file.py:fn' spec names: a file by its absolute, normalized path
    (from the text alone), so 'rewards.py:score' and './rewards.py:score' are one function."""
    source, _, attr = spec.rpartition(":")
    if source.endswith(".py") or "/" in source:
        source = os.path.abspath(source)
    return source, attr


def _typed_ints(cls: type, values: Mapping[str, Any]) -> dict[str, Any]:
    """`values` with integral floats given to int fields as ints (YAML reads 1e9 as a float)."""
    hints = typing.get_type_hints(cls)
    known = {item.name for item in fields(cls)}
    typed = dict(values)
    for key, value in values.items():
        is_integral = isinstance(value, float) and value.is_integer()
        if key in known and hints.get(key) is int and is_integral:
            typed[key] = int(value)
    return typed
