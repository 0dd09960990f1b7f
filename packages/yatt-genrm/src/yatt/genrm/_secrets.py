"""Credentials kept out of every message genrm writes: logs, error verdicts, exceptions.

    scrub = Scrubber([api_key, *url_credentials(base_url)])
    scrub(f"HTTP 401: {server_body}")      # the key, "Bearer ...", user:pass@ -> "***"
    redact_url("https://me:pw@host/v1")    # "https://***@host/v1"

A server (or a proxy in front of it) may echo the request's Authorization header in its error
body, and a base_url may carry "user:password@"; both would otherwise reach the log and the
verdict's `error` verbatim. Scrubbing replaces the known secrets wherever they appear, in their
URL-quoted forms too, and any "Bearer <token>" / "Basic <token>" and URL userinfo, known or not.
"""

from __future__ import annotations

import base64
import re
import urllib.parse
from collections.abc import Iterable

REDACTED = "***"
# Shorter "secrets" would blank ordinary words out of messages ("a:b@" userinfo aside).
_MIN_SECRET_CHARS = 4
_URL_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@]+@")
# A token after "Bearer" / "Basic": 8+ characters with a digit or punctuation, so that prose
# ("the bearer of", "Basic arithmetic") is left alone; our own key is replaced by value anyway.
_AUTH_TOKEN = re.compile(
    r"\b((?i:bearer)|Basic)(\s+)(?=[A-Za-z0-9._~+/=-]*[0-9._~+/=-])[A-Za-z0-9._~+/=-]{8,}"
)


def redact_url(url: str) -> str:
    """`url` with any "user:password@" replaced by "***@"."""
    return _URL_USERINFO.sub(rf"\1{REDACTED}@", url)


def url_credentials(url: str) -> list[str]:
    """The secrets in `url`'s userinfo: "user:password", the password, both unquoted too."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return []
    found: list[str] = []
    if "@" in parts.netloc:
        userinfo = parts.netloc.rsplit("@", 1)[0]
        found.append(userinfo)
        if ":" in userinfo:
            found.append(userinfo.split(":", 1)[1])
    return found


class Scrubber:
    """A callable that returns its text with every secret it was given, and any bearer or
    basic token and URL userinfo, replaced by "***"."""

    def __init__(self, secrets: Iterable[str | None]) -> None:
        forms: set[str] = set()
        for secret in secrets:
            if not secret or len(secret) < _MIN_SECRET_CHARS:
                continue
            plain = urllib.parse.unquote(secret)
            # Base64 too: "user:password" travels as "Authorization: Basic <base64>".
            encoded = base64.b64encode(plain.encode("utf-8", "replace")).decode()
            forms.update({secret, urllib.parse.quote(secret, safe=""), plain, encoded})
        # Longest first: a key that contains another is replaced whole.
        self._secrets = sorted((f for f in forms if len(f) >= _MIN_SECRET_CHARS), key=len)[::-1]

    def __call__(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, REDACTED)
        text = _AUTH_TOKEN.sub(rf"\1\2{REDACTED}", text)
        return _URL_USERINFO.sub(rf"\1{REDACTED}@", text)

    def __repr__(self) -> str:
        return f"Scrubber({len(self._secrets)} secret forms)"
