"""The HTTP face of a GenRM, for layouts where the judge runs in other processes.

    POST /score  {"samples": [{"prompt", "response", "reference"?, "id"?, "metadata"?}, ...]}
              -> 200 {"verdicts": [Verdict.to_dict(), ...]}   (same order)
              -> 400 malformed JSON or JSON nested deeper than MAX_JSON_DEPTH,
                 401 a missing or wrong API key (when the server has one),
                 408 a body not received within body_timeout_s,
                 413 more than max_batch samples, or a body over max_body_bytes,
                 422 a field of the wrong type (the error names it)
    GET  /health -> 200 {"status": "ok", "metrics": {...}}   (open without the API key, for probes)

Concurrent requests share the scorer's batcher, so many small clients still fill judge batches.
The event loop only moves bytes: the JSON body is parsed on a worker thread and the judge
renders (tokenizes) prompts on its own thread, so one huge request does not stall the small
ones. A bad request gets its 4xx JSON answer, a client that hangs up is one log line, and the
server goes on serving.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from typing import Any

from aiohttp import web

from yatt.genrm._stream import StreamingScorer
from yatt.genrm._types import Sample
from yatt.genrm._version import __version__

logger = logging.getLogger("yatt.genrm")

SCORER_KEY = web.AppKey("scorer", StreamingScorer)
# A /score body is {"samples": [{..., "metadata": {...}}]}: depth 4 plus what metadata nests.
MAX_JSON_DEPTH = 32
_SAMPLE_FIELDS = {"prompt": str, "response": str, "reference": (str, type(None))}
_OPTIONAL_FIELDS = {"id": str, "metadata": dict}


class RequestError(ValueError):
    """A client error: `status` and a message naming the offending field."""

    def __init__(self, status: int, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status, self.field = status, field


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def parse_samples(body: Any, *, max_batch: int) -> list[Sample]:
    """The request body's samples; RequestError names the first bad field."""
    if not isinstance(body, dict):
        raise RequestError(422, f"body must be a JSON object, got {_type_name(body)}")
    unknown = sorted(set(body) - {"samples"})
    if unknown:
        raise RequestError(
            422, f"unknown field {unknown[0]!r}; the body has only 'samples'", unknown[0]
        )
    raw = body.get("samples")
    if not isinstance(raw, list):
        raise RequestError(422, f"'samples' must be a list, got {_type_name(raw)}", "samples")
    if len(raw) > max_batch:
        raise RequestError(
            413,
            f"batch of {len(raw)} samples exceeds this server's max batch of {max_batch}; "
            f"split it into requests of at most {max_batch} samples",
            "samples",
        )
    samples = []
    for i, item in enumerate(raw):
        where = f"samples[{i}]"
        if not isinstance(item, dict):
            raise RequestError(422, f"{where} must be an object, got {_type_name(item)}", where)
        allowed = {**_SAMPLE_FIELDS, **_OPTIONAL_FIELDS}
        for key in item:
            if key not in allowed:
                raise RequestError(
                    422, f"{where}.{key}: unknown field; use {sorted(allowed)}", f"{where}.{key}"
                )
        for key, kind in _SAMPLE_FIELDS.items():
            if key == "reference" and key not in item:
                continue
            if key not in item:
                raise RequestError(422, f"{where}.{key} is required", f"{where}.{key}")
            if not isinstance(item[key], kind):
                raise RequestError(
                    422,
                    f"{where}.{key} must be a string, got {_type_name(item[key])}",
                    f"{where}.{key}",
                )
        for key, kind in _OPTIONAL_FIELDS.items():
            if key in item and not isinstance(item[key], kind):
                expected = "a string" if kind is str else "an object"
                raise RequestError(
                    422,
                    f"{where}.{key} must be {expected}, got {_type_name(item[key])}",
                    f"{where}.{key}",
                )
        if item.get("id") == "":
            raise RequestError(422, f"{where}.id must be non-empty", f"{where}.id")
        samples.append(Sample(**item))
    return samples


def _error(status: int, message: str, field: str | None = None) -> web.Response:
    return web.json_response({"error": message, "field": field}, status=status)


def _is_deeper_than(value: Any, max_depth: int) -> bool:
    """Whether `value` nests lists/objects deeper than `max_depth` (iterative: no recursion)."""
    containers = (dict, list)
    stack = [(value, 1)] if isinstance(value, containers) else []
    while stack:
        item, depth = stack.pop()
        if depth > max_depth:
            return True
        children = item.values() if isinstance(item, dict) else item
        # Only containers go on the stack: a long flat list costs no memory here.
        stack.extend((c, depth + 1) for c in children if isinstance(c, containers))
    return False


