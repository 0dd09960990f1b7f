"""The trainer's row handling: chat templates, the judge's view of a row, start-up checks."""

NUM_GPUS = 0

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import grpo_data

from yatt import core, genrm
from yatt.testing import make_tokenizer

MESSAGES = [{"role": "system", "content": "Add."}, {"role": "user", "content": "3+4="}]


def test_message_lists_go_through_the_chat_template_and_plain_text_only_when_asked():
    tokenizer = make_tokenizer()  # a tiny byte-level tokenizer with a chat template
    templated = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = grpo_data.prompt_ids(MESSAGES, tokenizer, should_apply_chat_template=False)
    assert tokenizer.decode(ids) == templated
    assert templated.endswith("3+4=<|im_end|>\n<|im_start|>assistant\n")  # the turn is opened
    plain = grpo_data.prompt_ids("3+4=", tokenizer, should_apply_chat_template=False)
    assert tokenizer.decode(plain) == "3+4="
    as_user = grpo_data.prompt_ids("3+4=", tokenizer, should_apply_chat_template=True)
    one_message = [{"role": "user", "content": "3+4="}]
    assert as_user == grpo_data.prompt_ids(one_message, tokenizer, False)


def test_the_judge_reads_messages_as_lines_and_a_numeric_answer_as_text():
    row = {"prompt": MESSAGES, "answer": 7, "rubric": "exact", core.ROW_INDEX_KEY: 3}
    sample = grpo_data.judge_sample(row, " 7", prompt_key="prompt", answer_key="answer")
    assert sample.prompt == "system: Add.\nuser: 3+4="
    assert sample.reference == "7"
    assert sample.metadata == {"prompt": MESSAGES, "answer": 7, "rubric": "exact"}
    template = genrm.JudgeTemplate(user="{prompt} | {response} | {reference} | {rubric}")
    (message,) = template.render_messages(sample)
    assert message["content"] == "system: Add.\nuser: 3+4= |  7 | 7 | exact"
    no_answer = grpo_data.judge_sample(row, "7", prompt_key="prompt", answer_key="")
    assert no_answer.reference is None


@pytest.mark.parametrize(
    ("template", "answer_key", "fields"),
    [
        ("{prompt}{response} ref {reference}", "answer", ["answer"]),
        ("{prompt}{response} ref {reference} {rubric}", "solution", ["rubric", "solution"]),
        ("{prompt}{response}", "answer", []),  # no reference read: the answer is not required
    ],
)
def test_the_row_fields_a_judge_prompt_needs(template, answer_key, fields):
    judge_template = genrm.JudgeTemplate(user=template)
    assert grpo_data.row_fields_read_by(judge_template, answer_key) == fields


def test_a_judge_prompt_that_cannot_fit_the_judges_context_fails_with_the_fix():
    tokenizer = make_tokenizer()
    tokenizer.chat_template = None
    template = genrm.JudgeTemplate(user="{prompt}{response} ref {reference}")
    rows = [{"prompt": "3+4=", "answer": "7", core.ROW_INDEX_KEY: 0}]
    check = dict(
        tokenizer=tokenizer, prompt_key="prompt", answer_key="answer", source="data.path='x'"
    )
    grpo_data.check_judge_prompts(
        template, rows, max_prompt_tokens=95, max_response_tokens=4, **check
    )
    grpo_data.check_judge_prompts(
        template, rows, max_prompt_tokens=None, max_response_tokens=4, **check
    )
    with pytest.raises(
        ValueError,
        match=r"row 0 of data.path='x' takes \d+ tokens.*up to 4 .*over the judge's 12; raise reward\.engine\.max_seq_len",
    ):
        grpo_data.check_judge_prompts(
            template, rows, max_prompt_tokens=12, max_response_tokens=4, **check
        )
