"""What the reference trainer makes of a data row: the policy's prompt and the judge's sample.

    row = {"prompt": "3+4=", "answer": 7}                 # or "prompt": [{role, content}, ...]
    prompt_ids(row["prompt"], tokenizer, should_apply_chat_template)   # what the policy reads
    judge_sample(row, response, prompt_key="prompt", answer_key="answer")  # what the judge reads
    Scored(completion, sample, verdict, prompt)           # one judged response of a round

A prompt that is a list of {role, content} messages always goes through the policy tokenizer's
chat template (plain text only when asked: instruct models); a template that refuses a row's
messages (an unknown role) makes it a bad_prompt skip. The judge reads the messages as
"role: content" lines. The loader has already skipped rows whose prompt or answer is unusable
(`yatt.core.ShardedLoader`, counted by cause); a numeric answer is read as text.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jinja2

from yatt import core, genrm, rollout

logger = logging.getLogger("train_grpo")

Prompt = str | list[dict[str, str]]


class PromptError(ValueError):
    """The policy's chat template refused a row's messages (a strict template, Gemma or
    Mistral style, raises on a role it does not know or on roles that do not alternate)."""


def prompt_ids(prompt: Prompt, tokenizer: Any, should_apply_chat_template: bool) -> list[int]:
    """Token ids of a row's prompt: a message list (or, when asked, plain text as one user
    message) through the tokenizer's chat template, with the assistant turn opened. Raises
    PromptError when the template refuses the messages: the row is a bad_prompt skip."""
    if isinstance(prompt, str) and not should_apply_chat_template:
        return tokenizer(prompt, add_special_tokens=False)["input_ids"]
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except jinja2.TemplateError as exc:  # raise_exception(...) in the template, or an undefined
        roles = [message.get("role") for message in messages]
        raise PromptError(f"the policy's chat template refused roles {roles}: {exc}") from None
    # The chat template already wrote any BOS it wants; don't add a second one.
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def prompt_token_counter(
    tokenizer: Any, should_apply_chat_template: bool
) -> Callable[[Prompt], int]:
    """A row prompt's token count for the loader's length check; 0 for a prompt the chat
    template refuses (the prompt encoder skips it, counted as bad_prompt)."""

    def count_tokens(prompt: Prompt) -> int:
        try:
            return len(prompt_ids(prompt, tokenizer, should_apply_chat_template))
        except PromptError:
            return 0

    return count_tokens


def prompt_text(prompt: Prompt) -> str:
    """What the judge reads as the prompt: a message list as "role: content" lines."""
    if isinstance(prompt, list):
        return "\n".join(f"{message['role']}: {message['content']}" for message in prompt)
    return prompt


def judge_sample(
    row: Mapping[str, Any], response: str, *, prompt_key: str, answer_key: str
) -> genrm.Sample:
    """The judge's view of one response to `row`. The row's fields are template fields too
    (Sample.metadata), so a judge template may name any column, e.g. {rubric}."""
    answer = row.get(answer_key) if answer_key else None
    return genrm.Sample(
        prompt=prompt_text(row[prompt_key]),
        response=response,
        reference=None if answer is None else str(answer),  # e.g. an integer answer
        metadata={key: value for key, value in row.items() if key != core.ROW_INDEX_KEY},
    )


@dataclass(frozen=True)
class Scored:
    """One response, what the judge read of it, and the judge's verdict."""

    completion: rollout.Completion
    sample: genrm.Sample  # what the judge read: prompt text, the response decoded once, reference
    verdict: genrm.Verdict
    # The row, its token ids and its images: a grpo_prompts.Prompt (that module builds on this
    # one, so the type is not imported here: no import circle).
    prompt: Any


def row_fields_read_by(template: genrm.JudgeTemplate, answer_key: str) -> list[str]:
    """The row fields a judge prompt needs: the columns the template names, and the answer
    when it reads {reference}. The loader skips (and counts) rows without them."""
    fields = set(template.fields) - set(SAMPLE_FIELDS)
    if "reference" in template.fields:
        fields.add(answer_key)
    return sorted(fields)


SAMPLE_FIELDS = ("prompt", "response", "reference")  # what every judge sample has


def check_judge_prompts(
    template: genrm.JudgeTemplate,
    rows: Sequence[Mapping[str, Any]],
    *,
    tokenizer: Any,
    max_prompt_tokens: int | None,
    max_response_tokens: int,
    prompt_key: str,
    answer_key: str,
    source: str,
) -> None:
    """Render the judge's prompt for the data's first rows before any model loads: a prompt
    that cannot fit the judge's context with a full-length response fails here, naming the
    fix, instead of turning every verdict of the run into an error."""
    for row in rows:
        sample = judge_sample(row, "", prompt_key=prompt_key, answer_key=answer_key)
        num_tokens = len(template.render_ids(sample, tokenizer)[0])
        if max_prompt_tokens is not None and num_tokens + max_response_tokens > max_prompt_tokens:
            raise ValueError(
                f"reward.engine.max_seq_len: the judge prompt of row {row[core.ROW_INDEX_KEY]} of "
                f"{source} takes {num_tokens} tokens before the response, and a response adds up "
                f"to {max_response_tokens} (rollout.max_new_tokens), over the judge's "
                f"{max_prompt_tokens}; raise reward.engine.max_seq_len or shorten the template"
            )
