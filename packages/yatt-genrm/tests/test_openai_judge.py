NUM_GPUS = 0

import asyncio
import base64
import io
import logging
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from yatt.genrm import (
    CombinedRM,
    JudgeTemplate,
    OpenAIJudge,
    OpenAIJudgeConfig,
    RewardFunction,
    Sample,
    ScoreStats,
    YesNoParser,
    score_as_completed,
)
from yatt.rollout import SamplingParams

pytestmark = pytest.mark.timeout(30)

KEY = "sk-test-0123456789abcdef"


def _yes_if_four(user_text: str, vote: int) -> str:
    return "Yes" if re.search(r"R=(\S*)", user_text).group(1) == "4" else "No"


@dataclass
class FakeOpenAIServer:
    """/v1/chat/completions on 127.0.0.1, on its own thread and event loop.

    `actions` are taken one per request, in arrival order (then "ok"): "ok", "garbage" (200
    with a body that is not JSON), ("status", code, headers), "endless" / "trickle" (200 and a
    body that never ends, fast or slow). Every answer is delayed by
    `delay_s`, one whose user message holds "SLOW" by `slow_s`; choices are
    `judge(user message, choice index)`."""

    judge: Callable[[str, int], str] = _yes_if_four
    delay_s: float = 0.0
    slow_s: float = 2.0
    finish_reason: str = "stop"
    served_model: str | None = None  # the "model" a completion names; None: left out
    num_choices: int | None = None  # None: as many as n asks for
    models_key: str | None = None  # the key /v1/models wants; None: open
    actions: list[Any] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)  # body, headers, time
    num_active: int = 0
    peak_active: int = 0
    num_streamed_bytes: int = 0  # sent by "endless" and "trickle" answers
    num_streams_ended: int = 0  # endless answers the client hung up on

    def start(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        self.base_url = f"http://127.0.0.1:{self.port}/v1"

    async def _start(self) -> int:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._handle)
        app.router.add_get("/v1/models", self._models)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return site._server.sockets[0].getsockname()[1]

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    async def _models(self, request: web.Request) -> web.Response:
        wanted = None if self.models_key is None else f"Bearer {self.models_key}"
        if wanted is not None and request.headers.get("Authorization") != wanted:
            return web.json_response({"error": {"message": "bad key"}}, status=401)
        return web.json_response({"object": "list", "data": [{"id": "judge-7b"}]})

    async def _stream_forever(self, request: web.Request, action: str) -> web.StreamResponse:
        """200 and a body that never ends: 64 KiB chunks as fast as the client reads them
        ("endless"), or a space every 20 ms ("trickle"); until the client hangs up."""
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        chunk = b" " * (1 << 16) if action == "endless" else b" "
        try:
            while True:
                await response.write(chunk)
                self.num_streamed_bytes += len(chunk)
                if action == "trickle":
                    await asyncio.sleep(0.02)
        except (ConnectionError, RuntimeError):  # the client closed the connection
            self.num_streams_ended += 1
        return response

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append({"body": body, "headers": dict(request.headers), "t": time.time()})
        action = self.actions.pop(0) if self.actions else "ok"
        self.num_active += 1
        self.peak_active = max(self.peak_active, self.num_active)
        try:
            await asyncio.sleep(self.delay_s)
            if "SLOW" in body["messages"][-1]["content"]:
                await asyncio.sleep(self.slow_s)
            if isinstance(action, tuple) and action[0] == "status":
                _, status, headers = action
                error = {"error": {"message": f"fake error {status}", "type": "fake"}}
                return web.json_response(error, status=status, headers=headers)
            if action == "echo_auth":  # a proxy that echoes the request's headers
                echoed = f"bad request; you sent Authorization: {request.headers['Authorization']}"
                return web.json_response({"error": {"message": echoed}}, status=400)
            if action == "garbage":
                return web.Response(text="<html>proxy error</html>", content_type="text/html")
            if action in ("endless", "trickle"):
                return await self._stream_forever(request, action)
        finally:
            self.num_active -= 1
        user = body["messages"][-1]["content"]
        choices = [
            {
                "index": k,
                "message": {"role": "assistant", "content": self.judge(user, k)},
                "finish_reason": self.finish_reason,
            }
            for k in range(self.num_choices or body.get("n", 1))
        ]
        usage = {"prompt_tokens": len(user), "completion_tokens": 2 * len(choices)}
        payload = {"id": "x", "object": "chat.completion", "choices": choices, "usage": usage}
        if self.served_model is not None:
            payload["model"] = self.served_model
        return web.json_response(payload)


