"""What the reference trainer makes of a data row: the policy's prompt and the judge's sample.

    row = {"prompt": "3+4=", "answer": 7}                 # or "prompt": [{role, content}, ...]
    core.prompt_ids(row["prompt"], tokenizer, should_apply_chat_template)  # the policy's ids
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
from collections.abc import Mapping, Sequence
from typing import Any

from yatt import core, genrm

logger = logging.getLogger("train_grpo")

# The prompt functions are yatt.core's (PromptError, prompt_ids, prompt_token_counter,
# prompt_text), kept importable from here for the trainer's modules.
PromptError = core.PromptError
prompt_ids = core.prompt_ids
prompt_token_counter = core.prompt_token_counter
prompt_text = core.prompt_text


def judge_sample(
    row: Mapping[str, Any], response: str, *, prompt_key: str, answer_key: str
) -> genrm.Sample:
    """The judge's view of one response to `row`. The row's fields are template fields too
    (Sample.metadata), so a judge template may name any column, e.g. {rubric}. The keys may
    name nested fields with dots (verl's `reward_model.ground_truth`)."""
    answer = core.get_field(row, answer_key) if answer_key else None
    return genrm.Sample(
        prompt=prompt_text(core.get_field(row, prompt_key)),
        response=response,
        reference=None if answer is None else str(answer),  # e.g. an integer answer
        metadata={key: value for key, value in row.items() if key != core.ROW_INDEX_KEY},
    )


# One response, what the judge read of it, its verdict and its prompt (a core.Prompt: the row,
# its token ids and its images): yatt.genrm's JudgedSample.
Scored = genrm.JudgedSample


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
