"""The daemon's control socket, the server side: HTTP/1.1 over a Unix socket in the cache
directory, served on the daemon's trio thread, one request per connection. The routes call the
node cache's API (`fuse_client.nodecache.LazyCache`) and nothing else.

    GET  /stats          the JSON of `layerctl stats`
    GET  /metrics        Prometheus text format (counters, gauges, fetch latency histograms)
    GET  /cache          the JSON of `layerctl cache ls`
    POST /cache/verify   re-hash committed chunks, drop bad ones
    POST /cache/evict    {"blob": D} | {"all": true} | {"to_bytes": N} | {} (down to the low watermark)
    POST /prefetch       {"blob": D, "chunks": [i...] | "ranges": [[off, len]...] | "all": true, "wait": bool}
    POST /pin            {"blob": D, "holder": H} -> {"blob", "complete": true, "path"} | 409 BlobIncomplete
    POST /unpin          {"blob": D, "holder": H} -> {"blob", "holder", "removed": bool} (idempotent)

HTTP keeps the socket scrapeable (a Prometheus sidecar or `curl --unix-socket`). An error answers
with the status of its class and `LayerstoreError.to_wire()`; the blocking client
(`control.client`) raises the same class again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from fuse_client.nodecache import LazyCache, check_holder
from layerstore import digest as digestmod
from layerstore.errors import BadInput, ConfigError, LayerstoreError

log = logging.getLogger("layerstore.fuse.control")

MAX_HEADER = 64 * 1024
MAX_BODY = 16 << 20
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 409: "Conflict",
            500: "Internal Server Error", 502: "Bad Gateway", 503: "Service Unavailable"}

Handler = Callable[[dict[str, Any]], Awaitable[tuple[str, bytes]]]


class ControlAPI:
    """The routes, over the node cache's API."""

    def __init__(self, lazy: LazyCache) -> None:
        self.lazy = lazy
        self.cache = lazy.cache
        self.routes: dict[tuple[str, str], Handler] = {
            ("GET", "/stats"): self.get_stats,
            ("GET", "/metrics"): self.get_metrics,
            ("GET", "/cache"): self.get_cache,
            ("POST", "/cache/verify"): self.post_verify,
            ("POST", "/cache/evict"): self.post_evict,
            ("POST", "/prefetch"): self.post_prefetch,
            ("POST", "/pin"): self.post_pin,
            ("POST", "/unpin"): self.post_unpin,
        }

    async def get_stats(self, req: dict[str, Any]) -> tuple[str, bytes]:
        return _json(self.lazy.stats.to_json())

    async def get_metrics(self, req: dict[str, Any]) -> tuple[str, bytes]:
        return "text/plain; version=0.0.4; charset=utf-8", self.lazy.stats.prometheus()

    async def get_cache(self, req: dict[str, Any]) -> tuple[str, bytes]:
        return _json(self.cache.ls())

    async def post_verify(self, req: dict[str, Any]) -> tuple[str, bytes]:
        return _json(await self.cache.verify())

    async def post_evict(self, req: dict[str, Any]) -> tuple[str, bytes]:
        to_bytes = req.get("to_bytes")
        return _json(await self.cache.evict(blob=str(req["blob"]) if req.get("blob") else None,
                                            all_chunks=bool(req.get("all")),
                                            to_bytes=int(to_bytes) if to_bytes is not None else None))

    async def post_prefetch(self, req: dict[str, Any]) -> tuple[str, bytes]:
        blob = digestmod.parse(str(req.get("blob")))
        return _json(await self.lazy.prefetch(blob, chunks=req.get("chunks"), ranges=req.get("ranges"),
                                              all_chunks=bool(req.get("all")), wait=bool(req.get("wait"))))

    async def post_pin(self, req: dict[str, Any]) -> tuple[str, bytes]:
        blob, holder = _pin_args(req)
        path = await self.lazy.pin_blob(blob, holder)
        return _json({"blob": blob, "holder": holder, "complete": True, "path": os.fspath(path)})

    async def post_unpin(self, req: dict[str, Any]) -> tuple[str, bytes]:
        blob, holder = _pin_args(req)
        removed = await self.cache.unpin_blob(blob, holder)
        return _json({"blob": blob, "holder": holder, "removed": removed, "holders": self.cache.holders(blob)})


def _pin_args(req: dict[str, Any]) -> tuple[str, str]:
    return digestmod.parse(str(req.get("blob"))), check_holder(req.get("holder"))


def _json(obj: object) -> tuple[str, bytes]:
    return "application/json", json.dumps(obj, sort_keys=True).encode()


class ControlServer:
    def __init__(self, path: Path, api: ControlAPI) -> None:
        self.path = Path(path)
        self.api = api

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        if len(os.fsencode(self.path)) >= 108:
            raise ConfigError(f"control socket path too long for a Unix socket: {self.path}")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        await sock.bind(os.fspath(self.path))
        os.chmod(self.path, 0o600)
        sock.listen(64)
        listener = trio.SocketListener(sock)
        try:
            async with trio.open_nursery() as nursery:
                task_status.started()
                await trio.serve_listeners(self._handle, [listener], handler_nursery=nursery)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    async def _handle(self, stream: trio.SocketStream) -> None:
        try:
            async with stream:
                method, path, body = await _read_request(stream)
                status, ctype, payload = await self._dispatch(method, path, body)
                head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nContent-Type: {ctype}\r\n"
                        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n").encode()
                await stream.send_all(head + payload)
        except (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError):
            pass
        except _BadRequest as e:
            log.debug("control: bad request: %s", e)

    async def _dispatch(self, method: str, path: str, body: bytes) -> tuple[int, str, bytes]:
        route = self.api.routes.get((method, path.split("?", 1)[0]))
        if route is None:
            known = any(p == path for _, p in self.api.routes)
            return (405 if known else 404), *_json({"error": f"no route {method} {path}"})
        try:
            req = json.loads(body) if body else {}
            if not isinstance(req, dict):
                raise BadInput("request body must be a JSON object")
            ctype, payload = await route(req)
            return 200, ctype, payload
        except ValueError as e:
            return 400, *_json(BadInput(f"bad request: {e}").to_wire())
        except LayerstoreError as e:
            return e.http_status, *_json(e.to_wire())
        except Exception as e:
            log.exception("control: %s %s failed", method, path)
            return 500, *_json(LayerstoreError(f"{type(e).__name__}: {e}").to_wire())


class _BadRequest(Exception):
    pass


async def _read_request(stream: trio.SocketStream) -> tuple[str, str, bytes]:
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = await stream.receive_some(65536)
        if not chunk:
            raise _BadRequest("connection closed mid-header")
        buf += chunk
        if len(buf) > MAX_HEADER:
            raise _BadRequest("header too large")
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    try:
        method, path, _version = lines[0].split(" ", 2)
    except ValueError:
        raise _BadRequest(f"bad request line {lines[0]!r}") from None
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            try:
                length = int(value.strip())
            except ValueError:
                raise _BadRequest("bad content-length") from None
    if not 0 <= length <= MAX_BODY:
        raise _BadRequest("body too large")
    body = rest
    while len(body) < length:
        chunk = await stream.receive_some(65536)
        if not chunk:
            raise _BadRequest("connection closed mid-body")
        body += chunk
    return method, path, body[:length]
