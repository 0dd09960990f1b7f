NUM_GPUS = 0

import asyncio
import contextlib
import json
import logging
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from aiohttp import web

from yatt.genrm import (
    BatchingConfig,
    GenRM,
    GenRMClient,
    JudgeTemplate,
    Sample,
    YesNoParser,
    create_app,
)
from yatt.genrm.serve import build_parser
from yatt.genrm.testing import ByteTokenizer, FakeJudgeEngine

pytestmark = pytest.mark.timeout(60)


def _judge(prompt_text: str, vote: int) -> str:
    return "Yes" if int(re.search(r"R=(\d+)", prompt_text).group(1)) % 2 == 0 else "No"


def _make_genrm(**engine_kwargs) -> GenRM:
    return GenRM(
        FakeJudgeEngine(judge=_judge, **engine_kwargs),
        template=JudgeTemplate(user="R={response}"),
        parser=YesNoParser(),
        batching=BatchingConfig(max_batch_size=16, batch_window_millis=10.0),
    )


class ServerThread:
    """The app on 127.0.0.1 in its own thread and event loop, so blocking clients can call it."""

    def __init__(self, genrm: GenRM, **app_kwargs) -> None:
        self.genrm, self.app_kwargs, self.port = genrm, app_kwargs, 0

    def start(self, port: int = 0) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(port), self.loop).result(10)

    async def _start(self, port: int) -> int:
        self.runner = web.AppRunner(create_app(self.genrm, **self.app_kwargs))
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        return self.runner.addresses[0][1]

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture
def server():
    srv = ServerThread(_make_genrm(), max_batch=32, max_body_bytes=1 << 20)
    srv.start()
    yield srv
    srv.stop()


def _post(url: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **(headers or {})}
    request = urllib.request.Request(f"{url}/score", data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _samples(n: int, start: int = 0) -> list[Sample]:
    return [Sample(prompt="q", response=str(i), id=f"s{i}") for i in range(start, start + n)]


def _expected(sample: Sample) -> float:
    return 1.0 if int(sample.response) % 2 == 0 else -1.0


def test_health_and_score_match_in_process(server) -> None:
    client = GenRMClient(server.url)
    health = client.health()
    assert health["status"] == "ok" and health["max_batch"] == 32
    samples = _samples(5)
    remote = client.score(samples)
    local = _make_genrm().score(samples)
    assert [v.to_dict() for v in remote] == [v.to_dict() for v in local]
    assert remote[0].num_judge_prompt_tokens > 0  # the judge's cost crosses the wire


def test_a_sample_that_is_not_json_is_an_error_verdict_the_others_are_scored(server) -> None:
    samples = _samples(3)
    samples[1].metadata["image"] = object()  # a row's PIL image, say: not JSON
    client = GenRMClient(server.url)
    verdicts = client.score(samples)
    streamed = asyncio.run(client.ascore(samples))
    for got in (verdicts, streamed):
        assert [v.status for v in got] == ["ok", "error", "ok"]
        assert [v.reward for v in got[::2]] == [_expected(samples[0]), _expected(samples[2])]
        assert "does not encode as JSON" in got[1].error
        assert "drop images" in got[1].error


def test_concurrent_clients_share_judge_batches(server) -> None:
    client = GenRMClient(server.url)

    def work(k: int) -> list:
        return client.score(_samples(6, start=6 * k))

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(work, range(8)))
    for k, verdicts in enumerate(results):
        samples = _samples(6, start=6 * k)
        assert [v.sample_id for v in verdicts] == [s.id for s in samples]
        assert [v.reward for v in verdicts] == [_expected(s) for s in samples]
    calls = server.genrm.engine.calls
    assert sum(c.num_requests for c in calls) == 48
    assert len(calls) < 48  # requests from different clients were judged together


