"""A judge behind an OpenAI-compatible chat-completions endpoint (vLLM, SGLang, a hosted model).

    Sample --template--> chat messages --POST {base_url}/chat/completions (n=votes)--> choices
           --parser--> vote rewards --aggregate--> Verdict

The same JudgeTemplate, parsers and vote aggregation as GenRM, and the same interface (score,
submit/finish/results, ascore), so CombinedRM and score_as_completed take it as they take GenRM.
One request per sample, at most `max_concurrency` in flight per event loop. A request that
times out, cannot connect, or gets 408, 429 or 5xx is tried again after a backoff (a server's
Retry-After is honoured, up to `max_backoff_s`); what still fails, and a 4xx or a body that is
not a chat completion, becomes that sample's "error" verdict with the cause. Nothing raises in
the middle of a run, and every try ends within `timeout_s`, its body read included. A body
over `max_response_bytes` is cut off and is an error without a retry (a server that streams
without end would do it again); memory per request stays bounded.

A template with `image_key` sends the sample's images in the user message, each as an OpenAI
image part ({"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}, or the
image's own http(s) URL) before the text; the served model must take images (else the server's
4xx is that sample's error verdict). A sample without its image is an error verdict, unsent.

The API key is read from the environment variable named by `api_key_env` and sent as
`Authorization: Bearer <key>`. It, and any "user:password@" in base_url, is scrubbed from every
message the judge writes (logs, error verdicts, exceptions, the judge's own text), also from
what a server sends back (a proxy that echoes the Authorization header in its error body).

A completion naming another model than `model` (a proxy routing elsewhere, a wrong server) is
logged once and counted (metrics["num_model_mismatches"]); a dated snapshot of the model asked
for ("gpt-4o-2024-08-06" for "gpt-4o") is the same model.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import email.utils
import json
import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from yatt.genrm._http_body import ResponseTooLargeError, decode_body, read_body
from yatt.genrm._images import image_data_url
from yatt.genrm._parsers import VerdictParser
from yatt.genrm._retry import (
    Backoff,
    FatalError,
    GaveUp,
    RetryableError,
    status_error,
    with_retries,
)
from yatt.genrm._secrets import Scrubber, redact_url, url_credentials
from yatt.genrm._stream import BatchingConfig, Item, StreamingScorer, per_sample_batching
from yatt.genrm._templates import JudgeTemplate
from yatt.genrm._types import (
    Sample,
    Verdict,
    Vote,
    error_verdict,
    find_unusable_text,
    skip_verdict,
)
from yatt.genrm._votes import (
    AGGREGATES,
    Aggregate,
    FailureLog,
    UnparsableLog,
    build_verdict,
    make_judge_sampling,
    parse_vote,
)
from yatt.rollout import SamplingParams

logger = logging.getLogger("yatt.genrm")

RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
# Body text kept in an error: enough for the server's message, not a page of HTML.
_ERROR_BODY_CHARS = 300
# Request fields the judge sets itself (from the messages, votes and sampling).
_OWN_FIELDS = frozenset(
    {"model", "messages", "n", "max_tokens", "temperature", "top_p", "top_k", "seed"}
    | {"stop_token_ids", "ignore_eos"}
)


@dataclass(kw_only=True, frozen=True)
class OpenAIJudgeConfig:
    """Where the judge is served and how it is called."""

    base_url: str  # the API root: "http://127.0.0.1:8000/v1" (vLLM, SGLang), a hosted API's
    model: str  # the served model's name, sent as "model"
    api_key_env: str | None = None  # the environment variable holding the key; None: no key
    max_concurrency: int = 32  # requests in flight at once (per event loop)
    timeout_s: float = 120.0  # one request, connect to last byte; a slower one is retried
    # The longest response body read; past it the request is an error verdict, not retried. A
    # chat completion is kilobytes; n votes of long reasoning a few MiB at most.
    max_response_bytes: int = 8 * 2**20
    max_retries: int = 4  # tries after the first, on timeouts, connection errors, 408/429/5xx
    backoff_s: float = 0.5  # wait before the first retry, doubled each time (with jitter)
    max_backoff_s: float = 30.0  # longest wait between tries, a server's Retry-After included
    # More request fields, sent as they are: {"chat_template_kwargs": {"enable_thinking":
    # False}} (vLLM/SGLang), {"reasoning_effort": "low"}; sampling fields go in `sampling`.
    extra_body: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        url = self.base_url
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            shown = redact_url(url) if isinstance(url, str) else url
            raise ValueError(
                f"OpenAIJudgeConfig.base_url={shown!r}: must start with http:// or https://"
            )
        url = redact_url(url)  # only the redacted form goes into messages below
        if url.rstrip("/").endswith("/chat/completions"):
            root = url.rstrip("/").removesuffix("/chat/completions")
            raise ValueError(
                f"OpenAIJudgeConfig.base_url={url!r}: give the API root ({root!r}); "
                "/chat/completions is added to it"
            )
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(
                f"OpenAIJudgeConfig.model={self.model!r}: the served model's name is needed"
            )
        if not isinstance(self.max_concurrency, int) or self.max_concurrency < 1:
            raise ValueError(
                f"OpenAIJudgeConfig.max_concurrency={self.max_concurrency!r}: must be an int >= 1"
            )
        if not isinstance(self.max_retries, int) or self.max_retries < 0:
            raise ValueError(
                f"OpenAIJudgeConfig.max_retries={self.max_retries!r}: must be an int >= 0"
            )
        if not (isinstance(self.max_response_bytes, int) and self.max_response_bytes >= 1024):
            raise ValueError(
                f"OpenAIJudgeConfig.max_response_bytes={self.max_response_bytes!r}: must be an "
                "int >= 1024 (a chat completion's size; default 8 MiB)"
            )
        if not (isinstance(self.timeout_s, int | float) and self.timeout_s > 0):
            raise ValueError(f"OpenAIJudgeConfig.timeout_s={self.timeout_s!r}: must be > 0")
        if not (0 < self.backoff_s <= self.max_backoff_s < math.inf):
            raise ValueError(
                f"OpenAIJudgeConfig.backoff_s={self.backoff_s!r}, max_backoff_s="
                f"{self.max_backoff_s!r}: need 0 < backoff_s <= max_backoff_s (finite)"
            )
        if self.api_key_env is not None and (
            not isinstance(self.api_key_env, str) or not self.api_key_env
        ):
            raise ValueError(
                f"OpenAIJudgeConfig.api_key_env={self.api_key_env!r}: the name of an "
                "environment variable (e.g. 'OPENAI_API_KEY'), or None for no key"
            )
        if not isinstance(self.extra_body, dict):
            raise ValueError(
                f"OpenAIJudgeConfig.extra_body must be a dict, got {type(self.extra_body).__name__}"
            )
        own = sorted(_OWN_FIELDS & set(self.extra_body))
        if own:
            raise ValueError(
                f"OpenAIJudgeConfig.extra_body sets {own}: the judge sets these itself "
                "(model from model, n from votes, the others from sampling)"
            )

    def __repr__(self) -> str:  # base_url's credentials stay out of it
        fields = ", ".join(
            f"{f.name}={redact_url(getattr(self, f.name)) if f.name == 'base_url' else getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)
        )
        return f"OpenAIJudgeConfig({fields})"

    def read_api_key(self) -> str | None:
        """The key from `api_key_env`; ValueError when the variable is unset or empty."""
        if self.api_key_env is None:
            return None
        key = os.environ.get(self.api_key_env, "").strip()
        if not key:
            raise ValueError(
                f"OpenAIJudgeConfig.api_key_env={self.api_key_env!r}: that environment "
                "variable is not set (or empty); export it, or set api_key_env to None"
            )
        return key


@dataclass
class _Http:
    """One event loop's session and concurrency bound."""

    session: aiohttp.ClientSession
    slots: asyncio.Semaphore
    closer: asyncio.Task[None] | None = None