def load_json_body(raw: bytes) -> Any:
    """The parsed body; RequestError(400) when it is not JSON or nests too deep."""
    too_deep = RequestError(
        400, f"body JSON nests deeper than {MAX_JSON_DEPTH} levels; flatten Sample.metadata"
    )
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(400, f"body is not valid JSON: {e}") from None
    except RecursionError:
        # json's C parser recurses once per nesting level: a 100k-deep body was a 500.
        raise too_deep from None
    if _is_deeper_than(body, MAX_JSON_DEPTH):
        raise too_deep
    return body


@web.middleware
async def _json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    # aiohttp's own errors (404, 405, body too large) answer in JSON like ours.
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return _error(
            e.status, e.reason if e.status != 413 else f"request body too large: {e.text}"
        )
    except ConnectionError as e:
        # The client hung up (mid-body, or killed while waiting): its business, not a server
        # fault. One line; the response below goes nowhere.
        logger.info(
            "client %s disconnected during %s %s: %s",
            request.remote,
            request.method,
            request.path,
            e,
        )
        return _error(400, "client disconnected")
    except Exception as e:
        logger.exception("unhandled error in %s %s", request.method, request.path)
        return _error(500, f"internal error: {type(e).__name__}: {e}")


def _auth(api_key: str) -> Any:
    """Middleware: every route but /health needs `Authorization: Bearer <api_key>` (as vLLM's)."""
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check_api_key(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path != "/health":
            given = request.headers.get("Authorization", "").encode()
            # Constant time: the comparison does not tell how much of a guess was right.
            if not hmac.compare_digest(given, expected):
                response = _error(
                    401,
                    "missing or wrong API key: send the header 'Authorization: Bearer <key>' "
                    "with the server's --api-key (YATT_GENRM_API_KEY)",
                    "Authorization",
                )
                response.headers["WWW-Authenticate"] = "Bearer"
                return response
        return await handler(request)

    return check_api_key


def create_app(
    scorer: StreamingScorer,
    *,
    max_batch: int = 256,
    max_body_bytes: int = 64 << 20,
    body_timeout_s: float = 60.0,
    api_key: str | None = None,
) -> web.Application:
    """An aiohttp app serving `scorer` (a GenRM or CombinedRM); run it with web.AppRunner or
    `web.run_app`. Tests start it in-process on an ephemeral port.

    `max_body_bytes` caps a request body (413), `body_timeout_s` bounds the time to receive it
    (408: a client trickling bytes cannot hold a handler), and with `api_key` every route but
    /health answers 401 unless the request carries `Authorization: Bearer <api_key>`."""
    if not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch={max_batch!r}: must be an int >= 1")
    if not isinstance(max_body_bytes, int) or max_body_bytes < 1:
        raise ValueError(f"max_body_bytes={max_body_bytes!r}: must be an int >= 1")
    if not body_timeout_s > 0:
        raise ValueError(f"body_timeout_s={body_timeout_s!r}: must be > 0")
    if api_key is not None and (not isinstance(api_key, str) or not api_key.strip()):
        raise ValueError("api_key is empty: pass a non-empty key, or None to serve without one")

    async def score(request: web.Request) -> web.Response:
        if request.content_length is not None and request.content_length > max_body_bytes:
            # Refused before reading a byte of it.
            return _error(
                413,
                f"request body too large: {request.content_length} bytes > max_body_bytes="
                f"{max_body_bytes}; send fewer samples per request or raise --max-body-mib",
            )
        try:
            async with asyncio.timeout(body_timeout_s):
                raw = await request.read()
        except TimeoutError:
            logger.info(
                "client %s sent its body too slowly: not received within %.3g s",
                request.remote,
                body_timeout_s,
            )
            response = _error(
                408,
                f"request body not received within body_timeout_s={body_timeout_s:g} s; "
                "send it faster or raise the server's --body-timeout-s",
            )
            response.force_close()  # the rest of a trickled body is not worth waiting for
            return response
        try:
            # json.loads of a big body takes a while: off the event loop.
            body = await asyncio.to_thread(load_json_body, raw)
            samples = parse_samples(body, max_batch=max_batch)
        except RequestError as e:
            return _error(e.status, str(e), e.field)
        except ValueError as e:  # Sample's own validation
            return _error(422, str(e))
        verdicts = await request.app[SCORER_KEY].ascore(samples)
        return web.json_response({"verdicts": [v.to_dict() for v in verdicts]})

    async def health(request: web.Request) -> web.Response:
        scorer = request.app[SCORER_KEY]
        return web.json_response(
            {
                "status": "ok",
                "version": __version__,
                "max_batch": max_batch,
                "metrics": scorer.metrics,
            }
        )

    async def close_scorer(app: web.Application) -> None:
        await app[SCORER_KEY].aclose()

    middlewares = [_json_errors] if api_key is None else [_json_errors, _auth(api_key)]
    app = web.Application(middlewares=middlewares, client_max_size=max_body_bytes)
    app[SCORER_KEY] = scorer
    app.router.add_post("/score", score)
    app.router.add_get("/health", health)
    app.on_cleanup.append(close_scorer)
    return app
