NUM_GPUS = 0

import pytest

from yatt.genrm import (
    JudgeTemplate,
    Sample,
    ScoreParser,
    YesNoParser,
    pointwise_template,
    verification_template,
)
from yatt.genrm._templates import MAX_CHARS_PER_TOKEN, truncate_middle
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
    assert "omitted: response too long for the judge" in text
    assert len(ids) < 64 + 400  # the template's own text plus 64 response tokens


@pytest.mark.parametrize("tokenizer", [None, ByteTokenizer()], ids=["chars", "tokens"])
def test_truncate_middle_keeps_short_text(tokenizer) -> None:
    assert truncate_middle("short", 16, tokenizer) == "short"
    cut = truncate_middle("a" * 100 + "b" * 100, 16, tokenizer)
    assert cut.startswith("a") and cut.endswith("b") and "omitted" in cut


class CountingTokenizer(ByteTokenizer):
    """Records the length of every text it encodes."""

    def __init__(self) -> None:
        self.encoded_lengths: list[int] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.encoded_lengths.append(len(text))
        return super().encode(text, add_special_tokens)


def test_runaway_response_is_cut_by_characters_before_tokenizing() -> None:
    tokenizer = CountingTokenizer()
    response = "HEAD " + "x" * (8 << 20) + " FINAL ANSWER 42"
    template = JudgeTemplate(user="{response}", max_response_tokens=64)
    ids, is_truncated = template.render_ids(_sample(response=response), tokenizer)
    text = tokenizer.decode(ids)
    assert is_truncated
    assert text.startswith("HEAD") and text.endswith("FINAL ANSWER 42\n")
    assert "characters omitted" in text
    # Only the two ends were tokenized, never the 8 MiB.
    assert max(tokenizer.encoded_lengths) <= 64 * MAX_CHARS_PER_TOKEN + 200
    assert len(ids) < 64 + 200


@pytest.mark.parametrize(
    ("template", "parser", "replies"),
    [
        (
            verification_template(),
            YesNoParser(),
            {"Yes": 1.0, "No.": -1.0, "**No**": -1.0, "Reply with one word: Yes or No.": None},
        ),
        (
            verification_template(parser=YesNoParser(is_boxed=True)),
            YesNoParser(is_boxed=True),
            {
                "Wrong sum.\nVerdict: \\boxed{No}": -1.0,
                "\\boxed{Yes}": 1.0,
                "Yes": None,
            },
        ),
        (
            verification_template(with_reference=False),
            YesNoParser(),
            {"yes": 1.0, "NO": -1.0},
        ),
        (
            pointwise_template(low=1, high=10),
            ScoreParser(low=1, high=10),
            {
                "Clear and right.\nScore: 10": 1.0,
                "Score: 4": 1 / 3,
                "Score: 4\nThanks!": None,
                "End your reply with a last line that is exactly 'Score: N'": None,
            },
        ),
    ],
    ids=["verification", "verification_no_reference", "verification_boxed", "pointwise"],
)
def test_templates_ask_for_what_their_parser_reads(template, parser, replies) -> None:
    (*_, user) = template.render_messages(_sample())
    instruction = user["content"].rsplit("\n\n", 1)[-1]
    is_yes_no = "Yes or No" in instruction or "\\boxed{Yes}" in instruction
    assert is_yes_no == isinstance(parser, YesNoParser)
    assert ("'Score: N'" in instruction) == isinstance(parser, ScoreParser)
    # A judge that follows the instruction parses; one that echoes it does not.
    for reply, reward in replies.items():
        assert parser.parse(reply) == (pytest.approx(reward) if reward is not None else None)


def test_pointwise_template_refuses_a_parser_of_another_range() -> None:
    with pytest.raises(ValueError, match="same range"):
        pointwise_template(low=1, high=10, parser=ScoreParser(low=0, high=5))


def test_an_image_template_puts_one_image_part_per_image_before_the_text() -> None:
    template = JudgeTemplate(user="Q={prompt} R={response}", system="S", image_key="image")
    assert template.shows_images and not verification_template().shows_images
    one = _sample(metadata={"image": "pixels"})
    two = _sample(metadata={"image": ["a", "b"]})
    assert template.render_messages(one) == [
        {"role": "system", "content": "S"},
        {
            "role": "user",
            "content": [
                {"type": "image"},
                {"type": "text", "text": "Q=What is 2+2? R=It is \\boxed{4}."},
            ],
        },
    ]
    assert [p["type"] for p in template.render_messages(two)[-1]["content"]] == [
        "image",
        "image",
        "text",
    ]
    assert template.sample_images(two) == ["a", "b"]
    # Without image_key the row's image is never shown, the content stays a string.
    assert isinstance(verification_template().render_messages(one)[-1]["content"], str)
    for metadata in ({}, {"image": None}, {"image": []}, {"image": ["a", None]}):
        with pytest.raises(ValueError, match=r"has no image in metadata\['image'\]"):
            template.render_messages(_sample(metadata=metadata))


def test_an_image_template_renders_placeholders_through_the_chat_template() -> None:
    from yatt.testing import VISION_TOKENS, VLM_CHAT_TEMPLATE

    tokenizer = make_tokenizer(extra_special_tokens=VISION_TOKENS)
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    template = JudgeTemplate(user="R={response}", image_key="image")
    ids, _ = template.render_ids(_sample(metadata={"image": ["a", "b"]}), tokenizer)
    image_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert ids.count(image_id) == 2
    text = tokenizer.decode(ids)
    assert "<|vision_start|><|image_pad|><|vision_end|>" * 2 + "R=It is" in text
    with pytest.raises(ValueError, match="has no chat template to place the images"):
        template.render_ids(_sample(metadata={"image": "a"}), ByteTokenizer())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param({"image_key": ""}, "image_key=''", id="empty"),
        pytest.param({"image_key": 3}, "image_key=3", id="not-a-str"),
        pytest.param(
            {"image_key": "image", "user": "{image} {response}"}, "drop the field", id="field"
        ),
    ],
)
def test_bad_image_keys_are_rejected(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        JudgeTemplate(**{"user": "{response}", **kwargs})
