"""GenRM: an LLM judge over any `yatt.rollout.RolloutEngine`.

    Sample --template--> judge prompt ids --engine (n=votes)--> verdict texts
           --parser--> vote rewards --aggregate--> Verdict

`score()` is the blocking, whole-batch path (engine.generate). `submit()`/`results()` stream:
they are built on `engine.stream()`, so a sample's verdict is out as soon as its votes finish,
while later samples are still arriving (partial colocation overlaps this with the rollout).

A template with `image_key` shows the judge the sample's images: the engine must take images
(a vision-language judge), the chat template writes a placeholder per image, each placeholder
is expanded to the image's tokens with the judge's image processor, and the request carries
the images (see yatt.genrm._images).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from yatt.genrm._images import ImagePrompts
from yatt.genrm._label_verdict import (
    LabelProbe,
    LabelVerdicts,
    supports_label_logprobs,
)
from yatt.genrm._parsers import VerdictParser, YesNoParser
from yatt.genrm._stream import BatchingConfig, Item, StreamingScorer
from yatt.genrm._templates import JudgeTemplate
from yatt.genrm._types import (
    Sample,
    Verdict,
    Vote,
    describe_failure,
    error_verdict,
    find_unusable_text,
    skip_verdict,
)
from yatt.genrm._votes import (
    AGGREGATES,
    Aggregate,
    UnparsableLog,
    build_verdict,
    make_judge_sampling,
    parse_vote,
)
from yatt.rollout import AcceptsImages, Completion, Request, RolloutEngine, SamplingParams

logger = logging.getLogger("yatt.genrm")

VerdictFrom = Literal["auto", "label_logprobs", "text"]
VERDICT_FROM: tuple[str, ...] = ("auto", "label_logprobs", "text")


@dataclass
class _Rendered:
    """A batch's judge requests, made without touching shared state (it runs off the loop)."""

    requests: list[Request] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)  # requests[j] judges samples[positions[j]]
    failed: dict[int, Verdict] = field(default_factory=dict)  # sample index -> error verdict
    num_truncated: int = 0  # responses cut to the template's max_response_tokens


def _copy_tokenizer(tokenizer: Any) -> Any:
    """A copy for the render thread, or the tokenizer itself when it cannot be copied."""
    try:
        return copy.deepcopy(tokenizer)
    except Exception as e:
        logger.warning(
            "judge tokenizer cannot be copied (%r); the render thread shares it with the engine", e
        )
        return tokenizer