@pytest.fixture
def server():
    fake = FakeOpenAIServer()
    fake.start()
    yield fake
    fake.stop()


def _judge(base_url: str, *, votes: int = 1, sampling=None, **config) -> OpenAIJudge:
    config = {"backoff_s": 0.01, "max_backoff_s": 0.05, "timeout_s": 5.0, **config}
    return OpenAIJudge(
        OpenAIJudgeConfig(base_url=base_url, model="judge-7b", **config),
        template=JudgeTemplate(user="Q={prompt} R={response}", system="Grade strictly."),
        parser=YesNoParser(),
        votes=votes,
        sampling=sampling,
    )


def _samples(responses: list[str]) -> list[Sample]:
    return [Sample(prompt=f"q{i}", response=r, reference="4") for i, r in enumerate(responses)]


def test_score_sends_the_rendered_chat_and_parses_verdicts(server, monkeypatch) -> None:
    monkeypatch.setenv("YATT_TEST_JUDGE_KEY", KEY)
    judge = _judge(server.base_url, api_key_env="YATT_TEST_JUDGE_KEY")
    verdicts = judge.score(_samples(["4", "5"]))
    assert [(v.status, v.reward, v.text) for v in verdicts] == [
        ("ok", 1.0, "Yes"),
        ("ok", -1.0, "No"),
    ]
    first = next(r for r in server.requests if "R=4" in r["body"]["messages"][1]["content"])
    assert first["body"] == {
        "model": "judge-7b",
        "messages": [
            {"role": "system", "content": "Grade strictly."},
            {"role": "user", "content": "Q=q0 R=4"},
        ],
        "max_tokens": 512,
        "temperature": 0.0,
    }
    assert first["headers"]["Authorization"] == f"Bearer {KEY}"
    assert KEY not in repr(judge)
    # The judge's load, as GenRM counts it: the server's usage.
    assert verdicts[0].num_judge_prompt_tokens == len("Q=q0 R=4")
    assert verdicts[0].num_judge_response_tokens == 2


def test_votes_ask_for_n_choices_and_aggregate(server) -> None:
    server.judge = lambda user, k: "No" if k == 1 else "Yes"
    sampling = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=8, seed=3)
    judge = _judge(server.base_url, votes=3, sampling=sampling, extra_body={"min_p": 0.1})
    (verdict,) = judge.score(_samples(["4"]))
    assert verdict.reward == pytest.approx(1 / 3)
    assert [vote.reward for vote in verdict.votes] == [1.0, -1.0, 1.0]
    body = server.requests[0]["body"]
    assert (body["n"], body["temperature"], body["top_p"], body["max_tokens"]) == (3, 0.7, 0.9, 8)
    assert (body["seed"], body["min_p"]) == (3, 0.1)
    assert verdict.num_judge_prompt_tokens == 3 * len("Q=q0 R=4")


def test_min_p_and_repetition_penalty_are_sent_only_when_set(server) -> None:
    sampling = SamplingParams(temperature=0.7, min_p=0.05, repetition_penalty=1.2, max_new_tokens=8)
    _judge(server.base_url, sampling=sampling).score(_samples(["4"]))
    body = server.requests[-1]["body"]
    assert (body["min_p"], body["repetition_penalty"]) == (0.05, 1.2)
    _judge(server.base_url, sampling=SamplingParams(max_new_tokens=8)).score(_samples(["4"]))
    assert not {"min_p", "repetition_penalty"} & set(server.requests[-1]["body"])
    with pytest.raises(ValueError, match=r"extra_body sets \['min_p'\]"):
        _judge(server.base_url, sampling=sampling, extra_body={"min_p": 0.1})


def test_concurrency_is_bounded(server) -> None:
    server.delay_s = 0.05
    judge = _judge(server.base_url, max_concurrency=3)
    start = time.perf_counter()
    verdicts = judge.score(_samples(["4"] * 12))
    elapsed = time.perf_counter() - start
    assert [v.status for v in verdicts] == ["ok"] * 12
    assert server.peak_active == 3 and judge.metrics["peak_inflight_requests"] == 3
    assert elapsed >= 4 * 0.05  # 12 requests, 3 at a time