@pytest.mark.parametrize(
    ("body", "status", "field", "message"),
    [
        (b"{not json", 400, None, "not valid JSON"),
        (b"\xff\xfe", 400, None, "not valid JSON"),
        (b"[1, 2]", 422, None, "must be a JSON object"),
        (b'{"samples": {}}', 422, "samples", "must be a list"),
        (b'{"samples": [], "extra": 1}', 422, "extra", "unknown field"),
        (b'{"samples": [3]}', 422, "samples[0]", "must be an object"),
        (b'{"samples": [{"prompt": "q"}]}', 422, "samples[0].response", "is required"),
        (
            b'{"samples": [{"prompt": "q", "response": "1"}, {"prompt": "q", "response": 7}]}',
            422,
            "samples[1].response",
            "must be a string, got int",
        ),
        (
            b'{"samples": [{"prompt": "q", "response": "1", "reference": 4}]}',
            422,
            "samples[0].reference",
            "must be a string",
        ),
        (
            b'{"samples": [{"prompt": "q", "response": "1", "metadata": []}]}',
            422,
            "samples[0].metadata",
            "must be an object",
        ),
        (
            b'{"samples": [{"prompt": "q", "response": "1", "color": "red"}]}',
            422,
            "samples[0].color",
            "unknown field",
        ),
        (b'{"samples": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None, "nests deeper"),
        (
            b'{"samples": [{"prompt": "q", "response": "1", "metadata": {"a": '
            + b"[" * 40
            + b"]" * 40
            + b"}}]}",
            400,
            None,
            "nests deeper",
        ),
    ],
    ids=[
        "malformed",
        "not_utf8",
        "not_object",
        "samples_type",
        "extra_key",
        "sample_type",
        "missing_field",
        "wrong_type",
        "reference_type",
        "metadata_type",
        "unknown_sample_field",
        "deep_json",
        "deep_metadata",
    ],
)
def test_bad_requests_get_4xx_naming_the_field(server, body, status, field, message) -> None:
    got_status, payload = _post(server.url, body)
    assert got_status == status
    assert payload["field"] == field
    assert message in payload["error"]
    # The server goes on serving after a bad request.
    ok_status, ok = _post(
        server.url, json.dumps({"samples": [s.to_dict() for s in _samples(1)]}).encode()
    )
    assert ok_status == 200 and ok["verdicts"][0]["reward"] == 1.0


def test_oversized_batch_and_body_get_413(server) -> None:
    status, payload = _post(
        server.url, json.dumps({"samples": [s.to_dict() for s in _samples(33)]}).encode()
    )
    assert status == 413
    assert "exceeds this server's max batch of 32" in payload["error"]
    big = {"samples": [{"prompt": "q", "response": "x" * (2 << 20)}]}
    status, payload = _post(server.url, json.dumps(big).encode())
    assert status == 413 and "too large" in payload["error"]
    # The client turns a 4xx into error verdicts at once (no retries: resending cannot help).
    client = GenRMClient(server.url, batching=BatchingConfig(max_batch_size=64))
    verdicts = client.score(_samples(40))
    assert {v.status for v in verdicts} == {"error"}
    assert "HTTP 413" in verdicts[0].error and client.metrics["num_retries"] == 0


def test_unknown_route_answers_json(server) -> None:
    request = urllib.request.Request(f"{server.url}/nope")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=10)
    assert info.value.code == 404
    assert "error" in json.loads(info.value.read())


def test_client_timeout_gives_error_verdicts_in_bounded_time() -> None:
    srv = ServerThread(_make_genrm(batch_latency_s=1.5))
    srv.start()
    try:
        client = GenRMClient(srv.url, timeout_s=0.3, max_retries=1, backoff_s=0.05)
        start = time.perf_counter()
        verdicts = client.score(_samples(2))
        elapsed = time.perf_counter() - start
    finally:
        srv.stop()
    assert [v.status for v in verdicts] == ["error", "error"]
    assert "Timeout" in verdicts[0].error
    assert elapsed < 3.0
    assert client.metrics["num_retries"] == 1


async def _endless(request: web.Request) -> web.StreamResponse:
    """200 and a JSON body that never ends (a space after another), until the client hangs up."""
    response = web.StreamResponse(headers={"Content-Type": "application/json"})
    await response.prepare(request)
    with contextlib.suppress(ConnectionError, RuntimeError):
        while True:
            await response.write(b" " * (1 << 16))
    return response


