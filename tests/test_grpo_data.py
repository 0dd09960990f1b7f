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


def test_the_judge_reads_nested_fields_named_with_dots():
    """verl's GSM8K layout: the answer under reward_model.ground_truth (it read None before)."""
    row = {
        "data_source": "openai/gsm8k",
        "prompt": MESSAGES,
        "reward_model": {"style": "rule", "ground_truth": "72"},
        "extra_info": {"split": "train", "index": 0},
    }
    sample = grpo_data.judge_sample(
        row, "72", prompt_key="prompt", answer_key="reward_model.ground_truth"
    )
    assert sample.reference == "72"
    assert sample.prompt == "system: Add.\nuser: 3+4="


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


# A strict chat template (Gemma and Mistral raise like this on a role they do not know).
STRICT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
    "{{ raise_exception('Conversation roles must be user/assistant') }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _strict_encoder(tmp_path):
    from types import SimpleNamespace

    import grpo_prompts

    tokenizer = make_tokenizer()
    tokenizer.chat_template = STRICT_TEMPLATE
    cfg = SimpleNamespace(
        data=SimpleNamespace(
            prompt_key="prompt", image_key="", max_images=4, apply_chat_template=False
        ),
        rollout=SimpleNamespace(max_prompt_tokens=64 - 4),  # max_seq_len 64, max_new_tokens 4
        policy=SimpleNamespace(model_dir=str(tmp_path)),  # no config.json: a text policy
    )
    return grpo_prompts.PromptEncoder(cfg, tokenizer), tokenizer


def test_a_chat_template_that_refuses_a_row_makes_it_a_counted_bad_prompt_skip(tmp_path):
    encoder, tokenizer = _strict_encoder(tmp_path)
    tool = [{"role": "tool", "content": "42"}, {"role": "user", "content": "3+4="}]
    with pytest.raises(grpo_data.PromptError, match=r"refused roles \['tool', 'user'\]: Conv"):
        grpo_data.prompt_ids(tool, tokenizer, should_apply_chat_template=False)
    user = [{"role": "user", "content": "3+4="}]
    rows = [
        {"prompt": tool, core.ROW_INDEX_KEY: 0},
        {"prompt": user, core.ROW_INDEX_KEY: 1},
        {"prompt": "1+1=", core.ROW_INDEX_KEY: 2},  # plain text: no template
    ]
    prompts = encoder.encode(rows)
    assert [p.row[core.ROW_INDEX_KEY] for p in prompts] == [1, 2]
    assert encoder.skipped == {"bad_prompt": 1}
    assert tokenizer.decode(prompts[0].ids).endswith("3+4=<|im_end|>\n<|im_start|>assistant\n")
    encoder.check(rows, source="data.path='x'")  # one usable row is enough
    with pytest.raises(
        ValueError, match=r"data\.path='x': none of its first 2 usable rows .*bad_prompt"
    ):
        encoder.check([rows[0], rows[0]], source="data.path='x'")
