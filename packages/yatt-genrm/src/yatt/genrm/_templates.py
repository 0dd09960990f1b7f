"""Judge prompts: a sample's fields -> the judge's prompt token ids.

A template is `str.format` text with named fields: `prompt`, `response`, `reference`, and any key
of `Sample.metadata`. It is rendered as a chat (system + user message) through the judge
tokenizer's chat template when the tokenizer has one, else as plain text. Long responses are cut
in the middle (the head shows the approach, the tail holds the final answer) with a note, so a
runaway rollout never overflows the judge's context nor fails the run.

Images: by default the judge reads text only, whatever the row holds. With `image_key`, the
sample's image(s) in `Sample.metadata[image_key]` (one image or a list) are shown before the
user text, as {"type": "image"} parts of the user message (the Hugging Face multimodal message
format): a vision-language judge's chat template writes their placeholders, and OpenAIJudge
sends them as image_url parts.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Any

from yatt.genrm._images import images_of
from yatt.genrm._parsers import ScoreParser, YesNoParser
from yatt.genrm._types import Sample

SAMPLE_FIELDS = ("prompt", "response", "reference")
# Responses longer than max_response_tokens times this are cut by characters before they are
# tokenized. Tokens of common tokenizers average 3-5 characters; 16 leaves room for long ones
# (runs of spaces in code) while bounding the tokenizer's work on a runaway response.
MAX_CHARS_PER_TOKEN = 16

_VERIFICATION_USER = (
    "Question:\n{prompt}\n\n"
    "Reference answer:\n{reference}\n\n"
    "Response to grade:\n{response}\n\n"
    "Is the response's final answer correct (equivalent to the reference answer)? "
)
_VERIFICATION_USER_NO_REFERENCE = (
    "Question:\n{prompt}\n\n"
    "Response to grade:\n{response}\n\n"
    "Is the response's final answer correct? "
)
# The default parsers read a bare label line, so "one word" is one of their formats.
_ONE_WORD = "Reply with one word: Yes or No."
_POINTWISE_USER = (
    "Question:\n{prompt}\n\n"
    "Response to rate:\n{response}\n\n"
    "Rate the response's correctness and helpfulness on a scale from {low} to {high}. "
)


@dataclass(kw_only=True, frozen=True)
class JudgeTemplate:
    """How a sample is shown to the judge."""

    user: str  # str.format text with named fields; write literal braces as {{ }}
    system: str | None = None  # system message (plain text; no fields)
    max_response_tokens: int = 4096  # responses longer than this are cut in the middle
    # The Sample.metadata field whose image(s) the judge sees (a vision-language judge); None:
    # text only, the default, even when the row holds images.
    image_key: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.user, str) or not self.user.strip():
            raise ValueError("JudgeTemplate.user must be a non-empty str")
        if self.max_response_tokens < 16:
            raise ValueError(
                f"JudgeTemplate.max_response_tokens={self.max_response_tokens!r}: must be >= 16"
            )
        try:
            parsed = list(string.Formatter().parse(self.user))
        except ValueError as e:
            raise ValueError(
                f"JudgeTemplate.user is not valid format text ({e}); write literal braces as {{{{ }}}}"
            ) from None
        for _, name, _, _ in parsed:
            if name is None:
                continue
            if not name.isidentifier():
                raise ValueError(
                    f"JudgeTemplate.user field {{{name}}}: use named fields such as {{prompt}}, "
                    "{response}, {reference} (no positional or attribute/index fields)"
                )
        if self.image_key is not None:
            if not isinstance(self.image_key, str) or not self.image_key:
                raise ValueError(
                    f"JudgeTemplate.image_key={self.image_key!r}: the Sample.metadata field "
                    "holding the images (e.g. 'image'), or None for a text-only judge"
                )
            if self.image_key in self.fields:
                raise ValueError(
                    f"JudgeTemplate.user has the field {{{self.image_key}}}, which is image_key: "
                    "the images are shown as image parts before the text; drop the field"
                )

    @property
    def shows_images(self) -> bool:
        """Whether the judge is shown the sample's images."""
        return self.image_key is not None

    def sample_images(self, sample: Sample) -> list[Any]:
        """The images the judge is shown ([] for a text-only template); ValueError when the
        sample has none."""
        if self.image_key is None:
            return []
        value = sample.metadata.get(self.image_key)
        images = [] if value is None else images_of(value)
        if not images or any(image is None for image in images):
            raise ValueError(
                f"sample {sample.id!r} has no image in metadata[{self.image_key!r}], which "
                "the judge template shows (image_key); give every sample its image(s), or use "
                "a template without image_key"
            )
        return images

    @property
    def fields(self) -> frozenset[str]:
        """The field names the template reads."""
        return frozenset(
            name for _, name, _, _ in string.Formatter().parse(self.user) if name is not None
        )

    def render_messages(self, sample: Sample, *, tokenizer: Any = None) -> list[dict[str, Any]]:
        """The chat messages for `sample`; ValueError names a field the sample cannot fill.

        With image_key, the user message's content is a list: one {"type": "image"} part per
        image, then {"type": "text", "text": ...}."""
        return self._render_messages(sample, tokenizer)[0]

    def _render_messages(self, sample: Sample, tokenizer: Any) -> tuple[list[dict[str, Any]], bool]:
        response = truncate_middle(sample.response, self.max_response_tokens, tokenizer)
        is_truncated = response is not sample.response
        values: dict[str, Any] = dict(sample.metadata)
        values.update(prompt=sample.prompt, response=response, reference=sample.reference)
        for name in self.fields:
            if values.get(name) is None:
                raise ValueError(
                    f"template field {{{name}}} is missing for sample {sample.id!r}: "
                    + (
                        "its reference is None; give every sample a reference or use a "
                        "template without {reference}"
                        if name == "reference"
                        else f"put {name!r} in Sample.metadata or drop {{{name}}} from the template"
                    )
                )
        messages: list[dict[str, Any]] = []
        if self.system is not None:
            messages.append({"role": "system", "content": self.system})
        text = self.user.format(**values)
        if self.image_key is None:
            messages.append({"role": "user", "content": text})
        else:
            parts: list[dict[str, Any]] = [{"type": "image"} for _ in self.sample_images(sample)]
            parts.append({"type": "text", "text": text})
            messages.append({"role": "user", "content": parts})
        return messages, is_truncated

    def render_ids(self, sample: Sample, tokenizer: Any) -> tuple[list[int], bool]:
        """The judge's prompt token ids (chat template when the tokenizer has one), and whether
        the response was cut to fit `max_response_tokens`.

        With image_key the chat template writes one placeholder per image (a vision-language
        judge's tokenizer); a tokenizer without a chat template cannot place them (ValueError)."""
        messages, is_truncated = self._render_messages(sample, tokenizer)
        if self.image_key is not None and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "JudgeTemplate.image_key is set but the judge tokenizer has no chat template to "
                "place the images; use a vision-language judge's tokenizer"
            )
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
            # The chat template already wrote any BOS it wants; don't add a second one.
            return list(tokenizer.encode(text, add_special_tokens=False)), is_truncated
        text = "\n\n".join(m["content"] for m in messages) + "\n"
        return list(tokenizer.encode(text)), is_truncated


