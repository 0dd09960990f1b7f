"""The three shapes a reward function comes in, and how a sample becomes each one's call.

    "sample" (yatt):  fn(prompt, response, reference, row) -> float | dict | None
    "trl"    (TRL):   fn(prompts=[...], completions=[...], **columns) -> list[float | None]
                      one call per batch; columns are the rows' other fields, one list each
    "verl"   (verl):  compute_score(data_source=, solution_str=, ground_truth=, extra_info=)
                      -> float | dict; data_source and extra_info from the row's fields of
                      those names, ground_truth the reference (else row.reward_model.ground_truth)

A dict return gives the reward under "score" (verl's convention) and its other numeric values as
named metrics. The form is given (`form=`) or found from parameter *names* ("solution_str" and
"ground_truth": verl; "completions": TRL; else the yatt form when four positional arguments
bind), never from how many parameters there are: verl's four-parameter compute_score would bind
as the yatt form and be fed the prompt as its data_source. A signature the names cannot settle
(verl's and TRL's names at once, or only *args / **kwargs, which bind as every form) is an
error until its form is given: guessing would feed it the wrong values without a word.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any, Literal

from yatt.genrm._types import Sample

RewardForm = Literal["sample", "trl", "verl"]
REWARD_FORMS: tuple[str, ...] = ("auto", "sample", "trl", "verl")
SAMPLE_CALL = "fn(prompt, response, reference, row)"
TRL_CALL = "fn(prompts, completions, **columns) -> list"
VERL_CALL = "compute_score(data_source, solution_str, ground_truth, extra_info)"
VERL_PARAMETERS = ("data_source", "solution_str", "ground_truth", "extra_info")
# Row fields TRL does not pass as columns (it passes the prompt and completion itself).
_TRL_NOT_COLUMNS = ("prompt", "completion", "completion_ids")


def _parameters(fn: object) -> dict[str, inspect.Parameter] | None:
    try:
        return dict(inspect.signature(fn).parameters)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None  # a builtin without a signature


class RewardFormError(ValueError):
    """A reward function's form: unknown, not found from its names (`is_ambiguous`), or not
    fitting it (a ValueError; the trainer's config names reward.function_forms for it)."""

    def __init__(self, message: str, *, is_ambiguous: bool = False) -> None:
        super().__init__(message)
        self.is_ambiguous = is_ambiguous


def detect_form(fn: object, name: str, form: str = "auto") -> RewardForm:
    """The form `fn` is called in: `form`, checked against fn's signature, or (form "auto")
    found from its parameter names. RewardFormError (a ValueError) saying what to fix."""
    if form not in REWARD_FORMS:
        raise RewardFormError(f"reward function {name!r}: form={form!r}: use one of {REWARD_FORMS}")
    parameters = _parameters(fn)
    if form == "auto":
        form = "sample" if parameters is None else _form_by_names(fn, name, parameters)
    if parameters is not None:
        _check_binds(fn, name, form)
    return form  # type: ignore[return-value]


def _form_by_names(fn: Any, name: str, parameters: dict[str, inspect.Parameter]) -> str:
    is_verl = "solution_str" in parameters and "ground_truth" in parameters
    is_trl = "completions" in parameters
    is_unnamed = all(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters.values())
    if (is_verl and is_trl) or (is_unnamed and parameters):
        why = (
            "its parameters name both verl's (solution_str, ground_truth) and TRL's (completions)"
            if is_verl and is_trl
            else "it takes only *args / **kwargs, which bind as every form"
        )
        raise RewardFormError(
            f"reward function {name}{inspect.signature(fn)}: its form cannot be told from its "
            f"parameter names ({why}); set its form: 'sample' ({SAMPLE_CALL}), 'trl' "
            f"({TRL_CALL}) or 'verl' ({VERL_CALL})",
            is_ambiguous=True,
        )
    if is_verl:
        return "verl"
    return "trl" if is_trl else "sample"


def _check_binds(fn: Any, name: str, form: str) -> None:
    signature = inspect.signature(fn)
    try:
        if form == "sample":
            signature.bind(None, None, None, None)
        elif form == "trl":
            # Other required parameters are dataset columns, passed by name at each call.
            columns = {
                key: []
                for key, p in signature.parameters.items()
                if key not in ("prompts", "completions")
                and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                and p.default is p.empty
            }
            signature.bind(prompts=[], completions=[], **columns)
        else:
            signature.bind(**verl_kwargs_for(fn, dict.fromkeys(VERL_PARAMETERS)))
            if not {"solution_str", "ground_truth"} <= set(signature.parameters) and not any(
                p.kind == p.VAR_KEYWORD for p in signature.parameters.values()
            ):
                raise TypeError("it takes neither solution_str nor ground_truth")
    except TypeError as e:
        call = {"sample": SAMPLE_CALL, "trl": TRL_CALL, "verl": VERL_CALL}[form]
        raise RewardFormError(
            f"reward function {name}{signature} cannot be called as {call} ({e}); give it "
            f"that signature, or set its form: {REWARD_FORMS[1:]} (yatt's per sample, TRL's "
            "batch, verl's compute_score)"
        ) from None


def verl_kwargs_for(fn: Any, values: dict[str, Any]) -> dict[str, Any]:
    """The verl arguments `fn` takes (all four when it takes **kwargs), as verl passes them."""
    parameters = _parameters(fn)
    if parameters is None or any(p.kind == p.VAR_KEYWORD for p in parameters.values()):
        return values
    return {key: value for key, value in values.items() if key in parameters}


def sample_call(sample: Sample) -> tuple[tuple, dict[str, Any]]:
    """(args, kwargs) of the yatt form for `sample`."""
    return (sample.prompt, sample.response, sample.reference, sample.metadata), {}


def verl_call(fn: Any, sample: Sample) -> tuple[tuple, dict[str, Any]]:
    """(args, kwargs) of verl's compute_score for `sample`, keywords as verl's reward manager
    passes them."""
    row = sample.metadata
    ground_truth: Any = sample.reference
    if ground_truth is None:
        # verl's parquet keeps the answer at reward_model.ground_truth.
        reward_model = row.get("reward_model")
        if isinstance(reward_model, dict):
            ground_truth = reward_model.get("ground_truth")
    values = {
        "data_source": row.get("data_source"),
        "solution_str": sample.response,
        "ground_truth": ground_truth,
        "extra_info": row.get("extra_info"),
    }
    return (), verl_kwargs_for(fn, values)


def trl_call(samples: Sequence[Sample]) -> tuple[tuple, dict[str, Any]]:
    """(args, kwargs) of TRL's batch form for `samples`: prompts and completions in TRL's
    conversational shape (message lists) when the rows' "prompt" field is a message list,
    else as text; every other row field as a column (a list, None where a row lacks it)."""
    is_chat = all(_is_messages(s.metadata.get("prompt")) for s in samples) and bool(samples)
    if is_chat:
        prompts: list[Any] = [s.metadata["prompt"] for s in samples]
        completions: list[Any] = [[{"role": "assistant", "content": s.response}] for s in samples]
    else:
        prompts = [s.prompt for s in samples]
        completions = [s.response for s in samples]
    keys: dict[str, None] = {}
    for sample in samples:
        keys.update(dict.fromkeys(k for k in sample.metadata if k not in _TRL_NOT_COLUMNS))
    columns = {key: [s.metadata.get(key) for s in samples] for key in keys}
    return (), {"prompts": prompts, "completions": completions, **columns}


def _is_messages(value: object) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)
    )
