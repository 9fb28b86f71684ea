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

Who may talk to it: root, or a member of the node's control group (`--control-group`, none by
default). The socket file is created with its final mode (0600, or 0660 and the group's
ownership), never briefly wider: it is bound inside a fresh 0700 directory, given its mode and
group there, and renamed into place. Every connection's peer is checked again with SO_PEERCRED
and SO_PEERGROUPS (the credentials the kernel recorded at connect): any other peer is closed
without an answer, and logged once per uid.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from fuse_client import linux
from fuse_client.nodecache import LazyCache, check_holder
from layerstore import digest as digestmod
from layerstore.errors import BadInput, ConfigError, LayerstoreError

log = logging.getLogger("layerstore.fuse.control")

MAX_REFUSED_LOGGED = 1024  # peers (uids) remembered so that each refusal is logged once
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
    def __init__(self, path: Path, api: ControlAPI, *, group: int | None = None) -> None:
        """`group`: the gid whose members may use the socket besides root (None: root only)."""
        self.path = Path(path)
        self.api = api
        self.group = group
        self.mode = 0o600 if group is None else 0o660
        self.refused = 0
        self._refused_uids: set[int] = set()

    def allowed(self, uid: int, gid: int, groups: tuple[int, ...]) -> bool:
        return uid == 0 or (self.group is not None and (gid == self.group or self.group in groups))

    def _bind(self) -> socket.socket:
        """The listening socket at `path`, with its final mode and group from the start."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        private = tempfile.mkdtemp(prefix=".control-", dir=self.path.parent)  # 0700, ours alone
        try:
            tmp = os.path.join(private, "sock")
            sock.bind(tmp)
            if self.group is not None:
                os.chown(tmp, 0, self.group)
            os.chmod(tmp, self.mode)
            os.rename(tmp, self.path)  # atomic: replaces a stale socket too
        except BaseException:
            sock.close()
            raise
        finally:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(private, "sock"))
            os.rmdir(private)
        return sock

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        if len(os.fsencode(self.path)) >= 108:
            raise ConfigError(f"control socket path too long for a Unix socket: {self.path}")
        sock = trio.socket.from_stdlib_socket(self._bind())
        sock.listen(64)
        listener = trio.SocketListener(sock)
        try:
            async with trio.open_nursery() as nursery:
                task_status.started()
                await trio.serve_listeners(self._handle, [listener], handler_nursery=nursery)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def _peer_ok(self, stream: trio.SocketStream) -> bool:
        try:
            pid, uid, gid, groups = linux.peer_credentials(stream.socket.fileno())
        except OSError as e:
            log.warning("control: cannot read a peer's credentials (%s): refused", e)
            return False
        if self.allowed(uid, gid, groups):
            return True
        self.refused += 1
        if uid not in self._refused_uids and len(self._refused_uids) < MAX_REFUSED_LOGGED:
            self._refused_uids.add(uid)
            log.warning("control: refused a connection from uid %d gid %d (pid %d): only root%s may use %s", uid,
                        gid, pid, "" if self.group is None else f" and members of gid {self.group}", self.path)
        return False

    async def _handle(self, stream: trio.SocketStream) -> None:
        if not self._peer_ok(stream):
            await stream.aclose()
            return
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