class GenRM(StreamingScorer):
    """A generative reward model: judge each sample with `engine`, parse, vote, aggregate.

    `votes=k` asks the engine for k samples of each judge prompt (SamplingParams.n = k, each its
    own random stream) and aggregates the parsed ones by `aggregate` ("mean" or "majority").
    A vote that does not parse is counted and logged; a sample none of whose votes parse gets
    `default_reward` and status "unparsable". Engine failures give status "error" and
    `default_reward`; nothing raises in the middle of a run.

    `verdict_from`: "label_logprobs" scores a YesNoParser verdict from the judge's probability
    of the yes label at the declared place (yatt.genrm._label_verdict: reward = no_reward +
    P(yes) * (yes_reward - no_reward), 2P - 1 for +1/-1), "text" from the sampled label;
    "auto" (default) picks label_logprobs for a YesNoParser on an engine that reports label
    logprobs (`engine.supports_label_logprobs`: the built-in engine does), else text.
    `parser` defaults to YesNoParser().

    With a template that shows images (`image_key`), `image_processor` is the judge model's
    (default: `engine.image_processor` when the engine has one) and `image_token_id` its image
    placeholder token (default: the model config's `image_token_id`); a sample without its
    image gets an "error" verdict naming the field.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        *,
        template: JudgeTemplate,
        parser: VerdictParser | None = None,
        verdict_from: VerdictFrom = "auto",
        votes: int = 1,
        sampling: SamplingParams | None = None,
        aggregate: Aggregate = "mean",
        default_reward: float = 0.0,
        batching: BatchingConfig | None = None,
        max_prompt_tokens: int | None = None,
        image_processor: Any = None,
        image_token_id: int | None = None,
    ) -> None:
        if not isinstance(template, JudgeTemplate):
            raise ValueError(f"template must be a JudgeTemplate, got {type(template).__name__}")
        if parser is None:
            parser = YesNoParser()
        if verdict_from not in VERDICT_FROM:
            raise ValueError(f"verdict_from={verdict_from!r}: use one of {VERDICT_FROM}")
        if not callable(getattr(parser, "parse", None)):
            raise ValueError(f"parser={parser!r} has no parse(text) method")
        if not isinstance(votes, int) or votes < 1:
            raise ValueError(f"votes={votes!r}: must be an int >= 1")
        if aggregate not in AGGREGATES:
            raise ValueError(f"aggregate={aggregate!r}: use one of {AGGREGATES}")
        if not math.isfinite(default_reward):
            raise ValueError(f"default_reward={default_reward!r}: must be finite")
        if getattr(engine, "tokenizer", None) is None:
            raise ValueError("engine has no tokenizer; GenRM renders and decodes text with it")
        # Expands image placeholders for a template that shows images; None for a text judge.
        self._image_prompts = _make_image_prompts(engine, template, image_processor, image_token_id)
        super().__init__(batching=batching, error_reward=default_reward)
        self.engine = engine
        self.template = template
        self.parser = parser
        self.votes = votes
        self.aggregate: Aggregate = aggregate
        self.default_reward = default_reward
        self.sampling = make_judge_sampling(sampling, votes)
        self._labels = _make_label_verdicts(engine, parser, verdict_from)
        if self._labels is not None:
            # A judge whose first token is its label gets the label logprobs with its vote.
            self.sampling = dataclasses.replace(
                self.sampling, label_token_ids=self._labels.first_token_ids
            )
        if max_prompt_tokens is None:
            # The built-in engine's context; a longer prompt would fail its whole batch.
            max_seq_len = getattr(getattr(engine, "config", None), "max_seq_len", None)
            max_prompt_tokens = max_seq_len - 1 if isinstance(max_seq_len, int) else None
        if max_prompt_tokens is not None and max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens={max_prompt_tokens!r}: must be >= 1 or None")
        self.max_prompt_tokens = max_prompt_tokens
        self._unparsable_log = UnparsableLog()
        # Streaming renders on one thread with its own copy of the tokenizer: a Hugging Face
        # fast tokenizer is not safe to share between threads (a call that races another one
        # raises "Already borrowed"), and the engine may use its own copy on the loop meanwhile.
        self._render_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="yatt-genrm-render"
        )
        self._render_tokenizer = _copy_tokenizer(engine.tokenizer)
        self.metrics.update(
            num_votes=0,
            num_unparsable_votes=0,
            num_unfinished_votes=0,  # cut at the token budget or aborted: error, not read
            num_truncated_responses=0,
            num_prompt_tokens=0,
        )

    # -- shared by score() and streaming -------------------------------------------------------
    def _render(self, samples: Sequence[Sample], tokenizer: Any) -> _Rendered:
        """Requests for the samples that render; the others get their error verdict now.

        Pure (no metrics touched), so streaming runs it on the render thread."""
        rendered = _Rendered()
        for i, sample in enumerate(samples):
            # A row the judge cannot take is a data skip (Verdict.skip_cause), not its error.
            unusable = find_unusable_text(sample)
            if unusable is not None:
                rendered.failed[i] = skip_verdict(sample.id, unusable, reward=self.default_reward)
                continue
            try:
                ids, is_truncated = self.template.render_ids(sample, tokenizer)
                images = self.template.sample_images(sample)
            except Exception as e:
                message = f"template: {e}"
                rendered.failed[i] = error_verdict(sample.id, message, reward=self.default_reward)
                continue
            image_inputs = None
            if images:
                assert self._image_prompts is not None
                try:
                    # Processed once here; the engine takes the pixels as they are.
                    ids, image_inputs = self._image_prompts.encode(ids, images)
                except Exception as e:
                    message = f"images: {e}"
                    rendered.failed[i] = skip_verdict(
                        sample.id, message, reward=self.default_reward
                    )
                    continue
            rendered.num_truncated += int(is_truncated)
            if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
                message = (
                    f"judge prompt has {len(ids)} tokens > max_prompt_tokens="
                    f"{self.max_prompt_tokens}; lower the template's max_response_tokens"
                )
                rendered.failed[i] = skip_verdict(sample.id, message, reward=self.default_reward)
                continue
            rendered.requests.append(
                Request(
                    prompt_ids=ids,
                    request_id=sample.id,
                    images=images or None,
                    image_inputs=image_inputs,
                )
            )
            rendered.positions.append(i)
        return rendered

    def _count_rendered(self, rendered: _Rendered) -> None:
        self.metrics["num_truncated_responses"] += rendered.num_truncated
        # The judge's load (its KV cache fills with these): partial colocation splits memory
        # between rollout and judge by such token counts.
        self.metrics["num_prompt_tokens"] += sum(
            self._prompt_tokens(request) for request in rendered.requests
        )

    def _prompt_tokens(self, request: Request) -> int:
        """What one sample's judge request costs: every vote reads the prompt."""
        return len(request.prompt_ids) * self.votes

    @property
    def verdict_from(self) -> str:
        """ "label_logprobs" or "text": how this judge's votes are scored."""
        return "text" if self._labels is None else "label_logprobs"

    def _vote(self, completion: Completion) -> Vote | LabelProbe:
        """A vote, or (label_logprobs) the forced step that will score it."""
        text = self.engine.tokenizer.decode(completion.response_ids, skip_special_tokens=True)
        if self._labels is not None:
            located = self._labels.locate(completion, text)
            if isinstance(located, LabelProbe):
                return located
            return self._count_vote(located, completion.request_id)
        vote = parse_vote(text, self.parser, completion.finish_reason)
        return self._count_vote(vote, completion.request_id)

    def _count_vote(self, vote: Vote, request_id: str | None) -> Vote:
        self.metrics["num_votes"] += 1
        if vote.status == "unparsable":
            self.metrics["num_unparsable_votes"] += 1
            self._unparsable_log.record(request_id or "?", vote.text)
        elif vote.status == "error":
            self.metrics["num_unfinished_votes"] += 1
        return vote

    def _probe_calls(self, probes: list[LabelProbe]):
        """(requests, sampling, indices into probes) of the forced steps, one per label pair."""
        assert self._labels is not None
        for sampling, indices in self._labels.requests(probes):
            requests = [
                Request(prompt_ids=probes[i].prompt_ids, request_id=f"label-{i}") for i in indices
            ]
            yield requests, sampling, indices

    def _score_probes(self, probes: list[LabelProbe]) -> list[Vote]:
        """The forced steps' votes (blocking); a failed step makes its votes unparsable."""
        assert self._labels is not None
        found: dict[int, Completion] = {}
        for requests, sampling, indices in self._probe_calls(probes):
            try:
                for c in self.engine.generate(requests, sampling):
                    found[indices[c.request_index]] = c
            except Exception as e:
                logger.warning("judge forced label step failed: %s: %s", type(e).__name__, e)
        return [
            self._count_vote(self._labels.vote(probe, found.get(i)), None)
            for i, probe in enumerate(probes)
        ]

    async def _ascore_probes(self, probes: list[LabelProbe]) -> list[Vote]:
        """`_score_probes` over engine.stream, for the streaming path."""
        assert self._labels is not None
        found: dict[int, Completion] = {}
        for requests, sampling, indices in self._probe_calls(probes):
            try:
                async for c in self.engine.stream(requests, sampling):
                    if 0 <= c.request_index < len(indices):
                        found[indices[c.request_index]] = c
            except Exception as e:
                logger.warning("judge forced label step failed: %s: %s", type(e).__name__, e)
        return [
            self._count_vote(self._labels.vote(probe, found.get(i)), None)
            for i, probe in enumerate(probes)
        ]

    def _verdict(self, sample: Sample, votes: list[Vote]) -> Verdict:
        return build_verdict(
            sample.id, votes, how=self.aggregate, default_reward=self.default_reward
        )

    # -- blocking ----------------------------------------------------------------------------
    def score(
        self, samples: Sequence[Sample], *, should_stop: Callable[[], bool] | None = None
    ) -> list[Verdict]:
        """Verdicts for `samples`, in order; engine.generate in chunks of max_batch_size.

        `ScoreStats.from_verdicts(verdicts)` counts this call's statuses and judge tokens.
        `should_stop` (None: not read): the verdicts come from engine.stream instead, and it is
        polled while they are awaited; once it returns True the stream is closed (the engine
        drops the pending judge requests) and ScoringStopped is raised, no verdicts."""
        if should_stop is not None:
            return self._score_until_stopped(samples, should_stop)
        verdicts: list[Verdict] = []
        size = self.batching.max_batch_size
        for start in range(0, len(samples), size):
            verdicts += self._score_chunk(samples[start : start + size])
        for v in verdicts:
            self._record(v)
        return verdicts

    def _score_chunk(self, samples: Sequence[Sample]) -> list[Verdict]:
        rendered = self._render(samples, self.engine.tokenizer)
        self._count_rendered(rendered)
        requests, positions = rendered.requests, rendered.positions
        votes: list[list[Vote | LabelProbe]] = [[] for _ in requests]
        response_tokens = [0] * len(requests)
        error: str | None = None
        if requests:
            self.metrics["num_batches"] += 1
            try:
                for c in self.engine.generate(requests, self.sampling):
                    votes[c.request_index].append(self._vote(c))
                    response_tokens[c.request_index] += len(c.response_ids)
            except Exception as e:
                error = f"judge failed: {describe_failure(e)}"
                logger.warning("judge engine raised on a batch of %d: %s", len(requests), error)
        probes = [v for row in votes for v in row if isinstance(v, LabelProbe)]
        if probes and error is None:
            scored = iter(self._score_probes(probes))
            votes = [
                [next(scored) if isinstance(v, LabelProbe) else v for v in row] for row in votes
            ]
        out: list[Verdict | None] = [rendered.failed.get(i) for i in range(len(samples))]
        for j, i in enumerate(positions):
            if error is not None or len(votes[j]) < self.votes:
                message = error or f"engine returned {len(votes[j])} of {self.votes} votes"
                verdict = error_verdict(samples[i].id, message, reward=self.default_reward)
            else:
                verdict = self._verdict(samples[i], votes[j][: self.votes])  # type: ignore[arg-type]
            out[i] = dataclasses.replace(
                verdict,
                num_judge_prompt_tokens=self._prompt_tokens(requests[j]),
                num_judge_response_tokens=response_tokens[j],
            )
        assert all(v is not None for v in out)
        return out  # type: ignore[return-value]

    # -- streaming ---------------------------------------------------------------------------
    async def _judge_batch(self, items: list[Item]) -> None:
        samples = [item.sample for item in items]
        # Rendering tokenizes each response (a runaway one can be megabytes): on the render
        # thread, the event loop goes on serving other batches, requests and the rollout.
        loop = asyncio.get_running_loop()
        rendered = await loop.run_in_executor(
            self._render_pool, self._render, samples, self._render_tokenizer
        )
        self._count_rendered(rendered)
        for i, verdict in rendered.failed.items():
            items[i].resolve(verdict)
        requests, positions = rendered.requests, rendered.positions
        if not requests:
            return
        for j, i in enumerate(positions):
            items[i].num_judge_prompt_tokens = self._prompt_tokens(requests[j])
        votes: list[list[Vote | LabelProbe]] = [[] for _ in requests]
        waiting: list[int] = []  # requests whose votes wait on forced label steps
        async for c in self.engine.stream(requests, self.sampling):
            if not 0 <= c.request_index < len(requests):
                logger.warning(
                    "engine returned request_index %d of %d", c.request_index, len(requests)
                )
                continue
            j = c.request_index
            if len(votes[j]) >= self.votes:
                continue  # an engine bug (duplicate); keep exactly one verdict per sample
            item = items[positions[j]]
            item.num_judge_response_tokens += len(c.response_ids)
            votes[j].append(self._vote(c))
            if len(votes[j]) == self.votes:
                if any(isinstance(v, LabelProbe) for v in votes[j]):
                    waiting.append(j)
                    continue
                # Out as soon as this sample's votes are in, not when the whole batch is.
                item.resolve(item.with_tokens(self._verdict(item.sample, votes[j])))  # type: ignore[arg-type]
        if waiting:
            # One forced step for every vote that needs one, after the batch's generation.
            probes = [v for j in waiting for v in votes[j] if isinstance(v, LabelProbe)]
            scored = iter(await self._ascore_probes(probes))
            for j in waiting:
                row = [next(scored) if isinstance(v, LabelProbe) else v for v in votes[j]]
                item = items[positions[j]]
                item.resolve(item.with_tokens(self._verdict(item.sample, row)))  # type: ignore[arg-type]

    def close(self) -> None:
        """Close the judge engine and the render thread."""
        self._render_pool.shutdown(wait=False, cancel_futures=True)
        self.engine.close()