def test_client_stops_reading_an_endless_body_at_max_response_bytes() -> None:
    srv = ServerThread(_make_genrm())
    srv.start()

    async def swap_routes() -> None:  # the same server, answering without end
        await srv.runner.cleanup()
        app = web.Application()
        app.router.add_post("/score", _endless)
        app.router.add_get("/health", _endless)
        srv.runner = web.AppRunner(app)
        await srv.runner.setup()
        await web.TCPSite(srv.runner, "127.0.0.1", srv.port).start()

    asyncio.run_coroutine_threadsafe(swap_routes(), srv.loop).result(10)
    try:
        client = GenRMClient(srv.url, timeout_s=20.0, max_retries=2, max_response_bytes=2**20)
        start = time.perf_counter()
        verdicts = client.score(_samples(2))
        assert time.perf_counter() - start < 10  # at the cap, not the 20 s deadline
        assert [v.status for v in verdicts] == ["error", "error"]
        assert "went over max_response_bytes=1048576 (1 MiB)" in verdicts[0].error
        assert client.metrics["num_retries"] == 0  # it would stream again
        with pytest.raises(Exception, match="went over max_response_bytes"):
            client.health()
    finally:
        srv.stop()
    with pytest.raises(ValueError, match="max_response_bytes=10: must be an int >= 1024"):
        GenRMClient(srv.url, max_response_bytes=10)


def test_client_recovers_when_the_server_restarts() -> None:
    srv = ServerThread(_make_genrm())
    srv.start()
    port = srv.port
    # Retries cover ~8 s: a loaded CI machine may take seconds to bring the server back.
    client = GenRMClient(srv.url, max_retries=24, backoff_s=0.1, max_backoff_s=0.4)
    assert client.score(_samples(2))[0].status == "ok"
    srv.stop()
    # Down: refused connections are retried with backoff while the server comes back.
    restart = threading.Timer(0.4, srv.start, kwargs={"port": port})
    restart.start()
    try:
        verdicts = client.score(_samples(3))
    finally:
        restart.join()
        srv.stop()
    assert [v.status for v in verdicts] == ["ok"] * 3
    assert [v.reward for v in verdicts] == [1.0, -1.0, 1.0]
    assert client.metrics["num_retries"] >= 1
    # Gone for good: bounded retries, then error verdicts (no hang, no raise).
    down = GenRMClient(f"http://127.0.0.1:{port}", max_retries=2, backoff_s=0.05)
    assert [v.status for v in down.score(_samples(1))] == ["error"]


def test_client_streaming_interface(server) -> None:
    client = GenRMClient(server.url, batching=BatchingConfig(max_batch_size=4))
    samples = _samples(20)

    async def main() -> dict[str, float]:
        async def producer() -> None:
            for s in samples:
                await client.submit(s)
            await client.finish()

        task = asyncio.create_task(producer())
        got = {v.sample_id: v.reward async for v in client.results()}
        await task
        await client.aclose()
        return got

    assert asyncio.run(main()) == {s.id: _expected(s) for s in samples}


def _small_body(response: str = "2") -> bytes:
    return json.dumps({"samples": [{"prompt": "q", "response": response}]}).encode()


