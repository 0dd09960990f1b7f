"""A JudgeSpec made into the scorer a trainer calls: the judge (a GenRM on a local engine, an
OpenAI-compatible endpoint, or none), plus the reward functions and the exact-match rule.

    check_judge_resources(spec)          # before any model loads
    scorer, exact_match = build_judge(spec, judge_engine, closeables)

`judge_engine` is the caller's (rollout.build_engine(spec, spec.judge_dir, ...) for a local
judge; None otherwise): a trainer places it beside its other roles. What build_judge starts
(reward function workers, the combined scorer) goes into `closeables`.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from yatt.genrm._combine import CombinedRM
from yatt.genrm._functions import RewardFunction, check_reward_function
from yatt.genrm._functions import load_reward_functions as load_function_pool
from yatt.genrm._genrm import GenRM
from yatt.genrm._judge_spec import VERDICT_PARSERS, JudgeSpec
from yatt.genrm._openai import OpenAIJudge
from yatt.genrm._parsers import VerdictParser, YesNoParser
from yatt.genrm._reward_forms import RewardFormError
from yatt.genrm._verifiers import ExactMatch
from yatt.rollout import SamplingParams, UserCodePool


def build_judge(
    spec: JudgeSpec, judge_engine: Any, closeables: list[Any] | None = None
) -> tuple[Any, ExactMatch]:
    """The reward: the judge's verdict, read from its last line by spec.verdict_parser (the
    default yes/no: in [-1, 1], 2 P(Yes) - 1 from a local engine's label probabilities, +1/-1
    from the text; a local engine, a served endpoint, or none), plus the reward functions and,
    when rule_weight > 0, an exact-match rule. The exact match is also the accuracy metric's
    ground truth. What owns threads or processes goes into `closeables` (the judge engine is
    the caller's). An endpoint is checked first: unreachable, refused key, unknown model."""
    sampling = SamplingParams(
        temperature=float(spec.votes > 1), max_new_tokens=spec.verdict_max_tokens
    )
    judge: Any = None
    if spec.uses_engine:
        # The declared verdict: the judge's last line; a yes/no label's probability there is
        # the reward unless verdict_from="text".
        judge = GenRM(
            judge_engine,
            template=spec.template,
            parser=build_verdict_parser(spec),
            verdict_from=spec.verdict_from,
            votes=spec.votes,
            sampling=sampling,
            batching=spec.batching_config(),
        )
    elif spec.backend == "openai":
        judge = OpenAIJudge(
            spec.openai_config(),
            template=spec.template,
            parser=build_verdict_parser(spec),
            votes=spec.votes,
            sampling=sampling,
        )
        judge.check_endpoint()  # unreachable, refused key, unknown model: fail before training
    exact_match = ExactMatch()
    rules: list[tuple[Any, float]] = list(
        load_reward_functions(spec, timeout_s=spec.function_timeout_s or None)
    )
    owned: list[Any] = [function for function, _ in rules]
    if spec.rule_weight:
        rules.append((exact_match, spec.rule_weight))
    scorer = CombinedRM(judge, rules) if rules else judge
    if rules:
        owned.append(scorer)
    if closeables is not None:
        closeables.extend(owned)
    return scorer, exact_match


def check_judge_resources(spec: JudgeSpec) -> None:
    """What the spec's values point at, before any model loads: the engine's package
    installed, each reward function loaded once (its module imports, its signature fits), the
    verdict parser built, the endpoint's API key set."""
    spec.check_installed()
    for function, _ in load_reward_functions(spec, timeout_s=None):
        function.close()
    parser = build_verdict_parser(spec)
    if spec.verdict_from == "label_logprobs" and not isinstance(parser, YesNoParser):
        raise ValueError(
            f"{spec.section}.verdict_from='label_logprobs' reads the probability of a yes/no "
            f"label; {spec.section}.verdict_parser={spec.verdict_parser!r} is a "
            f"{type(parser).__name__}: use 'text' or 'auto'"
        )
    if spec.backend == "openai":
        try:
            spec.openai_config().read_api_key()
        except ValueError as exc:
            raise ValueError(f"{spec.section}.openai: {exc}") from None


def load_reward_functions(
    spec: JudgeSpec, *, timeout_s: float | None
) -> list[tuple[RewardFunction, float]]:
    """spec.functions, each loaded with its weight and called in its form (function_forms).
    With timeout_s their calls share one pool of function_workers worker processes (0: sized
    from this rank's CPUs); close() each function, the pool goes with the last. Without, each
    runs in this process. ValueError naming `<section>.functions` or, for a form that is not
    given and cannot be found, or does not fit, `<section>.function_forms`."""
    section = spec.section
    for index, (function_spec, form) in enumerate(
        zip(spec.functions, spec.function_forms, strict=True)
    ):
        try:
            fn, name = UserCodePool.resolve(function_spec, what="reward function")
            check_reward_function(fn, name, form)
        except RewardFormError as exc:
            if form == "auto" and not exc.is_ambiguous:  # the function fits no form
                raise ValueError(
                    f"{section}.functions: {exc} in {section}.function_forms"
                ) from None
            raise ValueError(
                f"{section}.function_forms[{index}] ({function_spec!r}, form {form!r}): {exc} "
                f"in {section}.function_forms (one per function)"
            ) from None
        except ValueError as exc:
            raise ValueError(f"{section}.functions: {exc}") from None
    try:
        return load_function_pool(
            spec.functions,
            weights=spec.function_weights,
            forms=spec.function_forms,
            timeout_s=timeout_s,
            num_workers=spec.function_workers or default_function_workers(),
        )
    except ValueError as exc:  # checked above: only what changed on disk since
        raise ValueError(f"{section}.functions: {exc}") from None


def default_function_workers() -> int:
    """Reward worker processes for one rank: the CPUs it may use (its affinity, shared by the
    ranks torchrun started on this machine) less one left to the trainer, in [1, 8]."""
    try:
        num_cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        num_cpus = os.cpu_count() or 1
    local_ranks = os.environ.get("LOCAL_WORLD_SIZE", "1")
    num_local_ranks = int(local_ranks) if local_ranks.isdigit() and int(local_ranks) > 0 else 1
    return max(1, min(8, num_cpus // num_local_ranks - 1))


def build_verdict_parser(spec: JudgeSpec) -> VerdictParser:
    """spec.verdict_parser: a built-in format with verdict_parser_options, or the object a
    "module:name" / "file.py:name" spec names (a parser, or a callable making one)."""
    name = spec.verdict_parser
    if name in VERDICT_PARSERS:
        return VERDICT_PARSERS[name](**spec.verdict_parser_options)
    parser = load_object(name, field=f"{spec.section}.verdict_parser")
    if isinstance(parser, type) or (callable(parser) and not hasattr(parser, "parse")):
        parser = parser()  # a class or a factory: the parser it makes
    if not callable(getattr(parser, "parse", None)):
        raise ValueError(
            f"{spec.section}.verdict_parser={name!r} gives a {type(parser).__name__}, not a "
            "verdict parser: name an object with parse(text) -> float | None "
            "(genrm.VerdictParser), or a callable returning one"
        )
    return parser


def load_object(spec: str, *, field: str) -> Any:
    """The object at "module:name" (imported) or "path/file.py:name" (run once per process,
    as the module of its file's name); `name` may be dotted. ValueError naming `field`."""
    source, _, attr = spec.rpartition(":")
    try:
        if source.endswith(".py") or "/" in source:
            path = Path(source).expanduser().resolve()
            module_name = f"_yatt_verdict_parser_{path.stem}"
            module = sys.modules.get(module_name)
            if module is None:
                if not path.is_file():
                    raise ValueError(f"no such file {str(path)!r}")
                file_spec = importlib.util.spec_from_file_location(module_name, path)
                module = importlib.util.module_from_spec(file_spec)
                sys.modules[module_name] = module
                try:
                    file_spec.loader.exec_module(module)
                except BaseException:
                    del sys.modules[module_name]
                    raise
        else:
            module = importlib.import_module(source)
        found: Any = module
        for part in attr.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"{field}={spec!r}: {exc}") from None
    except (Exception, SystemExit) as exc:  # the module's own code failed while loading
        raise ValueError(
            f"{field}={spec!r}: loading it failed ({type(exc).__name__}: {exc})"
        ) from None
    return found