def _make_label_verdicts(
    engine: RolloutEngine, parser: VerdictParser, verdict_from: str
) -> LabelVerdicts | None:
    """The label-probability scorer when `verdict_from` asks for it (or "auto" allows it)."""
    if verdict_from == "text":
        return None
    is_possible = isinstance(parser, YesNoParser) and supports_label_logprobs(engine)
    if verdict_from == "auto" and not is_possible:
        return None
    if not supports_label_logprobs(engine):
        raise ValueError(
            "verdict_from='label_logprobs': the judge engine does not report label logprobs "
            "(engine.supports_label_logprobs); use the built-in engine or verdict_from='text'"
        )
    return LabelVerdicts(parser, engine.tokenizer)  # type: ignore[arg-type]


def _make_image_prompts(
    engine: RolloutEngine, template: JudgeTemplate, image_processor: Any, image_token_id: Any
) -> ImagePrompts | None:
    """The placeholder expansion of a template that shows images; ValueError for a judge that
    cannot see them (checked at construction, not at the first sample)."""
    if not template.shows_images:
        if image_processor is not None or image_token_id is not None:
            raise ValueError(
                "image_processor / image_token_id are for a template that shows images; set "
                "JudgeTemplate(image_key=...) or drop them"
            )
        return None
    if not (isinstance(engine, AcceptsImages) and engine.accepts_images):
        raise ValueError(
            f"JudgeTemplate.image_key={template.image_key!r} shows the judge images, but the "
            "judge engine takes none (accepts_images is False): serve a vision-language judge "
            "(a Qwen2-VL-family model) or drop image_key for a text-only judge"
        )
    if not getattr(engine.tokenizer, "chat_template", None):
        raise ValueError(
            f"JudgeTemplate.image_key={template.image_key!r}: the judge tokenizer has no chat "
            "template to write the image placeholders; load the judge's own tokenizer"
        )
    if image_processor is None:
        image_processor = getattr(engine, "image_processor", None)
    if image_processor is None:
        raise ValueError(
            f"JudgeTemplate.image_key={template.image_key!r}: GenRM needs the judge model's "
            "image processor to size each image's tokens; pass "
            "image_processor=AutoImageProcessor.from_pretrained(judge_model_dir)"
        )
    if image_token_id is None:  # the built-in engine says its model's
        image_token_id = getattr(engine, "image_token_id", None)
    if image_token_id is None:
        raise ValueError(
            f"JudgeTemplate.image_key={template.image_key!r}: the judge engine does not say its "
            "image token; pass image_token_id=<the model config's image_token_id>"
        )
    return ImagePrompts(image_processor, image_token_id)
