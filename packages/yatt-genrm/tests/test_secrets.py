"""Credentials never reach a message genrm writes, whatever a server sends back."""

NUM_GPUS = 0

import asyncio
import base64
import logging
import threading

import pytest
from aiohttp import web

from yatt.genrm import GenRMClient, Sample
from yatt.genrm._secrets import Scrubber, redact_url, url_credentials

pytestmark = pytest.mark.timeout(60)

KEY = "sk-live-9f8e7d6c5b4a3210"


def test_scrubber_replaces_every_form_of_a_secret() -> None:
    scrub = Scrubber([KEY, *url_credentials("https://bob:p%40ss-word@host/v1"), None, ""])
    basic = base64.b64encode(b"bob:p@ss-word").decode()
    text = (
        f"echo {KEY}; Authorization: Bearer {KEY}; Basic {basic}; "
        "url https://bob:p%40ss-word@host/v1; password p@ss-word; another Bearer tok-123456789"
    )
    scrubbed = scrub(text)
    for secret in (KEY, basic, "p%40ss-word", "p@ss-word", "bob:", "tok-123456789"):
        assert secret not in scrubbed
    assert "https://***@host/v1" in scrubbed
    # Prose is left alone.
    assert scrub("the bearer of Basic arithmetic") == "the bearer of Basic arithmetic"
    assert redact_url("http://a:b@h:1/v1") == "http://***@h:1/v1"
    assert redact_url("http://h:1/v1") == "http://h:1/v1"


class _EchoServer:
    """/score and /health on 127.0.0.1 that answer 401 with the request's headers echoed."""

    def __enter__(self) -> "_EchoServer":
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    async def _start(self) -> int:
        async def echo(request: web.Request) -> web.Response:
            message = f"denied: you sent {request.headers.get('Authorization')}"
            return web.json_response({"error": message}, status=401)

        app = web.Application()
        app.router.add_post("/score", echo)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return site._server.sockets[0].getsockname()[1]

    def __exit__(self, *exc_info: object) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def test_genrm_client_scrubs_a_key_the_service_echoes(caplog) -> None:
    with _EchoServer() as server:
        client = GenRMClient(f"http://127.0.0.1:{server.port}", api_key=KEY, max_retries=0)
        with caplog.at_level(logging.DEBUG):
            (verdict,) = client.score([Sample(prompt="q", response="r")])
    assert verdict.status == "error" and "401" in verdict.error
    assert "you sent Bearer ***" in verdict.error
    assert KEY not in verdict.error and KEY not in caplog.text
