"""Reading an HTTP response body with a size cap: a server that never stops sending (a proxy
looping, an endpoint streaming where one JSON answer was expected) costs at most `max_bytes` of
memory, not all of it. `response.text()` and `.json()` buffer without a limit.
"""

from __future__ import annotations

import aiohttp

_CHUNK_BYTES = 1 << 16


class ResponseTooLargeError(Exception):
    """The body was longer than allowed; reading stopped at the cap."""


def describe_bytes(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:g} MiB" if num_bytes >= 2**20 else f"{num_bytes} bytes"


async def read_body(response: aiohttp.ClientResponse, *, max_bytes: int, what: str) -> bytes:
    """The body, or ResponseTooLargeError (naming `what`: the setting that caps it) once more
    than `max_bytes` arrived or were announced by Content-Length."""
    cap = f"{what}={max_bytes} ({describe_bytes(max_bytes)})"
    if response.content_length is not None and response.content_length > max_bytes:
        raise ResponseTooLargeError(
            f"the response announces {response.content_length} bytes, over {cap}"
        )
    body = bytearray()
    async for chunk in response.content.iter_chunked(_CHUNK_BYTES):
        body += chunk
        if len(body) > max_bytes:
            raise ResponseTooLargeError(
                f"the response body went over {cap} and reading stopped; the server sent more "
                "than one answer holds (an endless stream?)"
            )
    return bytes(body)


def decode_body(response: aiohttp.ClientResponse, body: bytes) -> str:
    """`body` as text, in the response's charset (JSON's UTF-8 when none is given)."""
    try:
        return body.decode(response.charset or "utf-8", errors="replace")
    except LookupError:  # a charset Python does not know
        return body.decode("utf-8", errors="replace")