class SlowTokenizer(ByteTokenizer):
    """A tokenizer whose cost grows with the text, as a real one's does (about 17 s for 8 MiB)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        time.sleep(2e-6 * len(text))
        return super().encode(text, add_special_tokens)


def _max_latency_s(url: str, num_requests: int) -> float:
    def one(_: int) -> float:
        start = time.perf_counter()
        status, _payload = _post(url, _small_body())
        assert status == 200
        return time.perf_counter() - start

    with ThreadPoolExecutor(num_requests) as pool:
        return max(pool.map(one, range(num_requests)))


def test_huge_response_does_not_stall_small_requests() -> None:
    # A 2 MiB response costs this tokenizer ~4 s whole; cut by characters first and tokenized
    # off the event loop, it costs the small requests next to nothing.
    genrm = GenRM(
        FakeJudgeEngine(judge=_judge, tokenizer=SlowTokenizer()),
        template=JudgeTemplate(user="R={response}", max_response_tokens=64),
        parser=YesNoParser(),
        batching=BatchingConfig(max_batch_size=16, batch_window_millis=10.0),
    )
    srv = ServerThread(genrm, max_body_bytes=16 << 20)
    srv.start()
    try:
        baseline_s = _max_latency_s(srv.url, 20)
        with ThreadPoolExecutor(1) as pool:
            huge = pool.submit(_post, srv.url, _small_body("2" + "x" * (2 << 20)))
            time.sleep(0.3)  # the huge request is in: parsed, batched, being rendered
            loaded_s = _max_latency_s(srv.url, 20)
            status, payload = huge.result(timeout=30)
    finally:
        srv.stop()
    assert status == 200 and payload["verdicts"][0]["reward"] == 1.0
    # Generous: before the fix the small requests waited ~4 s for the huge one's tokenization.
    assert loaded_s < baseline_s + 1.5, (baseline_s, loaded_s)


def _raw_request(port: int, head: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(head)
    return sock


def _score_head(content_length: int) -> bytes:
    return (
        b"POST /score HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % content_length
    )


def test_slow_body_gets_408_in_bounded_time() -> None:
    srv = ServerThread(_make_genrm(), body_timeout_s=0.5)
    srv.start()
    stop = threading.Event()
    sock = _raw_request(srv.port, _score_head(1000))

    def trickle() -> None:  # one byte at a time: each read alone would look alive
        with contextlib.suppress(OSError):
            while not stop.wait(0.1):
                sock.sendall(b" ")

    sender = threading.Thread(target=trickle, daemon=True)
    start = time.perf_counter()
    sender.start()
    try:
        status_line = sock.recv(4096).split(b"\r\n", 1)[0]
        elapsed_s = time.perf_counter() - start
        stop.set()
        sender.join(5)
        sock.close()
        assert b" 408 " in status_line, status_line
        assert elapsed_s < 5.0  # 0.5 s configured; was held as long as the client kept sending
        ok_status, _ = _post(srv.url, _small_body())
        assert ok_status == 200
    finally:
        stop.set()
        srv.stop()


def test_body_over_the_limit_is_refused_before_it_is_read(server) -> None:
    sock = _raw_request(server.port, _score_head(2 << 20))  # the 2 MiB never comes
    try:
        response = sock.recv(4096).decode()
    finally:
        sock.close()
    assert " 413 " in response.split("\r\n", 1)[0]
    assert "max_body_bytes=1048576" in response


def test_client_disconnect_is_one_log_line(server, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="yatt.genrm"):
        sock = _raw_request(server.port, _score_head(1000) + b'{"samples": [')
        time.sleep(0.2)
        sock.close()  # mid-body
        deadline = time.perf_counter() + 5
        while time.perf_counter() < deadline and "disconnected" not in caplog.text:
            time.sleep(0.05)
        ok_status, _ = _post(server.url, _small_body())
    records = [r for r in caplog.records if r.name == "yatt.genrm"]
    assert ok_status == 200
    assert len(records) == 1, [r.getMessage() for r in records]
    assert "disconnected" in records[0].getMessage()
    assert records[0].exc_info is None and records[0].levelno < logging.WARNING


@pytest.fixture
def keyed_server():
    srv = ServerThread(_make_genrm(), api_key="s3cret")
    srv.start()
    yield srv
    srv.stop()


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({}, 401),
        ({"Authorization": "Bearer wrong"}, 401),
        ({"Authorization": "s3cret"}, 401),
        ({"Authorization": "Bearer s3cret"}, 200),
    ],
    ids=["missing", "wrong", "not_bearer", "right"],
)
def test_api_key_is_required_on_score(keyed_server, headers, status) -> None:
    got, payload = _post(keyed_server.url, _small_body(), headers)
    assert got == status
    if status == 401:
        assert payload["field"] == "Authorization" and "Bearer" in payload["error"]


def test_api_key_client_and_health(keyed_server, monkeypatch) -> None:
    assert GenRMClient(keyed_server.url).health()["status"] == "ok"  # probes need no key
    (verdict,) = GenRMClient(keyed_server.url, api_key="s3cret").score(_samples(1))
    assert verdict.status == "ok"
    keyless = GenRMClient(keyed_server.url)
    (refused,) = keyless.score(_samples(1))
    assert refused.status == "error" and "HTTP 401" in refused.error
    assert keyless.metrics["num_retries"] == 0  # resending without a key cannot help
    monkeypatch.setenv("YATT_GENRM_API_KEY", "s3cret")
    assert GenRMClient(keyed_server.url).score(_samples(1))[0].status == "ok"
    assert build_parser().parse_args(["--model", "m"]).api_key == "s3cret"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"api_key": ""}, "api_key is empty"),
        ({"body_timeout_s": 0}, "body_timeout_s"),
        ({"max_body_bytes": 0}, "max_body_bytes"),
    ],
    ids=["empty_key", "timeout", "body_limit"],
)
def test_create_app_rejects_bad_settings(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        create_app(_make_genrm(), **kwargs)


def test_serve_flags_reach_the_app(monkeypatch) -> None:
    from yatt.genrm import serve

    got: dict = {}
    monkeypatch.setattr(serve, "load_engine", lambda args: FakeJudgeEngine())
    monkeypatch.setattr(serve, "create_app", lambda genrm, **kwargs: got.update(kwargs))
    monkeypatch.setattr(serve.web, "run_app", lambda app, **kwargs: None)
    serve.main(["--model", "m", "--max-body-mib", "0.5", "--body-timeout-s", "3", "--api-key", "k"])
    assert got == {
        "max_batch": 256,
        "max_body_bytes": 1 << 19,
        "body_timeout_s": 3.0,
        "api_key": "k",
    }


# -- a pool of servers (the judge data-parallel: one server per GPU) ------------------------------
@pytest.fixture
def pool():
    servers = [ServerThread(_make_genrm(), max_batch=32) for _ in range(2)]
    for srv in servers:
        srv.start()
    yield servers
    for srv in servers:
        srv.stop()


def _served(srv: ServerThread) -> int:
    return sum(c.num_requests for c in srv.genrm.engine.calls)


def test_pool_score_gives_every_server_a_share_in_order(pool) -> None:
    client = GenRMClient([srv.url for srv in pool])
    assert client.urls == tuple(srv.url for srv in pool) and client.url == pool[0].url
    samples = _samples(10)
    verdicts = client.score(samples)
    assert [v.sample_id for v in verdicts] == [s.id for s in samples]
    assert [v.reward for v in verdicts] == [_expected(s) for s in samples]
    assert [_served(srv) for srv in pool] == [5, 5]
    assert client.num_samples_by_url == {pool[0].url: 5, pool[1].url: 5}
    health = client.health_all()
    assert [health[srv.url]["metrics"]["num_samples"] for srv in pool] == [5, 5]
    # More requests than servers: each server takes the next one when it is free.
    small = GenRMClient([srv.url for srv in pool], batching=BatchingConfig(max_batch_size=3))
    samples = _samples(14, start=10)
    verdicts = small.score(samples)
    assert [v.reward for v in verdicts] == [_expected(s) for s in samples]
    assert all(_served(srv) > 5 for srv in pool) and sum(map(_served, pool)) == 24
    # One URL: one request per max_batch_size samples, one after another, as before.
    one = GenRMClient(pool[0].url, batching=BatchingConfig(max_batch_size=4))
    other = _served(pool[1])
    assert [v.status for v in one.score(_samples(9))] == ["ok"] * 9
    assert one.num_samples_by_url == {pool[0].url: 9} and _served(pool[1]) == other


def test_pool_streaming_goes_to_the_least_busy_server(pool) -> None:
    client = GenRMClient(
        [srv.url for srv in pool], batching=BatchingConfig(max_batch_size=2, max_pending=64)
    )
    samples = _samples(20)

    async def main() -> list:
        got = await client.ascore(samples)
        await client.aclose()
        return got

    verdicts = asyncio.run(main())
    assert [v.reward for v in verdicts] == [_expected(s) for s in samples]
    assert all(_served(srv) > 0 for srv in pool) and sum(map(_served, pool)) == 20
    assert client._in_flight == [0, 0]
    # The choice itself: fewest samples in flight; a tie goes to the next server in turn.
    client._in_flight, client._turn = [4, 1], 0
    assert client._least_busy_server() == 1
    client._in_flight = [0, 0]
    assert [client._least_busy_server() for _ in range(4)] == [0, 1, 0, 1]


def test_pool_retries_a_dead_server_s_requests_on_the_next_one(server) -> None:
    dead = f"http://127.0.0.1:{socket_free_port()}"
    client = GenRMClient([dead, server.url], max_retries=2, backoff_s=0.01)
    samples = _samples(6)
    verdicts = client.score(samples)
    assert [v.reward for v in verdicts] == [_expected(s) for s in samples]
    assert client.metrics["num_retries"] == 1  # the dead server's share, once, elsewhere
    assert client.num_samples_by_url == {dead: 3, server.url: 6}
    # Every server down: bounded retries, then error verdicts, as with one URL.
    down = GenRMClient([dead], max_retries=1, backoff_s=0.01)
    assert [v.status for v in down.score(_samples(2))] == ["error", "error"]


def socket_free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ([], "pass one URL"),
        (["http://a:1", "ftp://b:2"], "must start with http"),
        (["http://a:1", "http://a:1/"], "listed twice"),
    ],
    ids=["empty", "scheme", "twice"],
)
def test_pool_urls_are_checked(url, match) -> None:
    with pytest.raises(ValueError, match=match):
        GenRMClient(url)