def test_timeout_is_retried_then_an_error_verdict(server) -> None:
    # Every try of the SLOW sample hangs; the other sample is unaffected.
    judge = _judge(server.base_url, timeout_s=0.2, max_retries=1, max_concurrency=1)
    start = time.perf_counter()
    slow, fast = judge.score(_samples(["SLOW", "4"]))
    assert time.perf_counter() - start < 1.0  # two timeouts and a fast answer
    assert slow.status == "error"
    assert slow.error.endswith("no answer within timeout_s=0.2 (after 2 tries)")
    assert fast.status == "ok"
    assert len(server.requests) == 3 and judge.metrics["num_retries"] == 1


def test_an_endless_body_is_cut_at_max_response_bytes_and_not_retried(server) -> None:
    """A 200 that streams without end (the issue: 625 MiB in 20 s) costs at most the cap."""
    server.actions = ["endless"]
    judge = _judge(server.base_url, max_response_bytes=2**20, timeout_s=20.0, max_retries=2)
    start = time.perf_counter()
    endless, fine = judge.score(_samples(["4", "4"]))
    assert time.perf_counter() - start < 10  # cut at the cap, not at the 20 s deadline
    assert endless.status == "error" and fine.status == "ok"
    assert "over max_response_bytes=1048576 (1 MiB) and reading stopped" in endless.error
    assert judge.metrics["num_retries"] == 0 and len(server.requests) == 2
    # The client hung up: the server's writes end, having sent about the cap (socket buffers
    # hold some more), not an unbounded amount.
    deadline = time.monotonic() + 5
    while server.num_streams_ended < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.num_streams_ended == 1
    assert server.num_streamed_bytes < 16 * 2**20


def test_a_trickling_body_ends_at_timeout_s_and_is_retried(server) -> None:
    """A body that trickles in under the cap still ends with the try's deadline."""
    server.actions = ["trickle", "trickle"]
    judge = _judge(server.base_url, timeout_s=0.3, max_retries=1)
    start = time.perf_counter()
    (verdict,) = judge.score(_samples(["4"]))
    assert time.perf_counter() - start < 3
    assert verdict.error.endswith("no answer within timeout_s=0.3 (after 2 tries)")
    assert judge.metrics["num_retries"] == 1


def test_check_endpoint_reads_at_most_max_response_bytes(server, monkeypatch) -> None:
    async def endless_models(request: web.Request) -> web.StreamResponse:
        return await server._stream_forever(request, "endless")

    monkeypatch.setattr(server, "_models", endless_models)
    server.stop()
    server.start()
    judge = _judge(server.base_url, max_response_bytes=2**20)
    with pytest.raises(ValueError, match=r"/models: the response body went over max_response"):
        judge.check_endpoint()


@pytest.mark.parametrize("status", [500, 503, 429, 408])
def test_transient_statuses_are_retried(server, status) -> None:
    server.actions = [("status", status, {}), ("status", status, {})]
    judge = _judge(server.base_url, max_retries=2)
    (verdict,) = judge.score(_samples(["4"]))
    assert (verdict.status, verdict.reward) == ("ok", 1.0)
    assert len(server.requests) == 3 and judge.metrics["num_retries"] == 2


def test_retry_after_is_honoured(server) -> None:
    server.actions = [
        ("status", 429, {"Retry-After": "0.4"}),
        ("status", 429, {"retry-after-ms": "200"}),
    ]
    judge = _judge(server.base_url, backoff_s=0.01, max_backoff_s=1.0)
    (verdict,) = judge.score(_samples(["4"]))
    assert verdict.status == "ok"
    t0, t1, t2 = (r["t"] for r in server.requests)
    assert t1 - t0 >= 0.4 and t2 - t1 >= 0.2
    assert t2 - t0 < 1.5


def test_retry_after_is_capped_by_max_backoff(server) -> None:
    server.actions = [("status", 503, {"Retry-After": "3600"})]
    judge = _judge(server.base_url, max_backoff_s=0.1)
    start = time.perf_counter()
    (verdict,) = judge.score(_samples(["4"]))
    assert verdict.status == "ok" and time.perf_counter() - start < 1.0


