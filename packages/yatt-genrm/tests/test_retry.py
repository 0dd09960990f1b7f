"""The HTTP judges' one retry loop (yatt.genrm._retry) against a scripted fake transport.

The rule, stated independently of the code: a judge tries once, then up to max_retries more
times, but only after a retryable failure (GenRMClient: any 5xx; OpenAIJudge: 408, 429, 500,
502, 503, 504); a non-retryable one (a 4xx) ends it at once. Before retry k it waits
first_s * 2**(k-1), capped at max_s (with jitter: a fraction in [0.5, 1] of that); a server's
Retry-After replaces that wait, still capped at max_s.
"""

NUM_GPUS = 0

import asyncio

import pytest

from yatt.genrm._openai import RETRY_STATUSES
from yatt.genrm._retry import (
    SERVER_ERROR_STATUSES,
    Backoff,
    GaveUp,
    status_error,
    with_retries,
)


class FakeTransport:
    """Answers each try with the next scripted (status, retry_after_s); records every try."""

    def __init__(self, script, *, retry_statuses):
        self.script = list(script)
        self.retry_statuses = retry_statuses
        self.tries = []

    async def send(self, attempt):
        self.tries.append(attempt)
        status, retry_after_s = self.script.pop(0)
        if status == 200:
            return "answer"
        raise status_error(
            status,
            f"HTTP {status}: scripted",
            retry_statuses=self.retry_statuses,
            retry_after_s=retry_after_s,
        )


def _run(transport, *, max_retries, backoff=None):
    backoff = backoff or Backoff(0.1, 0.3)
    slept, failures, retries = [], [], []

    async def sleep(seconds):
        slept.append(seconds)

    async def go():
        return await with_retries(
            transport.send,
            max_retries=max_retries,
            backoff=backoff,
            on_failure=lambda attempt, error: failures.append((attempt, type(error).__name__)),
            on_retry=retries.append,
            sleep=sleep,
        )

    try:
        result = asyncio.run(go())
    except GaveUp as e:
        result = e
    return result, slept, failures, retries


def test_retryable_statuses_are_retried_until_an_answer():
    transport = FakeTransport(
        [(503, None), (502, None), (500, None), (200, None)], retry_statuses=RETRY_STATUSES
    )
    result, slept, failures, retries = _run(transport, max_retries=4)
    assert result == "answer"
    assert transport.tries == [0, 1, 2, 3]  # 3 failures, then the 4th try answers
    assert retries == [1, 2, 3]
    # 0.1, 0.2, then 0.4 capped at 0.3.
    assert slept == pytest.approx([0.1, 0.2, 0.3])
    assert failures == [(0, "RetryableError"), (1, "RetryableError"), (2, "RetryableError")]


def test_gives_up_after_one_plus_max_retries_tries_with_the_last_cause():
    transport = FakeTransport([(503, None)] * 10, retry_statuses=SERVER_ERROR_STATUSES)
    result, slept, _, retries = _run(transport, max_retries=2)
    assert isinstance(result, GaveUp)
    assert len(transport.tries) == 3 and retries == [1, 2] and len(slept) == 2
    assert result.exhausted and result.num_tries == 3
    assert result.cause == "HTTP 503: scripted"
    assert str(result) == "HTTP 503: scripted (after 3 tries)"


def test_max_retries_zero_tries_once():
    transport = FakeTransport([(500, None), (200, None)], retry_statuses=SERVER_ERROR_STATUSES)
    result, slept, _, _ = _run(transport, max_retries=0)
    assert isinstance(result, GaveUp) and result.num_tries == 1 and slept == []


@pytest.mark.parametrize(
    ("status", "retry_statuses"),
    [
        (404, RETRY_STATUSES),
        (401, SERVER_ERROR_STATUSES),
        (408, SERVER_ERROR_STATUSES),  # GenRMClient's rule: only 5xx come back
        (429, SERVER_ERROR_STATUSES),
        (400, RETRY_STATUSES),
        (501, RETRY_STATUSES),  # OpenAIJudge's rule: "not implemented" will not change
    ],
)
def test_a_non_retryable_status_is_not_retried(status, retry_statuses):
    transport = FakeTransport([(status, None), (200, None)], retry_statuses=retry_statuses)
    result, slept, failures, retries = _run(transport, max_retries=4)
    assert isinstance(result, GaveUp)
    assert transport.tries == [0] and slept == [] and retries == []
    assert not result.exhausted and str(result) == f"HTTP {status}: scripted"
    assert failures == [(0, "FatalError")]


@pytest.mark.parametrize("status", [408, 429, 500, 502, 503, 504])
def test_openai_judge_retries_its_transient_statuses(status):
    transport = FakeTransport([(status, None), (200, None)], retry_statuses=RETRY_STATUSES)
    result, _, _, retries = _run(transport, max_retries=1)
    assert result == "answer" and retries == [1]


def test_genrm_client_retries_every_5xx():
    script = [(s, None) for s in (500, 501, 507, 599)] + [(200, None)]
    transport = FakeTransport(script, retry_statuses=SERVER_ERROR_STATUSES)
    result, _, _, retries = _run(transport, max_retries=4)
    assert result == "answer" and retries == [1, 2, 3, 4]


def test_retry_after_replaces_the_backoff_capped_at_max():
    transport = FakeTransport(
        [(429, 0.05), (429, 9.0), (503, None), (200, None)], retry_statuses=RETRY_STATUSES
    )
    result, slept, _, _ = _run(transport, max_retries=3, backoff=Backoff(0.1, 1.0))
    assert result == "answer"
    # The server's 0.05; its 9 s capped at 1.0; then no Retry-After: 0.1 * 2**2.
    assert slept == pytest.approx([0.05, 1.0, 0.4])


def test_jitter_keeps_each_wait_between_half_and_all_of_the_backoff():
    backoff = Backoff(0.1, 0.3, jitter=True)
    for retry, nominal in [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.3)]:
        waits = [backoff.delay_s(retry) for _ in range(200)]
        assert all(0.5 * nominal <= w <= nominal for w in waits)
        assert max(waits) - min(waits) > 0.1 * nominal  # jittered, not constant


def test_other_exceptions_pass_through():
    async def boom(attempt):
        raise KeyError("not a transport failure")

    with pytest.raises(KeyError):
        asyncio.run(with_retries(boom, max_retries=3, backoff=Backoff(0.1, 0.1)))
