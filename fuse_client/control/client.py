"""The blocking client of the daemon's control socket, for the CLI and the runtime shim: the
standard library's `http.client` over a Unix socket. It imports no trio (the shim and the CLI
start fast and never run an event loop for it); httpx is not used here because its transport
(httpcore) imports trio whenever trio is installed, which costs a CLI call ~0.1-0.3 s.

An error answer carries the class of the error (`LayerstoreError.to_wire`): the client raises the
same class again (`layerstore.errors.from_wire`), so `layerctl` exits with the code of the error
the daemon met (e.g. 4 for `CorruptObject`). No daemon on the socket is `DaemonNotRunning`.
"""

from __future__ import annotations

import errno
import http.client
import json
import os
import socket
from pathlib import Path
from typing import Any

# Registers the node cache's error classes (BlobIncomplete, BlobPinned, ...) for `from_wire`.
from fuse_client.nodecache.errors import BlobIncomplete
from layerstore.errors import LayerstoreError, NodeUnavailable, PermissionDenied, StoreUnavailable, from_wire

from .errors import DataPathUnavailable

SOCKET_NAME = "control.sock"


class DaemonNotRunning(NodeUnavailable):
    """No daemon answers on the cache directory's control socket."""


def socket_path(cache_dir: Path) -> Path:
    return Path(cache_dir) / SOCKET_NAME


class _UnixHTTPConnection(http.client.HTTPConnection):
    """The standard library's HTTP/1.1 client over a Unix socket (it parses the answer)."""

    def __init__(self, path: str, timeout: float | None) -> None:
        super().__init__("layerstore", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            s.settimeout(self.timeout)
            s.connect(self.unix_path)
        except BaseException:
            s.close()
            raise
        self.sock = s


def request(cache_dir: Path, method: str, path: str, body: dict[str, Any] | None = None,
            timeout: float | None = 60.0) -> tuple[str, bytes]:
    """One request to the daemon of `cache_dir`; returns (content type, body). Errors come back
    as the project's exceptions; no daemon is `DaemonNotRunning`."""
    sp = socket_path(cache_dir)
    data = json.dumps(body).encode() if body is not None else b""
    conn = _UnixHTTPConnection(os.fspath(sp), timeout)
    try:
        try:
            conn.connect()
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.ECONNREFUSED, errno.ENOTSOCK):
                raise DaemonNotRunning(f"no daemon is serving cache {cache_dir} (no answer on {sp})") from None
            if e.errno in (errno.EACCES, errno.EPERM):
                raise PermissionDenied(f"not allowed to use {sp}: root or the daemon's --control-group only") from None
            raise
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", "Connection": "close"})
        answer = conn.getresponse()
        status, ctype, payload = answer.status, answer.getheader("Content-Type") or "", answer.read()
    except TimeoutError:
        raise StoreUnavailable(f"the daemon of cache {cache_dir} did not answer within {timeout:g} s") from None
    except (ConnectionError, http.client.RemoteDisconnected):
        # The daemon closes a connection it refuses (SO_PEERCRED) before reading anything.
        raise PermissionDenied(f"the daemon of cache {cache_dir} closed the connection without an answer (it answers "
                               f"root and its --control-group only; see its log)") from None
    except http.client.HTTPException as e:
        raise LayerstoreError(f"the daemon of cache {cache_dir} sent a malformed answer: {e!r}") from None
    finally:
        conn.close()
    if status != 200:
        text = payload.decode(errors="replace")
        try:
            wire = json.loads(payload)
        except ValueError:
            wire = None
        raise from_wire(wire, fallback=text or f"the daemon of cache {cache_dir} answered {status}")
    return ctype, payload


def request_json(cache_dir: Path, method: str, path: str, body: dict[str, Any] | None = None,
                 timeout: float | None = 60.0) -> Any:
    return json.loads(request(cache_dir, method, path, body, timeout)[1])


# -- pins: the runtime shim's direct mounts of complete blobs (docs/node-cache.md) ----------------
def pin(cache_dir: Path, blob: str, holder: str, *, timeout: float | None = 60.0) -> Path | None:
    """Pin a blob for `holder` and return the absolute path of its cache data file, which is
    then a complete EROFS image that the daemon never modifies until `unpin`; None (and no pin)
    when some chunk of the blob is not in the node cache. Goes through the daemon of
    `cache_dir`, or, when none runs, opens the cache itself (`nodecache.maintenance.pin_offline`)."""
    try:
        res = request_json(cache_dir, "POST", "/pin", {"blob": blob, "holder": holder}, timeout)
    except BlobIncomplete:
        return None
    except DaemonNotRunning:
        from fuse_client.nodecache.maintenance import pin_offline  # (imports trio: only offline)

        return pin_offline(cache_dir, blob, holder)
    return Path(res["path"])


def unpin(cache_dir: Path, blob: str, holder: str, *, timeout: float | None = 60.0) -> bool:
    """Drop `holder`'s pin of a blob (durably); False if there was none. Through the daemon, or
    offline when none runs (e.g. after the daemon died)."""
    try:
        return bool(request_json(cache_dir, "POST", "/unpin", {"blob": blob, "holder": holder}, timeout)["removed"])
    except DaemonNotRunning:
        from fuse_client.nodecache.maintenance import unpin_offline  # (imports trio: only offline)

        return unpin_offline(cache_dir, blob, holder)


def attach(cache_dir: Path, blob: str, holder: str, *, timeout: float | None = 60.0) -> dict[str, Any] | None:
    """The blob's cache file made ready for a direct EROFS mount on the fanotify data path
    (`{"path", "generation", ...}`: docs/fanotify.md), or None if the daemon serves FUSE only."""
    try:
        return request_json(cache_dir, "POST", "/attach", {"blob": blob, "holder": holder}, timeout=timeout)
    except DataPathUnavailable:
        return None


def detach(cache_dir: Path, blob: str, holder: str, *, timeout: float | None = 60.0) -> bool:
    res = request_json(cache_dir, "POST", "/detach", {"blob": blob, "holder": holder}, timeout=timeout)
    return bool(res.get("removed"))