def test_exhausted_retries_and_client_errors_are_error_verdicts(server, caplog) -> None:
    server.actions = [("status", 500, {})] * 3
    judge = _judge(server.base_url, max_retries=2)
    with caplog.at_level(logging.WARNING, logger="yatt.genrm"):
        (verdict,) = judge.score(_samples(["4"]))
    assert verdict.status == "error" and verdict.reward == 0.0
    assert "HTTP 500: fake error 500 (after 3 tries)" in verdict.error
    assert "fake error 500" in caplog.text

    # A 4xx is our request's fault: sent once, its message kept.
    server.requests.clear()
    server.actions = [("status", 400, {})]
    (verdict,) = judge.score(_samples(["4"]))
    assert verdict.status == "error" and verdict.error.endswith("HTTP 400: fake error 400")
    assert len(server.requests) == 1


def test_key_is_never_logged_nor_in_errors(server, monkeypatch, caplog) -> None:
    monkeypatch.setenv("YATT_TEST_JUDGE_KEY", KEY)
    server.actions = [("status", 401, {}), "garbage"]
    judge = _judge(server.base_url, api_key_env="YATT_TEST_JUDGE_KEY")
    with caplog.at_level(logging.DEBUG):
        verdicts = judge.score(_samples(["4", "4"]))
    assert all(v.status == "error" for v in verdicts)
    errors = " ".join(v.error for v in verdicts)
    assert "HTTP 401" in errors and "not a chat completion" in errors
    assert KEY not in errors and KEY not in caplog.text


def test_garbage_and_short_answers_are_error_verdicts_without_retries(server) -> None:
    server.actions = ["garbage"]
    judge = _judge(server.base_url)
    (verdict,) = judge.score(_samples(["4"]))
    assert "HTTP 200 with a body that is not a chat completion" in verdict.error
    assert "proxy error" in verdict.error and len(server.requests) == 1

    # A server that ignores n answers one choice for three votes.
    server.num_choices = 1
    ignoring_n = _judge(server.base_url, votes=3, sampling=SamplingParams(temperature=1.0))
    (verdict,) = ignoring_n.score(_samples(["4"]))
    assert verdict.status == "error" and "1 choices for n=3" in verdict.error


def test_unreachable_server_is_an_error_in_bounded_time() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    judge = _judge(f"http://127.0.0.1:{port}/v1", max_retries=2)
    start = time.perf_counter()
    (verdict,) = judge.score(_samples(["4"]))
    assert verdict.status == "error" and "ClientConnectorError" in verdict.error
    assert time.perf_counter() - start < 2.0


@pytest.mark.parametrize("finish_reason", ["length", "abort"])
def test_a_judge_output_that_did_not_finish_is_an_error_never_a_verdict(
    server, finish_reason
) -> None:
    """Cut at its token budget mid-sentence, the judge's last line reads "Yes": an error (the
    issue: +1 on every sample), counted as such, whatever the line says."""
    server.judge = lambda user, k: "Let me check the answer. It is wrong, so I would not say\nYes"
    server.finish_reason = finish_reason
    judge = _judge(server.base_url)
    verdicts = judge.score(_samples(["4", "5"]))
    assert [(v.status, v.reward) for v in verdicts] == [("error", 0.0), ("error", 0.0)]
    assert "the judge's generation did not finish" in verdicts[0].error
    if finish_reason == "length":
        assert "finish reason 'length'; raise its max_new_tokens" in verdicts[0].error
    stats = ScoreStats.from_verdicts(verdicts)
    assert (stats.num_errors, stats.num_ok) == (2, 0)
    assert judge.metrics["num_unfinished_votes"] == 2
    # The same text, finished, is read.
    server.finish_reason = "stop"
    assert [v.reward for v in judge.score(_samples(["4"]))] == [1.0]


def test_the_api_key_is_scrubbed_from_an_error_body_that_echoes_it(
    server, monkeypatch, caplog
) -> None:
    monkeypatch.setenv("YATT_TEST_JUDGE_KEY", KEY)
    server.actions = ["echo_auth"]
    judge = _judge(server.base_url, api_key_env="YATT_TEST_JUDGE_KEY")
    with caplog.at_level(logging.DEBUG):
        (verdict,) = judge.score(_samples(["4"]))
    assert verdict.status == "error" and "HTTP 400" in verdict.error
    assert "you sent Authorization: Bearer ***" in verdict.error
    assert KEY not in verdict.error and KEY not in caplog.text
    assert "Bearer ***" in caplog.text  # the log line was written, scrubbed


