"""The HTTP face of a GenRM, for layouts where the judge runs in other processes.

    POST /score  {"samples": [{"prompt", "response", "reference"?, "id"?, "metadata"?}, ...]}
              -> 200 {"verdicts": [Verdict.to_dict(), ...]}   (same order)
              -> 400 malformed JSON, 422 a field of the wrong type (the error names it),
                 413 more than max_batch samples (or a body over max_body_bytes)
    GET  /health -> 200 {"status": "ok", "metrics": {...}}

Concurrent requests share the scorer's batcher, so many small clients still fill judge batches.
A bad request gets its 4xx JSON answer and the server goes on serving.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from aiohttp import web

from yatt.genrm._stream import StreamingScorer
from yatt.genrm._types import Sample
from yatt.genrm._version import __version__

logger = logging.getLogger("yatt.genrm")

SCORER_KEY = web.AppKey("scorer", StreamingScorer)
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
    except Exception as e:
        logger.exception("unhandled error in %s %s", request.method, request.path)
        return _error(500, f"internal error: {type(e).__name__}: {e}")


def create_app(
    scorer: StreamingScorer, *, max_batch: int = 256, max_body_bytes: int = 64 << 20
) -> web.Application:
    """An aiohttp app serving `scorer` (a GenRM or CombinedRM); run it with web.AppRunner or
    `web.run_app`. Tests start it in-process on an ephemeral port."""
    if not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch={max_batch!r}: must be an int >= 1")

    async def score(request: web.Request) -> web.Response:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return _error(400, f"body is not valid JSON: {e}")
        try:
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

    app = web.Application(middlewares=[_json_errors], client_max_size=max_body_bytes)
    app[SCORER_KEY] = scorer
    app.router.add_post("/score", score)
    app.router.add_get("/health", health)
    app.on_cleanup.append(close_scorer)
    return app
