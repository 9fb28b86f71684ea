"""A per-token limit on requests in flight (issue 27; docs/service.md, "Connection floods").

One token (or, without one, one client address) may have at most `limit` requests in progress in
a worker, from the request's head to the end of its answer; one more is answered 429 with
`Retry-After: 1` and the error family's JSON (kind StoreUnavailable: a client retries it), before
any other work. So a tenant holding slow uploads or slow reads stalls only itself, and every other
token keeps its share of the worker. `/healthz` and `/metrics` are never limited.

The counts are the worker's memory (a dict of counters, removed at zero); the key is a digest of
the credential as sent, so no token is looked up or kept in the clear."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from http.cookies import SimpleCookie
from typing import Any

from layerstore.errors import StoreUnavailable

MAX_INFLIGHT_ENV = "LAYERSTORE_SERVE_MAX_INFLIGHT"
DEFAULT_MAX_INFLIGHT = 64
EXEMPT = frozenset({"/healthz", "/metrics"})

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Any, Any], Awaitable[None]]


def credential_key(scope: Scope, cookie: str) -> str:
    """Whose request this is: a digest of its bearer credential (the Authorization header, else the
    token cookie), else its client address."""
    auth = cookie_value = None
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            auth = value
            break
        if name == b"cookie" and cookie_value is None:
            jar: SimpleCookie = SimpleCookie()
            try:
                jar.load(value.decode("latin-1"))
            except Exception:  # a malformed cookie header: no credential in it
                continue
            if cookie in jar:
                cookie_value = jar[cookie].value.encode()
    cred = auth if auth is not None else cookie_value
    if cred is not None:
        return "t:" + hashlib.blake2b(cred, digest_size=12).hexdigest()
    client = scope.get("client") or ("local", 0)
    return f"a:{client[0]}"


@dataclass
class InflightLimit:
    """ASGI middleware: at most `limit` requests in flight per credential (0: no limit)."""

    app: ASGIApp
    limit: int = DEFAULT_MAX_INFLIGHT
    cookie: str = "layerstore_token"
    counts: dict[str, int] = field(default_factory=dict)

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or self.limit <= 0 or scope.get("path") in EXEMPT:
            await self.app(scope, receive, send)
            return
        key = credential_key(scope, self.cookie)
        n = self.counts.get(key, 0)
        if n >= self.limit:
            await too_many(send, self.limit)
            return
        self.counts[key] = n + 1
        try:
            await self.app(scope, receive, send)
        finally:
            left = self.counts[key] - 1
            if left:
                self.counts[key] = left
            else:
                del self.counts[key]


async def too_many(send: Any, limit: int) -> None:
    err = StoreUnavailable(f"this token already has {limit} requests in progress (per worker); retry later")
    body = json.dumps(err.to_wire()).encode()
    await send({"type": "http.response.start", "status": 429, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"retry-after", b"1")]})
    await send({"type": "http.response.body", "body": body})