def test_credentials_in_base_url_are_never_shown(server, caplog) -> None:
    url = server.base_url.replace("http://", "http://alice:s3cret-pw@")
    server.actions = [("status", 400, {})]
    judge = _judge(url, max_retries=0)
    with caplog.at_level(logging.DEBUG):
        (verdict,) = judge.score(_samples(["4"]))
    shown = " ".join([verdict.error, caplog.text, repr(judge), repr(judge.config), judge.url])
    assert "s3cret-pw" not in shown and "alice:" not in shown
    assert "http://***@127.0.0.1" in judge.url
    # The request itself still carries them (aiohttp sends them as basic auth).
    assert server.requests[0]["headers"]["Authorization"].startswith("Basic ")
    with pytest.raises(ValueError) as error:
        OpenAIJudgeConfig(base_url="ftp://alice:s3cret-pw@host/v1", model="m")
    assert "s3cret-pw" not in str(error.value)
    unreachable = _judge("http://alice:s3cret-pw@127.0.0.1:1/v1", timeout_s=0.5)
    with pytest.raises(ValueError) as error:
        unreachable.check_endpoint()
    assert "s3cret-pw" not in str(error.value) and "cannot be reached" in str(error.value)


def test_a_completion_from_another_model_is_warned_once_and_counted(server, caplog) -> None:
    judge = _judge(server.base_url)
    server.served_model = "judge-7b-2025-01-01"  # a dated snapshot of the model: the same
    judge.score(_samples(["4"]))
    assert judge.metrics["num_model_mismatches"] == 0
    server.served_model = "some-other-model"
    with caplog.at_level(logging.WARNING, logger="yatt.genrm"):
        verdicts = judge.score(_samples(["4", "5", "4"]))
    assert [v.reward for v in verdicts] == [1.0, -1.0, 1.0]  # still scored
    assert judge.metrics["num_model_mismatches"] == 3
    warnings = [r for r in caplog.records if "some-other-model" in r.getMessage()]
    assert len(warnings) == 1 and "not the configured 'judge-7b'" in warnings[0].getMessage()


def test_template_error_fails_only_its_sample(server) -> None:
    judge = OpenAIJudge(
        OpenAIJudgeConfig(base_url=server.base_url, model="m"),
        template=JudgeTemplate(user="R={response} ref={reference}"),
        parser=YesNoParser(),
    )
    ok, missing = judge.score(
        [Sample(prompt="q", response="4", reference="4"), Sample(prompt="q", response="4")]
    )
    assert ok.status == "ok"
    assert missing.status == "error" and "{reference}" in missing.error
    assert len(server.requests) == 1


def _png(size, color) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format="PNG")
    return out.getvalue()


def _says_yes_to_images(user: Any, vote: int) -> str:
    return "Yes" if isinstance(user, list) and user[0]["type"] == "image_url" else "No"


def test_an_image_template_sends_the_images_as_image_url_parts(server) -> None:
    Image = pytest.importorskip("PIL.Image")
    server.judge = _says_yes_to_images
    config = OpenAIJudgeConfig(base_url=server.base_url, model="judge-7b")
    judge = OpenAIJudge(
        config,
        template=JudgeTemplate(user="Q={prompt} R={response}", image_key="image"),
        parser=YesNoParser(),
    )
    red = Image.new("RGB", (3, 2), "red")
    blue_png = _png((2, 2), "blue")
    samples = [
        Sample(prompt="q0", response="4", metadata={"image": red}),
        Sample(prompt="q1", response="4", metadata={"image": [blue_png, "https://x.org/a.png"]}),
        Sample(prompt="q2", response="4", metadata={"label": "no image"}, id="no-image"),
    ]
    verdicts = judge.score(samples)
    assert [(v.status, v.reward) for v in verdicts[:2]] == [("ok", 1.0), ("ok", 1.0)]
    assert verdicts[2].status == "error"
    assert "sample 'no-image' has no image in metadata['image']" in verdicts[2].error
    assert len(server.requests) == 2  # the sample without its image was not sent
    by_prompt = {
        r["body"]["messages"][-1]["content"][-1]["text"]: r["body"] for r in server.requests
    }
    (image_part, text_part) = by_prompt["Q=q0 R=4"]["messages"][-1]["content"]
    assert text_part == {"type": "text", "text": "Q=q0 R=4"}
    assert image_part["type"] == "image_url"
    url = image_part["image_url"]["url"]
    assert url.startswith("data:image/png;base64,")
    sent = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
    assert sent.size == (3, 2) and sent.convert("RGB").getpixel((0, 0)) == (255, 0, 0)
    # Image file bytes go as they are; an http(s) URL is the server's to fetch.
    first, second, text = by_prompt["Q=q1 R=4"]["messages"][-1]["content"]
    assert first["image_url"]["url"] == "data:image/png;base64," + base64.b64encode(
        blue_png
    ).decode("ascii")
    assert second["image_url"]["url"] == "https://x.org/a.png"
    assert text["type"] == "text"


