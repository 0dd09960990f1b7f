"""A verdict scored from the judge's label probabilities, not from its sampled text.

    judge output "...reasoning...\\nVerdict: Yes"  (YesNoParser's declared line, found in text)
        --label position k: the response token where the label starts-->
        p(Yes), p(No) at k (the judge's distribution there, given everything before)
        --> P = p(Yes) / (p(Yes) + p(No))  --> reward = no_reward + P * (yes_reward - no_reward)
                                               (+1/-1 rewards: 2P - 1)

The text only says WHERE the verdict is (the declared place, read by the same strict parser);
the reward is the judge's probability of "Yes" there, so what the judge happened to sample
does not decide. When the label is the judge's first token (a judge that answers with one
word), the probabilities come with the generation itself (SamplingParams.label_token_ids);
otherwise one forced step reads them: the judge prompt plus the response up to the label,
one new token, label_token_ids asked (prefix caching makes it cheap on vLLM/SGLang).

Tokens: the label is matched in context, with the whitespace before it ("Verdict: Yes" holds
the token " Yes" in byte-level BPE vocabularies). Each label is tokenized with that whitespace;
a label of several tokens is represented by the first token where "Yes" and "No" differ (the
shared tokens before it must be what the judge wrote). The judge must write the label as
declared (its case included): "verdict: yes" under yes_label="Yes" parses as text but has no
"Yes" token, so it is an unparsable vote here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from yatt.genrm._parsers import YesNoParser
from yatt.genrm._types import Vote
from yatt.genrm._votes import is_finished
from yatt.rollout import Completion, SamplingParams, SupportsLabelLogprobs

# How many response tokens back from the end the label may start: a verdict line is short.
MAX_VERDICT_LINE_TOKENS = 64


@dataclass(frozen=True)
class LabelProbe:
    """A forced step: the judge prompt plus the response up to the label, one token."""

    prompt_ids: list[int]
    label_token_ids: tuple[int, int]  # (yes, no) at that position
    text: str
    finish_reason: str | None


def reward_from_label_logprobs(parser: YesNoParser, yes_logprob: float, no_logprob: float) -> float:
    """no_reward + P(yes) * (yes_reward - no_reward), P(yes) = p(yes) / (p(yes) + p(no))."""
    difference = yes_logprob - no_logprob
    if math.isnan(difference):
        raise ValueError(f"label logprobs {yes_logprob!r}, {no_logprob!r} are not numbers")
    # A numerically stable sigmoid of the log-odds.
    if difference >= 0:
        p_yes = 1.0 / (1.0 + math.exp(-difference))
    else:
        odds = math.exp(difference)
        p_yes = odds / (1.0 + odds)
    return parser.no_reward + p_yes * (parser.yes_reward - parser.no_reward)


def supports_label_logprobs(engine: Any) -> bool:
    """Whether `engine` fills Completion.label_logprobs (it says so itself)."""
    return isinstance(engine, SupportsLabelLogprobs) and bool(engine.supports_label_logprobs)


class LabelVerdicts:
    """Turns judge completions into votes scored from label probabilities (module docstring)."""

    def __init__(self, parser: YesNoParser, tokenizer: Any) -> None:
        if not isinstance(parser, YesNoParser):
            raise ValueError(
                f"label-probability verdicts need a YesNoParser (labels to score), got "
                f"{type(parser).__name__}; use verdict_from='text' for other parsers"
            )
        self.parser = parser
        self.tokenizer = tokenizer
        # The labels as a first response token (a judge that answers with the label).
        first = self._label_pair("")
        if first is None:
            raise ValueError(
                f"YesNoParser labels {parser.yes_label!r} and {parser.no_label!r} tokenize to "
                "the same tokens; give labels that differ in the judge's vocabulary"
            )
        self.first_token_ids: tuple[int, int] = first[1]

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _label_pair(self, space: str) -> tuple[list[int], tuple[int, int]] | None:
        """(shared leading tokens, (yes token, no token)) of the labels after `space`."""
        yes = self._encode(space + self.parser.yes_label)
        no = self._encode(space + self.parser.no_label)
        shared = 0
        while shared < min(len(yes), len(no)) and yes[shared] == no[shared]:
            shared += 1
        if shared >= min(len(yes), len(no)):
            return None
        return yes[:shared], (yes[shared], no[shared])

    def locate(self, completion: Completion, text: str) -> Vote | LabelProbe:
        """The vote, when the label is the first token (its logprobs came with the
        generation) or the text has no verdict; else the forced step that scores it."""
        start = self.parser.label_start(text)
        if not is_finished(completion.finish_reason) or start is None:
            return _unparsable(text, completion.finish_reason)
        ids = completion.response_ids
        need = len(text) - start  # characters from the label to the end
        for k in range(len(ids) - 1, max(-1, len(ids) - 1 - MAX_VERDICT_LINE_TOKENS), -1):
            tail = self.tokenizer.decode(ids[k:], skip_special_tokens=True)
            if len(tail) < need:
                continue
            space = tail[: len(tail) - need]
            if tail[len(tail) - need :] != text[start:] or space.strip():
                break  # a token spans the prefix and the label: no label token to score
            pair = self._label_pair(space)
            if pair is None:
                break
            shared, labels = pair
            position = k + len(shared)
            if ids[k:position] != shared or position >= len(ids) or ids[position] not in labels:
                break  # the judge wrote the label otherwise (another case, other tokens)
            logprobs = completion.label_logprobs
            if position == 0 and labels == self.first_token_ids and logprobs and len(logprobs) == 2:
                yes_logprob, no_logprob = logprobs
                reward = reward_from_label_logprobs(self.parser, yes_logprob, no_logprob)
                return Vote(
                    reward=reward, text=text, status="ok", finish_reason=completion.finish_reason
                )
            return LabelProbe(
                prompt_ids=list(completion.prompt_ids) + list(ids[:position]),
                label_token_ids=labels,
                text=text,
                finish_reason=completion.finish_reason,
            )
        return _unparsable(text, completion.finish_reason)

    def requests(self, probes: Sequence[LabelProbe]) -> list[tuple[SamplingParams, list[int]]]:
        """Forced-step calls: one per distinct label pair, (sampling, indices into probes)."""
        groups: dict[tuple[int, int], list[int]] = {}
        for index, probe in enumerate(probes):
            groups.setdefault(probe.label_token_ids, []).append(index)
        return [
            (SamplingParams(temperature=0.0, max_new_tokens=1, label_token_ids=labels), indices)
            for labels, indices in groups.items()
        ]

    def vote(self, probe: LabelProbe, completion: Completion | None) -> Vote:
        """The probe's vote from its forced step's completion (None: the step failed)."""
        logprobs = None if completion is None else completion.label_logprobs
        if logprobs is None or len(logprobs) != 2:
            return _unparsable(probe.text, probe.finish_reason)
        reward = reward_from_label_logprobs(self.parser, *logprobs)
        return Vote(reward=reward, text=probe.text, status="ok", finish_reason=probe.finish_reason)


def _unparsable(text: str, finish_reason: str | None) -> Vote:
    status = "unparsable" if is_finished(finish_reason) else "error"
    return Vote(reward=None, text=text, status=status, finish_reason=finish_reason)
