"""The daemon's control socket: HTTP/1.1 over a Unix socket in the cache directory.

    GET  /stats          the JSON of `layerctl stats`
    GET  /metrics        Prometheus text format (counters, gauges, fetch latency histograms)
    GET  /cache          the JSON of `layerctl cache ls`
    POST /cache/verify   re-hash committed chunks, drop bad ones
    POST /cache/evict    {"blob": D} | {"all": true} | {"to_bytes": N} | {} (down to the low watermark)
    POST /prefetch       {"blob": D, "chunks": [i...] | "ranges": [[off, len]...] | "all": true, "wait": bool}
    POST /pin            {"blob": D, "holder": H} -> {"blob", "complete": true, "path"} | 409 BlobIncomplete
    POST /unpin          {"blob": D, "holder": H} -> {"blob", "holder", "removed": bool} (idempotent)

HTTP keeps the socket scrapeable (a Prometheus sidecar or `curl --unix-socket`). One request per
connection. The server runs on the daemon's trio thread; the client is blocking, for the CLI and
the runtime shim (`pin`, `unpin`: through the daemon, or offline when none runs).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from layerstore import digest as digestmod
from layerstore.errors import BadInput, ConfigError, LayerstoreError, NotFound, StoreUnavailable

from .cache import BlobIncomplete, BlobPinned, NodeCache, check_holder
from .cache_files import CacheIOError
from .fetcher import Fetcher
from .stats import Stats

log = logging.getLogger("layerstore.fuse.control")

SOCKET_NAME = "control.sock"
MAX_HEADER = 64 * 1024
MAX_BODY = 16 << 20
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 409: "Conflict",
            500: "Internal Server Error", 502: "Bad Gateway", 503: "Service Unavailable"}


class DaemonNotRunning(LayerstoreError):
    """No daemon answers on the cache directory's control socket."""

    exit_code = 7


def socket_path(cache_dir: Path) -> Path:
    return Path(cache_dir) / SOCKET_NAME


# -- server -----------------------------------------------------------------------------------
Handler = Callable[[dict[str, Any]], Awaitable[tuple[str, bytes]]]


class ControlAPI:
    """The routes, over the daemon's components (passed in)."""

    def __init__(self, cache: NodeCache, fetcher: Fetcher, stats: Stats, *, nursery: trio.Nursery) -> None:
        self.cache = cache
        self.fetcher = fetcher
        self.stats = stats
        self._nursery = nursery
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
        return _json(self.stats.to_json())

    async def get_metrics(self, req: dict[str, Any]) -> tuple[str, bytes]:
        return "text/plain; version=0.0.4; charset=utf-8", self.stats.prometheus()

    async def get_cache(self, req: dict[str, Any]) -> tuple[str, bytes]:
        return _json(self.cache.ls())

    async def post_verify(self, req: dict[str, Any]) -> tuple[str, bytes]:
        return _json(await self.cache.verify())

    async def post_evict(self, req: dict[str, Any]) -> tuple[str, bytes]:
        return _json(await evict(self.cache, req))

    async def post_prefetch(self, req: dict[str, Any]) -> tuple[str, bytes]:
        blob = digestmod.parse(str(req.get("blob")))
        entry = await self.fetcher.entry(blob)
        idxs = prefetch_order(entry.cmap, entry.metadata, req)
        if req.get("wait"):
            done, failed = await self.fetcher.prefetch(entry, idxs)
            return _json({"blob": blob, "queued": len(idxs), "done": done, "failed": failed})
        self._nursery.start_soon(self.fetcher.prefetch, entry, idxs)
        return _json({"blob": blob, "queued": len(idxs)})

    async def post_pin(self, req: dict[str, Any]) -> tuple[str, bytes]:
        blob, holder = _pin_args(req)
        if self.cache.get(blob) is None:
            await self.fetcher.entry(blob)  # NotFound if the store lacks it; else its size tells what is missing
        return _json(await pin_blob(self.cache, blob, holder))

    async def post_unpin(self, req: dict[str, Any]) -> tuple[str, bytes]:
        return _json(await unpin_blob(self.cache, *_pin_args(req)))


def _pin_args(req: dict[str, Any]) -> tuple[str, str]:
    return digestmod.parse(str(req.get("blob"))), check_holder(req.get("holder"))


async def pin_blob(cache: NodeCache, blob: str, holder: str) -> dict[str, Any]:
    """Shared by the control route and the offline client."""
    path = await cache.pin_blob(blob, holder)
    return {"blob": blob, "holder": holder, "complete": True, "path": os.fspath(path)}


async def unpin_blob(cache: NodeCache, blob: str, holder: str) -> dict[str, Any]:
    removed = await cache.unpin_blob(blob, holder)
    return {"blob": blob, "holder": holder, "removed": removed, "holders": sorted(cache.pins.get(blob, ()))}


async def evict(cache: NodeCache, req: dict[str, Any]) -> dict[str, Any]:
    """Shared by the control route and the offline CLI."""
    if req.get("blob"):
        n, b = await cache.drop_blob(digestmod.parse(str(req["blob"])))
    elif req.get("all"):
        n, b = await cache.evict_to(0)
    elif req.get("to_bytes") is not None:
        n, b = await cache.evict_to(int(req["to_bytes"]))
    elif cache.budget is not None:
        n, b = await cache.evict_to(cache.budget.low)
    else:
        raise ConfigError("no cache budget set: say which blob, --all or --to BYTES")
    return {"evicted_chunks": n, "evicted_bytes": b, "used_bytes": cache.usage, "pinned_bytes": cache.pinned_bytes()}