class OpenAIJudge(StreamingScorer):
    """An LLM judge over an OpenAI-compatible chat-completions endpoint.

    `votes=k` asks for k choices per request (`n`: vLLM and SGLang support it) and aggregates
    the parsed ones by `aggregate`; `sampling` as GenRM's (temperature, top_p, max_new_tokens ->
    max_tokens, seed; top_k, min_p, repetition_penalty, stop_token_ids and ignore_eos are sent
    only when set, as vLLM and SGLang read them). A vote that does not parse counts as GenRM's does.
    """

    def __init__(
        self,
        config: OpenAIJudgeConfig,
        *,
        template: JudgeTemplate,
        parser: VerdictParser,
        votes: int = 1,
        sampling: SamplingParams | None = None,
        aggregate: Aggregate = "mean",
        default_reward: float = 0.0,
        batching: BatchingConfig | None = None,
    ) -> None:
        if not isinstance(config, OpenAIJudgeConfig):
            raise ValueError(f"config must be an OpenAIJudgeConfig, got {type(config).__name__}")
        if not isinstance(template, JudgeTemplate):
            raise ValueError(f"template must be a JudgeTemplate, got {type(template).__name__}")
        if not callable(getattr(parser, "parse", None)):
            raise ValueError(f"parser={parser!r} has no parse(text) method")
        if not isinstance(votes, int) or votes < 1:
            raise ValueError(f"votes={votes!r}: must be an int >= 1")
        if aggregate not in AGGREGATES:
            raise ValueError(f"aggregate={aggregate!r}: use one of {AGGREGATES}")
        if not math.isfinite(default_reward):
            raise ValueError(f"default_reward={default_reward!r}: must be finite")
        api_key = config.read_api_key()
        # Each sample is its own request (the server batches across them); max_concurrency
        # bounds how many are in flight.
        super().__init__(
            batching=batching or per_sample_batching(),
            error_reward=default_reward,
        )
        self.config = config
        self._request_url = config.base_url.rstrip("/") + "/chat/completions"
        self.url = redact_url(self._request_url)  # as shown in messages
        self._scrub = Scrubber([api_key, *url_credentials(config.base_url)])
        self._has_warned_model = False
        self.template = template
        self.parser = parser
        self.votes = votes
        self.aggregate: Aggregate = aggregate
        self.default_reward = default_reward
        self.sampling = make_judge_sampling(sampling, votes)
        # min_p and repetition_penalty travel as vLLM's and SGLang's servers name them, like
        # top_k; one set both here and in extra_body would be sent twice with two values.
        both = [
            name
            for name, is_set in (
                ("min_p", self.sampling.min_p != 0.0),
                ("repetition_penalty", self.sampling.repetition_penalty != 1.0),
            )
            if is_set and name in config.extra_body
        ]
        if both:
            raise ValueError(
                f"OpenAIJudgeConfig.extra_body sets {both}, which the judge's sampling sets too: "
                "give each in one place"
            )
        self._headers = {"Content-Type": "application/json"}
        if api_key is not None:
            self._headers["Authorization"] = f"Bearer {api_key}"
        # Jitter: samples that failed together (a 429 burst) do not all come back together.
        self._backoff = Backoff(config.backoff_s, config.max_backoff_s, jitter=True)
        self._http_by_loop: dict[asyncio.AbstractEventLoop, _Http] = {}
        self._unparsable_log = UnparsableLog()
        self._failure_log = FailureLog("judge request failed")
        self._num_inflight = 0
        self.metrics.update(
            num_requests=0,
            num_retries=0,
            num_votes=0,
            num_unparsable_votes=0,
            num_unfinished_votes=0,  # finish reason "length" or "abort": an error, not read
            num_prompt_tokens=0,
            peak_inflight_requests=0,
            num_model_mismatches=0,  # completions naming another model than config.model
        )

    def __repr__(self) -> str:  # the headers (the key) stay out of it
        return f"OpenAIJudge(url={self.url!r}, model={self.config.model!r}, votes={self.votes})"

    # -- one request ---------------------------------------------------------------------------
    def _body(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        sampling = self.sampling
        body: dict[str, Any] = {
            "model": self.config.model,
            "messages": messages,
            "max_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature,
        }
        if self.votes > 1:
            body["n"] = self.votes  # left out for one vote: some hosted APIs reject n
        if sampling.top_p != 1.0:
            body["top_p"] = sampling.top_p
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if sampling.top_k:
            body["top_k"] = sampling.top_k
        if sampling.min_p:
            body["min_p"] = sampling.min_p
        if sampling.repetition_penalty != 1.0:
            body["repetition_penalty"] = sampling.repetition_penalty
        if sampling.stop_token_ids:
            body["stop_token_ids"] = list(sampling.stop_token_ids)
        if sampling.ignore_eos:
            body["ignore_eos"] = True
        body.update(self.config.extra_body)
        return body

    def _http(self) -> _Http:
        """This loop's session: made on first use, closed when the loop ends or by aclose()."""
        loop = asyncio.get_running_loop()
        http = self._http_by_loop.get(loop)
        if http is None:
            connector = aiohttp.TCPConnector(limit=self.config.max_concurrency)
            http = _Http(
                aiohttp.ClientSession(connector=connector),
                asyncio.Semaphore(self.config.max_concurrency),
            )
            self._http_by_loop[loop] = http
            # The trainer runs each round in its own asyncio.run: when that ends it cancels
            # this task and runs its finally, so the session closes inside its own loop.
            http.closer = loop.create_task(self._close_at_loop_end(loop, http))
        return http

    async def _close_at_loop_end(self, loop: asyncio.AbstractEventLoop, http: _Http) -> None:
        try:
            await loop.create_future()  # until cancelled
        finally:
            self._http_by_loop.pop(loop, None)
            await http.session.close()

    async def _post_once(self, http: _Http, body: bytes) -> dict[str, Any]:
        """One try: the chat completion, or RetryableError / FatalError saying why not."""
        timeout = aiohttp.ClientTimeout(total=self.config.timeout_s)
        async with http.slots:
            self.metrics["num_requests"] += 1
            self._num_inflight += 1
            self.metrics["peak_inflight_requests"] = max(
                self.metrics["peak_inflight_requests"], self._num_inflight
            )
            try:
                # The whole try, body included, under one deadline of our own: aiohttp's
                # total timeout is kept too, but a trickling body must not outlive timeout_s.
                async with (
                    asyncio.timeout(self.config.timeout_s),
                    http.session.post(
                        self._request_url, data=body, headers=self._headers, timeout=timeout
                    ) as response,
                ):
                    data = await read_body(
                        response,
                        max_bytes=self.config.max_response_bytes,
                        what="max_response_bytes",
                    )
                    text = decode_body(response, data)
                    status, headers = response.status, response.headers
            except TimeoutError:
                raise RetryableError(
                    f"no answer within timeout_s={self.config.timeout_s}"
                ) from None
            except aiohttp.ClientError as e:
                raise RetryableError(f"{type(e).__name__}: {e}") from None
            except ResponseTooLargeError as e:
                raise FatalError(str(e)) from None
            finally:
                self._num_inflight -= 1
        if status != 200:
            message = f"HTTP {status}: {_error_message(text)}"
            raise status_error(
                status,
                message,
                retry_statuses=RETRY_STATUSES,
                retry_after_s=_retry_after_s(headers),
            )
        try:
            payload = json.loads(text)
            choices = payload.get("choices") if isinstance(payload, dict) else None
            if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
                raise ValueError("no 'choices' list of objects")
        except ValueError as e:
            raise FatalError(
                f"HTTP 200 with a body that is not a chat completion ({e}): "
                f"{text[:_ERROR_BODY_CHARS]!r}"
            ) from None
        return payload

    async def _judge_one(self, sample: Sample) -> Verdict:
        """The verdict of one sample; never raises (except cancellation)."""
        unusable = find_unusable_text(sample)
        if unusable is not None:  # no JSON body or server takes it: a data skip
            return skip_verdict(sample.id, unusable, reward=self.default_reward)
        try:
            messages = self.template.render_messages(sample)
            images = self.template.sample_images(sample)
        except Exception as e:
            return error_verdict(sample.id, f"template: {e}", reward=self.default_reward)
        if images:
            try:
                # Encoding images (PNG, base64) is CPU work: off the event loop.
                messages = await asyncio.to_thread(_with_image_urls, messages, images)
            except Exception as e:
                return skip_verdict(sample.id, f"images: {e}", reward=self.default_reward)
        body = json.dumps(self._body(messages)).encode()
        http = self._http()

        async def try_once(attempt: int) -> Verdict:
            return self._verdict(sample, await self._post_once(http, body))

        def record(attempt: int, error: RetryableError | FatalError) -> None:
            if isinstance(error, RetryableError):
                self._failure_log.record(sample.id, self._scrub(f"try {attempt + 1}: {error}"))
            else:
                self._failure_log.record(sample.id, self._scrub(str(error)))

        try:
            return await with_retries(
                try_once,
                max_retries=self.config.max_retries,
                backoff=self._backoff,
                on_failure=record,
                on_retry=self._count_retry,
            )
        except GaveUp as e:
            cause = self._scrub(f"judge at {self.url}: {e}")
            return error_verdict(sample.id, cause, reward=self.default_reward)

    def _count_retry(self, attempt: int) -> None:
        self.metrics["num_retries"] += 1

    def _verdict(self, sample: Sample, payload: dict[str, Any]) -> Verdict:
        choices = sorted(payload["choices"], key=lambda c: c.get("index", 0))
        if len(choices) < self.votes:
            raise FatalError(
                f"{len(choices)} choices for n={self.votes}: the server may not support n; "
                "use votes=1"
            )
        self._check_model(payload.get("model"))
        votes: list[Vote] = []
        for choice in choices[: self.votes]:
            text = self._scrub(_content(choice))
            vote = parse_vote(text, self.parser, choice.get("finish_reason"))
            self.metrics["num_votes"] += 1
            if vote.status == "unparsable":
                self.metrics["num_unparsable_votes"] += 1
                self._unparsable_log.record(sample.id, text)
            elif vote.status == "error":
                self.metrics["num_unfinished_votes"] += 1
            votes.append(vote)
        verdict = build_verdict(
            sample.id, votes, how=self.aggregate, default_reward=self.default_reward
        )
        usage = payload.get("usage") or {}
        # As GenRM counts its load: every vote reads the prompt.
        prompt_tokens = _count(usage.get("prompt_tokens")) * self.votes
        self.metrics["num_prompt_tokens"] += prompt_tokens
        return dataclasses.replace(
            verdict,
            num_judge_prompt_tokens=prompt_tokens,
            num_judge_response_tokens=_count(usage.get("completion_tokens")),
        )

    def _check_model(self, served: object) -> None:
        """Count (and log once) a completion from another model than the one configured."""
        wanted = self.config.model
        if served is None or served == wanted:
            return
        if isinstance(served, str) and served.startswith(wanted + "-"):
            return  # a dated snapshot of the model asked for
        self.metrics["num_model_mismatches"] += 1
        if not self._has_warned_model:
            self._has_warned_model = True
            logger.warning(
                "judge at %s answered as model %s, not the configured %r (a proxy routing "
                "elsewhere, or another server on that port?); counted in "
                "metrics['num_model_mismatches'], logged once",
                self.url,
                self._scrub(repr(served)[:200]),
                wanted,
            )

    # -- the scorer interface ------------------------------------------------------------------
    async def _judge_batch(self, items: list[Item]) -> None:
        async def judge(item: Item) -> None:
            item.resolve(await self._judge_one(item.sample))

        await asyncio.gather(*(judge(item) for item in items))

    def score(
        self, samples: Sequence[Sample], *, should_stop: Callable[[], bool] | None = None
    ) -> list[Verdict]:
        """Blocking verdicts in order, `max_concurrency` requests at a time.

        Runs on its own thread and event loop, so it works inside a running loop too.
        `should_stop` (None: not read): polled while the requests are awaited; once it returns
        True they are cancelled (connections closed) and ScoringStopped is raised, no verdicts."""
        if should_stop is not None:
            return self._score_until_stopped(samples, should_stop)

        async def run() -> list[Verdict]:
            return list(await asyncio.gather(*(self._judge_one(s) for s in samples)))

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            verdicts = pool.submit(asyncio.run, run()).result()
        for verdict in verdicts:
            self._record(verdict)
        return verdicts

    def check_endpoint(self) -> None:
        """Fail fast at setup: ValueError unless GET {base_url}/models answers within timeout_s
        (with the key) and lists `model`. A run never calls this itself."""

        async def run() -> tuple[int, str]:
            timeout = aiohttp.ClientTimeout(total=self.config.timeout_s)
            async with (
                asyncio.timeout(self.config.timeout_s),
                aiohttp.ClientSession(timeout=timeout) as session,
                session.get(models_url, headers=self._headers) as response,
            ):
                max_bytes = self.config.max_response_bytes
                body = await read_body(response, max_bytes=max_bytes, what="max_response_bytes")
                return response.status, decode_body(response, body)

        models_url = self.config.base_url.rstrip("/") + "/models"
        try:
            self._check_endpoint(run, models_url)
        except ValueError as e:
            raise ValueError(self._scrub(str(e))) from None

    def _check_endpoint(self, run: Any, models_url: str) -> None:
        try:
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                status, text = pool.submit(asyncio.run, run()).result()
        except ResponseTooLargeError as e:
            raise ValueError(f"judge endpoint {models_url}: {e}") from None
        except (aiohttp.ClientError, TimeoutError) as e:
            raise ValueError(
                f"judge endpoint {models_url} cannot be reached ({type(e).__name__}: {e}); "
                "is the server up, and base_url its API root (e.g. http://host:8000/v1)?"
            ) from None
        if status != 200:
            hint = ""
            if status in (401, 403):
                hint = (
                    "; no key was sent: set api_key_env"
                    if self.config.api_key_env is None
                    else f"; check the key in ${self.config.api_key_env}"
                )
            raise ValueError(
                f"judge endpoint {models_url} answered HTTP {status}: {_error_message(text)}{hint}"
            )
        try:
            served = [m["id"] for m in json.loads(text)["data"]]
        except (ValueError, KeyError, TypeError):
            raise ValueError(
                f"judge endpoint {models_url} did not answer a model list: {text[:_ERROR_BODY_CHARS]!r}"
            ) from None
        if self.config.model not in served:
            raise ValueError(
                f"OpenAIJudgeConfig.model={self.config.model!r} is not served at "
                f"{self.config.base_url}; it serves {served[:10]}"
            )

    async def aclose(self) -> None:
        """Cancel in-flight requests (their samples get error verdicts) and close this loop's
        session."""
        await super().aclose()
        http = self._http_by_loop.get(asyncio.get_running_loop())
        if http is not None and http.closer is not None:
            http.closer.cancel()
            await asyncio.gather(http.closer, return_exceptions=True)


def _with_image_urls(messages: list[dict[str, Any]], images: list[Any]) -> list[dict[str, Any]]:
    """`messages` with their {"type": "image"} parts, in order, as OpenAI image_url parts."""
    urls = iter([image_data_url(image) for image in images])
    out = []
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            content = [
                {"type": "image_url", "image_url": {"url": next(urls)}}
                if part.get("type") == "image"
                else part
                for part in content
            ]
        out.append({**message, "content": content})
    return out


def _content(choice: Any) -> str:
    """The text of a choice's message ("" when the judge wrote none, e.g. cut while thinking)."""
    message = choice.get("message") if isinstance(choice, dict) else None
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, list):  # content parts: [{"type": "text", "text": ...}]
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def _count(value: Any) -> int:
    return value if isinstance(value, int) and value >= 0 else 0


def _error_message(text: str) -> str:
    """The server's error message: OpenAI's {"error": {"message"}}, vLLM's {"message"}, or
    the body's start."""
    try:
        payload = json.loads(text)
    except ValueError:
        return text[:_ERROR_BODY_CHARS]
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return error["message"][:_ERROR_BODY_CHARS]
        for message in (error, payload.get("message"), payload.get("detail")):
            if isinstance(message, str):
                return message[:_ERROR_BODY_CHARS]
    return text[:_ERROR_BODY_CHARS]


def _retry_after_s(headers: Mapping[str, str]) -> float | None:
    """The wait a server asks for: `retry-after-ms`, or `Retry-After` in seconds or as a date;
    None when it asks for none (or writes something unreadable)."""
    seconds = _finite(headers.get("retry-after-ms"))
    if seconds is not None:
        return max(seconds / 1000, 0.0)
    value = headers.get("Retry-After")
    seconds = _finite(value)
    if seconds is not None or value is None:
        return None if seconds is None else max(seconds, 0.0)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(when.timestamp() - time.time(), 0.0)


def _finite(value: str | None) -> float | None:
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None
