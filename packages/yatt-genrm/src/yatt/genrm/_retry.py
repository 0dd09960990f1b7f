"""The retry loop of the HTTP judges (GenRMClient, OpenAIJudge): try, wait, try again, give up.

    try_once(attempt) --ok--> result
                      --RetryableError--> wait backoff (or the server's Retry-After) --> again
                      --FatalError--> GaveUp at once (sending it again would fail the same way)
    after 1 + max_retries tries --> GaveUp (exhausted)

A caller's `try_once` says which failures are worth repeating by raising RetryableError or
FatalError; `status_error` does it for an HTTP status against the caller's set of retryable
statuses (GenRMClient: any 5xx; OpenAIJudge: 408, 429 and the transient 5xx). Any other
exception (a cancellation) goes through untouched.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Container
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

# GenRMClient's rule: the server failed (5xx), so another try, or another server, may not.
SERVER_ERROR_STATUSES = range(500, 600)


class RetryableError(Exception):
    """A failed try worth repeating; `retry_after_s` is the wait the server asked for, if any."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class FatalError(Exception):
    """A failed try that would fail again (a 4xx, an answer too large, a body that is not one)."""


class GaveUp(Exception):
    """No try succeeded: `cause` is the last failure's message, `num_tries` how many were made,
    `exhausted` whether every allowed try failed (else a FatalError stopped the loop)."""

    def __init__(self, cause: str, *, num_tries: int, exhausted: bool) -> None:
        message = f"{cause} (after {num_tries} tries)" if exhausted else cause
        super().__init__(message)
        self.cause = cause
        self.num_tries = num_tries
        self.exhausted = exhausted


@dataclass(frozen=True)
class Backoff:
    """The wait before retry k (k >= 1): `first_s * 2**(k-1)`, at most `max_s`; with `jitter`
    a uniform fraction in [0.5, 1] of it, so clients that failed together (a 429 burst) do not
    all come back together. A server's Retry-After replaces it, still capped at `max_s`."""

    first_s: float
    max_s: float
    jitter: bool = False

    def delay_s(self, retry: int, retry_after_s: float | None = None) -> float:
        if retry_after_s is not None:
            return min(retry_after_s, self.max_s)
        delay = min(self.first_s * 2 ** (retry - 1), self.max_s)
        return delay * random.uniform(0.5, 1.0) if self.jitter else delay


def status_error(
    status: int,
    message: str,
    *,
    retry_statuses: Container[int],
    retry_after_s: float | None = None,
) -> RetryableError | FatalError:
    """The failure a non-200 `status` is: retryable when it is in `retry_statuses`."""
    if status in retry_statuses:
        return RetryableError(message, retry_after_s)
    return FatalError(message)


async def with_retries(
    try_once: Callable[[int], Awaitable[T]],
    *,
    max_retries: int,
    backoff: Backoff,
    on_failure: Callable[[int, RetryableError | FatalError], None] | None = None,
    on_retry: Callable[[int], None] | None = None,
    sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
) -> T:
    """`try_once(attempt)` (attempt 0, 1, ...) until it returns, at most 1 + max_retries times.

    `on_failure(attempt, error)` hears each failed try, `on_retry(attempt)` each retry before
    its wait. Raises GaveUp when a try fails fatally or the last one fails."""
    retry_after_s: float | None = None
    cause = "no try made"
    for attempt in range(max_retries + 1):
        if attempt:
            if on_retry is not None:
                on_retry(attempt)
            await sleep(backoff.delay_s(attempt, retry_after_s))
        try:
            return await try_once(attempt)
        except RetryableError as e:
            cause, retry_after_s = str(e), e.retry_after_s
            if on_failure is not None:
                on_failure(attempt, e)
        except FatalError as e:
            if on_failure is not None:
                on_failure(attempt, e)
            raise GaveUp(str(e), num_tries=attempt + 1, exhausted=False) from None
    raise GaveUp(cause, num_tries=max_retries + 1, exhausted=True)
