NUM_GPUS = 0

import pytest

from yatt.genrm import JudgeTemplate, Sample, pointwise_template, verification_template
from yatt.genrm._templates import truncate_middle
from yatt.genrm.testing import ByteTokenizer
from yatt.testing import make_tokenizer


@pytest.fixture(scope="module")
def chat_tokenizer():
    return make_tokenizer()


def _sample(**kwargs) -> Sample:
    defaults = {"prompt": "What is 2+2?", "response": "It is \\boxed{4}.", "reference": "4"}
    return Sample(**{**defaults, **kwargs})


def test_verification_renders_through_chat_template(chat_tokenizer) -> None:
    template = verification_template()
    ids, is_truncated = template.render_ids(_sample(), chat_tokenizer)
    text = chat_tokenizer.decode(ids)
    assert not is_truncated
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>assistant\n")  # the generation prompt opens the turn
    for part in ("What is 2+2?", "It is \\boxed{4}.", "Reference answer:\n4", "Yes or No"):
        assert part in text


def test_plain_format_without_chat_template() -> None:
    tokenizer = ByteTokenizer()
    template = JudgeTemplate(user="Q: {prompt}\nA: {response}", system="Judge.")
    ids, _ = template.render_ids(_sample(), tokenizer)
    assert tokenizer.decode(ids) == "Judge.\n\nQ: What is 2+2?\nA: It is \\boxed{4}.\n"


def test_pointwise_template_states_its_scale() -> None:
    messages = pointwise_template(low=0, high=5).render_messages(_sample())
    assert "from 0 to 5" in messages[-1]["content"]
    assert "{low}" not in messages[-1]["content"]


def test_user_template_reads_metadata_fields() -> None:
    template = JudgeTemplate(user="[{rubric}] {prompt} -> {response}")
    sample = _sample(metadata={"rubric": "be strict"})
    (message,) = template.render_messages(sample)
    assert message == {"role": "user", "content": "[be strict] What is 2+2? -> It is \\boxed{4}."}
    assert template.fields == {"rubric", "prompt", "response"}


def test_sample_text_with_braces_is_not_reformatted() -> None:
    template = JudgeTemplate(user="{response}")
    (message,) = template.render_messages(_sample(response="{prompt} {0} {{x}}"))
    assert message["content"] == "{prompt} {0} {{x}}"


@pytest.mark.parametrize(
    ("template", "sample_kwargs", "field"),
    [
        (verification_template(), {"reference": None}, "reference"),
        (JudgeTemplate(user="{prompt} {rubric}"), {}, "rubric"),
    ],
    ids=["reference_none", "metadata_missing"],
)
def test_missing_field_is_named(template, sample_kwargs, field) -> None:
    with pytest.raises(ValueError, match=rf"template field \{{{field}\}} is missing"):
        template.render_messages(_sample(**sample_kwargs))


@pytest.mark.parametrize(
    ("user", "match"),
    [
        ("{}", "named fields"),
        ("{0}", "named fields"),
        ("{prompt.upper}", "named fields"),
        ("unclosed {prompt", "not valid format text"),
        ("   ", "non-empty"),
    ],
    ids=["positional", "index", "attribute", "unclosed", "blank"],
)
def test_bad_templates_fail_at_construction(user: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        JudgeTemplate(user=user)


def test_long_response_is_cut_in_the_middle_with_a_note(chat_tokenizer) -> None:
    response = "HEAD " + "x" * 5000 + " FINAL ANSWER 42"
    template = verification_template(max_response_tokens=64)
    ids, is_truncated = template.render_ids(_sample(response=response), chat_tokenizer)
    text = chat_tokenizer.decode(ids)
    assert is_truncated
    assert "HEAD" in text and "FINAL ANSWER 42" in text  # the answer at the end survives
    assert "tokens omitted" in text
    assert len(ids) < 64 + 400  # the template's own text plus 64 response tokens


@pytest.mark.parametrize("tokenizer", [None, ByteTokenizer()], ids=["chars", "tokens"])
def test_truncate_middle_keeps_short_text(tokenizer) -> None:
    assert truncate_middle("short", 16, tokenizer) == "short"
    cut = truncate_middle("a" * 100 + "b" * 100, 16, tokenizer)
    assert cut.startswith("a") and cut.endswith("b") and "omitted" in cut
