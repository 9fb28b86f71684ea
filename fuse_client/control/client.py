"""The blocking client of the daemon's control socket, for the CLI and the runtime shim. It
imports no trio (the shim and the CLI start fast and never run an event loop for it).

An error answer carries the class of the error (`LayerstoreError.to_wire`): the client raises the
same class again (`layerstore.errors.from_wire`), so `layerctl` exits with the code of the error
the daemon met (e.g. 4 for `CorruptObject`). No daemon on the socket is `DaemonNotRunning`.
"""

from __future__ import annotations

import errno
import json
import os
import socket
from pathlib import Path
from typing import Any

# Registers the node cache's error classes (BlobIncomplete, BlobPinned, ...) for `from_wire`.
from fuse_client.nodecache.errors import BlobIncomplete
from layerstore.errors import LayerstoreError, NodeUnavailable, PermissionDenied, StoreUnavailable, from_wire

SOCKET_NAME = "control.sock"


class DaemonNotRunning(NodeUnavailable):
    """No daemon answers on the cache directory's control socket."""


def socket_path(cache_dir: Path) -> Path:
    return Path(cache_dir) / SOCKET_NAME


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
            if e.errno in (errno.EACCES, errno.EPERM):
                raise PermissionDenied(f"not allowed to use {sp}: root or the daemon's --control-group only") from None
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
    if not raw:
        raise PermissionDenied(f"the daemon of cache {cache_dir} closed the connection without an answer (it answers "
                               f"root and its --control-group only; see its log)")
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
        text = payload.decode(errors="replace")
        try:
            answer = json.loads(payload)
        except ValueError:
            answer = None
        raise from_wire(answer, fallback=text or f"the daemon of cache {cache_dir} answered {status}")
    return ctype, payload


def request_json(cache_dir: Path, method: str, path: str, body: dict[str, Any] | None = None,
                 timeout: float | None = 60.0) -> Any:
    return json.loads(request(cache_dir, method, path, body, timeout)[1])


# -- pins: the runtime shim's direct mounts of complete blobs (docs/fuse-client.md) ---------------
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
