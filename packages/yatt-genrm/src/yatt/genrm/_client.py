"""GenRMClient: the GenRM interface over HTTP (`python -m yatt.genrm.serve` on the other end).

One URL, or a pool of them (several servers of the same judge, e.g. one per GPU: the judge
data-parallel). With a pool, `score` cuts its samples into at least one request per server and
each server takes the next request as soon as its previous one is answered; streamed batches
(`submit`/`ascore`) go to the server with the fewest of this client's samples in flight (ties
in turn). A request that fails on its server is retried on the next one.

With `api_key` (default: the YATT_GENRM_API_KEY environment variable, as the server reads it)
each request carries `Authorization: Bearer <key>`.

Transport failures (connection refused while the server restarts, timeouts, 5xx) are retried
with a bounded exponential backoff; after the last try, or on a 4xx, each sample of the request
gets a verdict with status "error" naming the cause. Like GenRM, nothing raises mid-run. A
response body is read up to `max_response_bytes`; a longer one is cut off and is such an error,
not retried (the server would send it again).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp

from yatt.genrm._http_body import ResponseTooLargeError, decode_body, read_body
from yatt.genrm._retry import (
    SERVER_ERROR_STATUSES,
    Backoff,
    FatalError,
    GaveUp,
    RetryableError,
    status_error,
    with_retries,
)
from yatt.genrm._secrets import Scrubber, redact_url, url_credentials
from yatt.genrm._stream import BatchingConfig, Item, StreamingScorer
from yatt.genrm._types import Sample, Verdict, error_verdict

logger = logging.getLogger("yatt.genrm")


class GenRMClient(StreamingScorer):
    """score / submit / finish / results / ascore against a GenRM HTTP service at `url`, or
    spread over a pool of services (`url` a sequence of URLs serving the same judge).

    `url` is the first (or only) server's URL and `urls` all of them; `num_samples_by_url`
    counts the samples sent to each (a retry counts again, on the server it went to).
    """

    def __init__(
        self,
        url: str | Sequence[str],
        *,
        timeout_s: float = 300.0,
        max_retries: int = 4,
        backoff_s: float = 0.2,
        max_backoff_s: float = 5.0,
        default_reward: float = 0.0,
        batching: BatchingConfig | None = None,
        api_key: str | None = None,
        max_response_bytes: int = 64 * 2**20,
    ) -> None:
        if api_key is None:
            api_key = os.environ.get("YATT_GENRM_API_KEY") or None
        if api_key is not None and not api_key.strip():
            raise ValueError("api_key is empty: pass the server's key, or None for an open server")
        urls = [url] if isinstance(url, str) else list(url)
        if not urls:
            raise ValueError("url=[]: pass one URL, or a list of the pool's URLs")
        for u in urls:
            if not isinstance(u, str) or not u.startswith(("http://", "https://")):
                raise ValueError(f"url={u!r}: must start with http:// or https://")
        urls = [u.rstrip("/") for u in urls]
        if len(set(urls)) != len(urls):
            raise ValueError(f"url={urls!r}: a URL is listed twice; list each server once")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r}: must be > 0")
        if not isinstance(max_response_bytes, int) or max_response_bytes < 1024:
            raise ValueError(
                f"max_response_bytes={max_response_bytes!r}: must be an int >= 1024 (a batch of "
                "verdicts, votes' text included; default 64 MiB)"
            )
        if not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries={max_retries!r}: must be an int >= 0")
        if not (0 < backoff_s <= max_backoff_s):
            raise ValueError(
                f"backoff_s={backoff_s!r}, max_backoff_s={max_backoff_s!r}: need 0 < backoff_s <= max_backoff_s"
            )
        super().__init__(batching=batching, error_reward=default_reward)
        self.urls: tuple[str, ...] = tuple(urls)
        self.url = self.urls[0]
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_response_bytes = max_response_bytes
        self.default_reward = default_reward
        self._headers = {"Content-Type": "application/json"}
        if api_key is not None:
            self._headers["Authorization"] = f"Bearer {api_key}"
        # The key and URL credentials never reach a log line or an error verdict, also when a
        # server (or proxy) echoes them back.
        self._scrub = Scrubber([api_key, *(c for u in self.urls for c in url_credentials(u))])
        self.metrics["num_retries"] = 0
        self.num_samples_by_url: dict[str, int] = dict.fromkeys(self.urls, 0)
        # This client's samples in flight per server, and whose turn a tie is (streaming).
        self._in_flight = [0] * len(self.urls)
        self._turn = 0
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._session_loop is not loop:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s)
            )
            self._session_loop = loop
        return self._session

    async def _post(
        self, session: aiohttp.ClientSession, samples: Sequence[Sample], server: int = 0
    ) -> list[Verdict]:
        """POST one batch to server `server` (an index into `urls`); retries transport errors
        and 5xx, each retry on the pool's next server; never raises."""
        # A sample whose metadata is not JSON (an image the row holds as a PIL image) gets its
        # error verdict here; the others are sent.
        encoded: dict[int, str] = {}
        failed: dict[int, Verdict] = {}
        for i, sample in enumerate(samples):
            try:
                encoded[i] = json.dumps(sample.to_dict())
            except (TypeError, ValueError) as e:
                message = (
                    f"GenRM service: the sample does not encode as JSON ({e}); the service takes "
                    "text and JSON metadata, so drop images and other objects from Sample.metadata"
                )
                failed[i] = error_verdict(sample.id, message, reward=self.default_reward)
        if not failed:
            return await self._post_json(session, samples, encoded, server)
        sent = [samples[i] for i in encoded]
        verdicts = iter(await self._post_json(session, sent, encoded, server) if sent else [])
        return [failed[i] if i in failed else next(verdicts) for i in range(len(samples))]

    async def _post_json(
        self,
        session: aiohttp.ClientSession,
        samples: Sequence[Sample],
        encoded: dict[int, str],
        server: int,
    ) -> list[Verdict]:
        body = '{"samples": [' + ", ".join(encoded.values()) + "]}"

        async def try_once(attempt: int) -> list[Verdict]:
            # Each retry goes to the pool's next server.
            url = self.urls[(server + attempt) % len(self.urls)]
            self.num_samples_by_url[url] += len(samples)
            try:
                async with session.post(
                    f"{url}/score", data=body, headers=self._headers
                ) as response:
                    payload = json.loads(await self._read(response))
                    if response.status == 200:
                        verdicts = [Verdict.from_dict(v) for v in payload["verdicts"]]
                        if len(verdicts) != len(samples):
                            raise ValueError(f"{len(verdicts)} verdicts for {len(samples)} samples")
                        return verdicts
                    # A 5xx is tried again (there, or on the next server); a 4xx is not: our
                    # request is wrong and sending it again will not help.
                    raise status_error(
                        response.status,
                        f"HTTP {response.status}: {payload.get('error', payload)}",
                        retry_statuses=SERVER_ERROR_STATUSES,
                    )
            except ResponseTooLargeError as e:
                logger.warning(
                    "GenRM request to %s failed: %s", redact_url(url), self._scrub(str(e))
                )
                raise FatalError(str(e)) from None  # an endless or oversized answer comes again
            except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError) as e:
                raise RetryableError(f"{type(e).__name__}: {e}") from None

        def log_retryable(attempt: int, error: RetryableError | FatalError) -> None:
            if isinstance(error, RetryableError):
                url = self.urls[(server + attempt) % len(self.urls)]
                logger.warning(
                    "GenRM request to %s failed (try %d): %s",
                    redact_url(url),
                    attempt + 1,
                    self._scrub(str(error)),
                )

        try:
            return await with_retries(
                try_once,
                max_retries=self.max_retries,
                backoff=Backoff(self.backoff_s, self.max_backoff_s),
                on_failure=log_retryable,
                on_retry=self._count_retry,
            )
        except GaveUp as e:
            return [
                error_verdict(
                    s.id, self._scrub(f"GenRM service: {e.cause}"), reward=self.default_reward
                )
                for s in samples
            ]

    def _count_retry(self, attempt: int) -> None:
        self.metrics["num_retries"] += 1

    async def _read(self, response: aiohttp.ClientResponse) -> str:
        """The body as text, at most max_response_bytes of it (ResponseTooLargeError past
        that), within the session's total timeout_s like the rest of the request."""
        body = await read_body(
            response, max_bytes=self.max_response_bytes, what="max_response_bytes"
        )
        return decode_body(response, body)

    def _least_busy_server(self) -> int:
        """The server with the fewest of this client's samples in flight; ties in turn."""
        n = len(self.urls)
        order = [(self._turn + k) % n for k in range(n)]
        server = min(order, key=lambda i: self._in_flight[i])
        self._turn = (server + 1) % n
        return server

    async def _judge_batch(self, items: list[Item]) -> None:
        server = self._least_busy_server()
        self._in_flight[server] += len(items)
        try:
            verdicts = await self._post(self._get_session(), [it.sample for it in items], server)
        finally:
            self._in_flight[server] -= len(items)
        for item, verdict in zip(items, verdicts, strict=True):
            item.resolve(verdict)

    def score(
        self, samples: Sequence[Sample], *, should_stop: Callable[[], bool] | None = None
    ) -> list[Verdict]:
        """Blocking verdicts in order, one request per max_batch_size samples; with a pool of
        n servers, requests of at most ceil(len(samples) / n) samples, so every server gets
        a share, each server taking the next request once it answered its last.

        Runs on its own thread and event loop, so it works inside a running loop too.
        `should_stop` (None: not read): the samples go as streamed batches instead, and it is
        polled while they are awaited; once it returns True the requests are cancelled and
        ScoringStopped is raised, no verdicts."""
        if should_stop is not None:
            return self._score_until_stopped(samples, should_stop)

        async def run() -> list[Verdict]:
            async with aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s)
            ) as session:
                size = min(self.batching.max_batch_size, -(-len(samples) // len(self.urls)))
                chunks = [samples[i : i + size] for i in range(0, len(samples), max(size, 1))]
                answers: list[list[Verdict]] = [[] for _ in chunks]
                queue = iter(range(len(chunks)))  # shared: a free server takes the next one

                async def serve(server: int) -> None:
                    for k in queue:
                        answers[k] = await self._post(session, chunks[k], server)

                await asyncio.gather(*(serve(i) for i in range(len(self.urls))))
                return [v for answer in answers for v in answer]

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            verdicts = pool.submit(asyncio.run, run()).result()
        for v in verdicts:
            self._record(v)
        return verdicts

    def health(self, url: str | None = None) -> dict[str, Any]:
        """The /health payload of the server at `url` (default: the first); raises
        aiohttp.ClientError when it is unreachable, ResponseTooLargeError when it sends more
        than max_response_bytes."""
        url = self.url if url is None else url.rstrip("/")

        async def run() -> dict[str, Any]:
            async with (
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as s,
                s.get(f"{url}/health", headers=self._headers) as response,
            ):
                response.raise_for_status()
                return json.loads(await self._read(response))

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, run()).result()

    def health_all(self) -> dict[str, dict[str, Any]]:
        """Every server's /health payload, by URL (each server's own metrics: its load)."""
        return {url: self.health(url) for url in self.urls}

    async def _ascore_all(self, samples: Sequence[Sample]) -> list[Verdict]:
        try:
            return await self.ascore(samples)
        finally:  # the loop ends with this call: its session goes with it
            await self._close_session()

    async def _abort(self) -> None:
        await super()._abort()
        await self._close_session()

    async def aclose(self) -> None:
        await super().aclose()
        await self._close_session()

    async def _close_session(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None