def prefetch_order(cmap: Any, metadata: list[int], req: dict[str, Any]) -> list[int]:
    """Chunk indexes to prefetch, in order, without repeats: metadata first for `all`."""
    n = len(cmap.chunks)
    if req.get("all"):
        meta = set(metadata)
        return list(metadata) + [i for i in range(n) if i not in meta]
    out: list[int] = []
    seen: set[int] = set()
    if req.get("chunks") is not None:
        cand: list[int] = []
        for i in req["chunks"]:
            if not isinstance(i, int) or not 0 <= i < n:
                raise BadInput(f"chunk index {i!r} out of range for {cmap.blob} ({n} chunks)")
            cand.append(i)
    elif req.get("ranges") is not None:
        cand = []
        for r in req["ranges"]:
            if not (isinstance(r, list | tuple) and len(r) == 2 and all(isinstance(x, int) and x >= 0 for x in r)):
                raise BadInput(f"bad range {r!r} (want [offset, length])")
            cand.extend(cmap.span(r[0], r[1]))
    else:
        cand = list(metadata)
    for i in cand:
        if i not in seen:
            seen.add(i)
            out.append(i)
    return out


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
            return 400, *_json({"error": f"bad request: {e}", "kind": "BadInput"})
        except LayerstoreError as e:
            details = e.details() if isinstance(e, BlobIncomplete) else {}
            return e.http_status, *_json({"error": str(e), "kind": type(e).__name__, **details})
        except Exception as e:
            log.exception("control: %s %s failed", method, path)
            return 500, *_json({"error": f"{type(e).__name__}: {e}", "kind": "LayerstoreError"})


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


# -- client (blocking, for the CLI) --------------------------------------------------------------
_ERRORS: dict[str, type[LayerstoreError]] = {
    "NotFound": NotFound, "ConfigError": ConfigError, "BadInput": BadInput, "BadDigest": ConfigError,
    "StoreUnavailable": StoreUnavailable, "BlobPinned": BlobPinned, "CacheIOError": CacheIOError,
}


def request(cache_dir: Path, method: str, path: str, body: dict[str, Any] | None = None,
            timeout: float | None = 60.0) -> tuple[str, bytes]:
    """One request to the daemon of `cache_dir`; returns (content type, body). Errors come back
    as the project's exceptions; no daemon is `DaemonNotRunning`."""
    sp = socket_path(cache_dir)
    data = json.dumps(body).encode() if body is not None else b""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        try:
            s.connect(os.fspath(sp))
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.ECONNREFUSED, errno.ENOTSOCK):
                raise DaemonNotRunning(f"no daemon is serving cache {cache_dir} (no answer on {sp})") from None
            raise
        s.sendall((f"{method} {path} HTTP/1.1\r\nHost: layerstore\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode() + data)
        parts = []
        while True:
            chunk = s.recv(1 << 20)
            if not chunk:
                break
            parts.append(chunk)
    except TimeoutError:
        raise StoreUnavailable(f"the daemon of cache {cache_dir} did not answer within {timeout:g} s") from None
    finally:
        s.close()
    raw = b"".join(parts)
    head, _, payload = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    try:
        status = int(lines[0].split(" ", 2)[1])
    except (IndexError, ValueError):
        raise LayerstoreError(f"the daemon of cache {cache_dir} sent a malformed answer") from None
    ctype = ""
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-type":
            ctype = value.strip()
    if status != 200:
        try:
            err = json.loads(payload)
            msg, kind = err.get("error", payload.decode()), err.get("kind", "")
        except ValueError:
            msg, kind = payload.decode(errors="replace"), ""
        if kind == "BlobIncomplete":
            raise BlobIncomplete(msg, err.get("missing_bytes"))
        raise _ERRORS.get(kind, LayerstoreError)(msg)
    return ctype, payload


def request_json(cache_dir: Path, method: str, path: str, body: dict[str, Any] | None = None,
                 timeout: float | None = 60.0) -> Any:
    return json.loads(request(cache_dir, method, path, body, timeout)[1])


# -- pins: the runtime shim's direct mounts of complete blobs (docs/fuse-client.md) ---------------
def pin(cache_dir: Path, blob: str, holder: str, *, timeout: float | None = 60.0) -> Path | None:
    """Pin a blob for `holder` and return the absolute path of its cache data file, which is
    then a complete EROFS image that the daemon never modifies until `unpin`; None (and no pin)
    when some chunk of the blob is not in the node cache. Goes through the daemon of
    `cache_dir`, or, when none runs, opens the cache itself (`maintenance.pin_offline`)."""
    try:
        res = request_json(cache_dir, "POST", "/pin", {"blob": blob, "holder": holder}, timeout)
    except BlobIncomplete:
        return None
    except DaemonNotRunning:
        from .maintenance import pin_offline

        return pin_offline(cache_dir, blob, holder)
    return Path(res["path"])


def unpin(cache_dir: Path, blob: str, holder: str, *, timeout: float | None = 60.0) -> bool:
    """Drop `holder`'s pin of a blob (durably); False if there was none. Through the daemon, or
    offline when none runs (e.g. after the daemon died)."""
    try:
        return bool(request_json(cache_dir, "POST", "/unpin", {"blob": blob, "holder": holder}, timeout)["removed"])
    except DaemonNotRunning:
        from .maintenance import unpin_offline

        return unpin_offline(cache_dir, blob, holder)