def test_a_text_only_judge_sends_no_image_of_the_row(server) -> None:
    Image = pytest.importorskip("PIL.Image")
    server.judge = _says_yes_to_images
    judge = _judge(server.base_url)
    (verdict,) = judge.score(
        [Sample(prompt="q", response="4", metadata={"image": Image.new("RGB", (2, 2))})]
    )
    assert verdict.reward == -1.0
    assert server.requests[0]["body"]["messages"][-1] == {"role": "user", "content": "Q=q R=4"}


def test_images_that_cannot_be_sent_are_error_verdicts(server) -> None:
    np = pytest.importorskip("numpy")
    pytest.importorskip("PIL")
    torch = pytest.importorskip("torch")
    server.judge = _says_yes_to_images
    judge = OpenAIJudge(
        OpenAIJudgeConfig(base_url=server.base_url, model="judge-7b"),
        template=JudgeTemplate(user="{response}", image_key="image"),
        parser=YesNoParser(),
    )
    images = [
        np.zeros((4, 5, 3), dtype=np.uint8),  # HWC uint8: sent as PNG
        torch.zeros(3, 4, 5, dtype=torch.uint8),  # CHW tensor: sent as PNG
        b"not an image file",
        "/no/such/image.png",
        object(),
    ]
    verdicts = judge.score(
        [Sample(prompt="q", response="r", metadata={"image": i}) for i in images]
    )
    assert [v.status for v in verdicts] == ["ok", "ok", "error", "error", "error"]
    assert "not a PNG, JPEG, GIF or WebP file" in verdicts[2].error
    assert "'/no/such/image.png' cannot be read" in verdicts[3].error
    assert "is not an image" in verdicts[4].error
    assert all(v.error.startswith("images: ") for v in verdicts[2:])
    assert len(server.requests) == 2


async def _stream(responses: list[str]):
    for response in responses:
        yield response
        await asyncio.sleep(0.001)


def test_streaming_beside_a_reward_function_over_two_event_loops(server) -> None:
    """score_as_completed with CombinedRM(OpenAIJudge, reward function), one asyncio.run per
    round as the trainer does: the same verdicts as score(), and each loop's session closed."""
    server.delay_s = 0.01
    judge = _judge(server.base_url, max_concurrency=4)
    is_short = RewardFunction(lambda prompt, response, reference, row: float(len(response) < 2))
    combined = CombinedRM(judge, [(is_short, 0.5)])
    responses = ["4", "5", "44", "4"] * 4
    expected = [
        v.reward for v in combined.score([Sample(prompt="q", response=r) for r in responses])
    ]

    def to_sample(response: str) -> Sample:
        return Sample(prompt="q", response=response)

    for _ in range(2):
        scored = asyncio.run(score_as_completed(_stream(responses), combined, to_sample))
        assert [v.reward for v in scored.verdicts] == expected
        assert scored.stats.num_ok == len(responses)
        assert judge._http_by_loop == {}  # closed with its loop
    assert expected[:3] == [1.5, -0.5, -1.0]
    assert server.peak_active <= 4


def test_streaming_reaches_max_concurrency_when_samples_trickle_in(server) -> None:
    """Samples submitted one at a time are each their own batch: the batcher's cap on batches
    in flight (16 by default) must not hold requests back below max_concurrency."""
    server.delay_s = 0.4
    judge = _judge(server.base_url, max_concurrency=30)

    async def main():
        scored = await score_as_completed(_stream(["4"] * 30), judge, lambda r: _samples([r])[0])
        await judge.aclose()
        return scored

    scored = asyncio.run(main())
    assert scored.stats.num_ok == 30
    arrivals = [r["t"] for r in server.requests]
    # All 30 were sent before the first answer came back (each takes 0.4 s).
    assert max(arrivals) - min(arrivals) < 0.3
    assert server.peak_active == 30