def truncate_middle(text: str, max_tokens: int, tokenizer: Any = None) -> str:
    """`text` if it fits in `max_tokens`, else its head and tail around an omission note.

    Without a tokenizer, 4 characters count as one token. With one, a text longer than
    `max_tokens * MAX_CHARS_PER_TOKEN` characters is cut by characters first and only its two
    ends are tokenized: a runaway response (megabytes) costs no more than a long one.
    """
    if tokenizer is None:
        max_chars = 4 * max_tokens
        if len(text) <= max_chars:
            return text
        head, tail = text[: max_chars // 2], text[len(text) - max_chars // 2 :]
        omitted = f"{len(text) - max_chars} characters"
        return _join_around_note(head, omitted, tail)
    half = max_tokens // 2
    max_chars = max_tokens * MAX_CHARS_PER_TOKEN
    if len(text) > max_chars:
        # Each end holds at least `half` tokens unless its tokens average over
        # MAX_CHARS_PER_TOKEN characters; then the judge sees a little less, never more.
        head_ids = tokenizer.encode(text[: max_chars // 2], add_special_tokens=False)[:half]
        tail_ids = tokenizer.encode(text[len(text) - max_chars // 2 :], add_special_tokens=False)
        head, tail = tokenizer.decode(head_ids), tokenizer.decode(tail_ids[-half:])
        omitted = f"{len(text) - len(head) - len(tail)} characters"
        return _join_around_note(head, omitted, tail)
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) <= max_tokens:
        return text
    head = tokenizer.decode(ids[:half])
    tail = tokenizer.decode(ids[len(ids) - half :])
    return _join_around_note(head, f"{len(ids) - 2 * half} tokens", tail)


def _join_around_note(head: str, omitted: str, tail: str) -> str:
    return f"{head}\n[... {omitted} omitted: response too long for the judge ...]\n{tail}"


def _literal(text: str) -> str:
    """`text` as str.format text that renders to itself (a parser's instruction may hold braces:
    "\\boxed{Yes}")."""
    return text.replace("{", "{{").replace("}", "}}")


def verification_template(
    *,
    with_reference: bool = True,
    system: str | None = None,
    max_response_tokens: int = 4096,
    parser: YesNoParser | None = None,
) -> JudgeTemplate:
    """'Is the answer correct? Yes/No'; pair it with `YesNoParser()` (+1 / -1).

    Without `parser` the judge is asked for one word, Yes or No (a bare label line, which the
    default YesNoParser reads). With one, the prompt ends with `parser.format_instruction`: the
    exact last line that parser reads ("Verdict: Yes" after reasoning, a boxed label...)."""
    instruction = _ONE_WORD if parser is None else _literal(parser.format_instruction)
    question = _VERIFICATION_USER if with_reference else _VERIFICATION_USER_NO_REFERENCE
    return JudgeTemplate(
        user=question + instruction,
        system=system or "You are a careful, strict grader of answers.",
        max_response_tokens=max_response_tokens,
    )


def pointwise_template(
    *,
    low: int = 1,
    high: int = 10,
    system: str | None = None,
    max_response_tokens: int = 4096,
    parser: ScoreParser | None = None,
) -> JudgeTemplate:
    """A score from `low` to `high`; pair it with `ScoreParser(low=low, high=high)` ([0, 1]).
    The prompt ends with the parser's format instruction (default: that ScoreParser's)."""
    if not low < high:
        raise ValueError(f"pointwise_template: low={low!r}, high={high!r}; need low < high")
    if parser is None:
        parser = ScoreParser(low=low, high=high)
    if (parser.low, parser.high) != (low, high):
        raise ValueError(
            f"pointwise_template: parser reads scores from {parser.low} to {parser.high}, "
            f"the template asks for {low} to {high}; give both the same range"
        )
    user = _POINTWISE_USER.replace("{low}", str(low)).replace("{high}", str(high))
    return JudgeTemplate(
        user=user + _literal(parser.format_instruction),
        system=system or "You are a careful, strict grader of answers.",
        max_response_tokens=max_response_tokens,
    )
