"""What several routers do: backend calls in worker threads, the read check of one key, and the
bounded read of a request's body."""

from __future__ import annotations

from typing import Any

import anyio
from fastapi import Request

from layerstore.backends import http_wire as wire
from layerstore.errors import BadInput, BadKey, CorruptObject, NotFound, PermissionDenied, StoreUnavailable

from ..auth import Principal
from ..checks import body_limit, head_size
from ..deps import Service


async def run(fn: Any, *args: Any) -> Any:
    """A blocking (backend) call, in a worker thread."""
    return await anyio.to_thread.run_sync(fn, *args)


def readable(who: Principal, key: str) -> None:
    if who.may_read(key):
        return
    if key.startswith("tags/") and who.can_read:
        raise NotFound(f"object {key}: not found")  # a private name is not revealed
    raise PermissionDenied(f"token {who.id} may not read {key}")


async def on_object(svc: Service, key: str, fn: Any, *args: Any, writing: bool = False) -> Any:
    """A backend call on one object. A key that names a prefix of other keys (a directory
    on POSIX) is no object: NotFound to read or delete it, BadKey to write it, not the
    backend's CorruptObject (502) or failure (503)."""
    try:
        return await run(fn, *args)
    except (CorruptObject, StoreUnavailable, PermissionDenied) as e:
        if not await run(is_prefix, svc, key):
            raise
        if writing:
            raise BadKey(f"{key}: a prefix of other keys, not an object") from None
        raise NotFound(f"object {key}: not found (a prefix of other keys)") from e


def is_prefix(svc: Service, key: str) -> bool:
    return next(iter(svc.backend.list(key + "/")), None) is not None


async def read_body(svc: Service, request: Request, limit: int, key: str = "") -> bytes:
    """The request's whole body: at most `limit` bytes (less for a chunk map whose header says
    so), within the service's body timeout."""
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit() or len(length) > 19:
            raise BadInput(f"bad Content-Length {length[:40]!r}")
        if int(length) > limit:
            raise wire.TooLarge(f"body of {length} bytes, more than {limit} for this key")
    buf = bytearray()
    head = head_size(key) if key else 0  # a chunk map: its header bounds the rest (before it is read)
    try:
        with anyio.fail_after(svc.body_timeout):
            async for part in request.stream():
                buf += part
                if head and len(buf) >= head:
                    limit, head = min(limit, body_limit(key, buf[:head])), 0
                if len(buf) > limit:
                    raise wire.TooLarge(f"body of more than {limit} bytes for this key")
    except TimeoutError:
        raise wire.SlowRequest(f"request body not received within {svc.body_timeout:g} s") from None
    return bytes(buf)