def test_check_endpoint_fails_fast_with_the_cause(server, monkeypatch) -> None:
    monkeypatch.setenv("YATT_TEST_JUDGE_KEY", KEY)
    server.models_key = KEY
    _judge(server.base_url, api_key_env="YATT_TEST_JUDGE_KEY").check_endpoint()
    with pytest.raises(ValueError, match="HTTP 401: bad key; no key was sent: set api_key_env"):
        _judge(server.base_url).check_endpoint()
    monkeypatch.setenv("YATT_TEST_JUDGE_KEY", "sk-wrong")
    with pytest.raises(ValueError, match=r"bad key; check the key in \$YATT_TEST_JUDGE_KEY"):
        _judge(server.base_url, api_key_env="YATT_TEST_JUDGE_KEY").check_endpoint()
    server.models_key = None
    wrong_model = OpenAIJudge(
        OpenAIJudgeConfig(base_url=server.base_url, model="judge-70b"),
        template=JudgeTemplate(user="{response}"),
        parser=YesNoParser(),
    )
    with pytest.raises(ValueError, match=r"model='judge-70b' is not served.*\['judge-7b'\]"):
        wrong_model.check_endpoint()
    with pytest.raises(ValueError, match="cannot be reached"):
        _judge("http://127.0.0.1:1/v1", timeout_s=1.0).check_endpoint()


def test_aclose_ends_in_flight_requests(server) -> None:
    server.delay_s = 5.0
    judge = _judge(server.base_url)

    async def main():
        task = asyncio.create_task(judge.ascore(_samples(["4", "5"])))
        await asyncio.sleep(0.2)
        await judge.aclose()
        return await asyncio.wait_for(task, 2.0)

    verdicts = asyncio.run(main())
    assert [v.status for v in verdicts] == ["error", "error"]
    assert judge._http_by_loop == {}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"base_url": "localhost:8000/v1"}, "must start with http"),
        ({"base_url": "http://h/v1/chat/completions"}, r"give the API root \('http://h/v1'\)"),
        ({"model": ""}, "model=''"),
        ({"max_concurrency": 0}, "max_concurrency=0"),
        ({"max_retries": -1}, "max_retries=-1"),
        ({"timeout_s": 0}, "timeout_s=0"),
        ({"max_response_bytes": 100}, r"max_response_bytes=100: must be an int >= 1024"),
        ({"backoff_s": 2.0, "max_backoff_s": 1.0}, "backoff_s <= max_backoff_s"),
        ({"extra_body": {"temperature": 1.0, "n": 2}}, r"sets \['n', 'temperature'\]"),
        ({"api_key_env": "YATT_TEST_UNSET_KEY_VAR"}, "'YATT_TEST_UNSET_KEY_VAR': that environment"),
    ],
    ids=[
        "scheme",
        "full_path",
        "model",
        "concurrency",
        "retries",
        "timeout",
        "max_response_bytes",
        "backoff",
        "extra",
        "key",
    ],
)
def test_bad_configuration_is_rejected_up_front(kwargs, match, monkeypatch) -> None:
    monkeypatch.delenv("YATT_TEST_UNSET_KEY_VAR", raising=False)
    config = {"base_url": "http://127.0.0.1:1/v1", "model": "m", **kwargs}
    with pytest.raises(ValueError, match=match):
        OpenAIJudge(
            OpenAIJudgeConfig(**config),
            template=JudgeTemplate(user="{response}"),
            parser=YesNoParser(),
        )


def test_greedy_votes_are_rejected() -> None:
    with pytest.raises(ValueError, match="greedy votes are identical"):
        _judge("http://127.0.0.1:1/v1", votes=2, sampling=SamplingParams(temperature=0.0))


def test_a_row_with_a_lone_surrogate_is_a_data_skip_and_never_sent(server) -> None:
    judge = _judge(server.base_url)
    bad = Sample(prompt="q", response="4", reference="\udc80")
    skipped, fine = judge.score([bad, _samples(["4"])[0]])
    assert skipped.skip_cause is not None and "reference is not valid Unicode" in skipped.skip_cause
    assert fine.status == "ok" and len(server.requests) == 1
    stats = ScoreStats.from_verdicts([skipped, fine])
    assert (stats.num_errors, stats.num_data_skips) == (0, 1)
