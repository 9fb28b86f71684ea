"""The daemon's control socket, the server side: the control API (`control.api`, a FastAPI app)
served over HTTP/1.1 on a Unix socket in the cache directory, on the daemon's trio thread, by
hypercorn. One request per connection: every answer says `Connection: close`.

Who may talk to it: root, or a member of the node's control group (`--control-group`, none by
default). The socket file is created with its final mode (0600, or 0660 and the group's
ownership), never briefly wider: it is bound inside a fresh 0700 directory, given its mode and
group there, and renamed into place. Every connection's peer is checked again with SO_PEERCRED
and SO_PEERGROUPS (the credentials the kernel recorded at connect): any other peer is closed
without an answer, and logged once per uid.

How the peer check meets hypercorn: we own the listening socket and the accept loop (trio's
`serve_listeners`); each accepted stream is checked, and only then handed to hypercorn's
per-connection server (`hypercorn.trio.tcp_server.TCPServer`), which parses HTTP (h11) and calls
the ASGI app. hypercorn's public `serve()` accepts on its own and tells the app nothing about the
socket, so it cannot refuse a peer before any byte of HTTP is read; `TCPServer(app, config,
context, state, stream)` is the one non-public seam we use. hypercorn is pinned (constraints.txt)
and every control test goes through that seam, so a change in it fails loudly, not silently.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import tempfile
from pathlib import Path

import trio
from hypercorn.config import Config
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState
from hypercorn.utils import wrap_app

from layerstore import linux
from layerstore.errors import ConfigError

from .api import ControlAPI

__all__ = ["ControlAPI", "ControlServer", "http_config"]

log = logging.getLogger("layerstore.fuse.control")

MAX_REFUSED_LOGGED = 1024  # peers (uids) remembered so that each refusal is logged once
IDLE_TIMEOUT = 5.0  # seconds a connection may take to send its request's head


def http_config() -> Config:
    """hypercorn's settings for the control socket."""
    config = Config()
    config.keep_alive_max_requests = 1  # one request per connection, as the blocking client uses it
    config.keep_alive_timeout = IDLE_TIMEOUT  # also bounds a client that connects and sends nothing
    config.h11_max_incomplete_size = 64 * 1024  # request line + headers
    config.include_server_header = False
    config.accesslog = None
    config.errorlog = logging.getLogger("layerstore.fuse.control.http")
    return config


class ControlServer:
    def __init__(self, path: Path, api: ControlAPI, *, group: int | None = None) -> None:
        """`group`: the gid whose members may use the socket besides root (None: root only)."""
        self.path = Path(path)
        self.api = api
        self.group = group
        self.mode = 0o600 if group is None else 0o660
        self.refused = 0
        self._refused_uids: set[int] = set()
        self._config = http_config()
        self._asgi = wrap_app(api.app, self._config.wsgi_max_body_size, "asgi")
        self._context = WorkerContext(None)

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
        # hypercorn closes the stream when the exchange ends (or the peer goes away).
        try:
            await TCPServer(self._asgi, self._config, self._context, ConnectionState({}), stream).run()
        except Exception:  # one connection's failure must not take the daemon down
            log.exception("control: a connection failed")
            with contextlib.suppress(Exception):
                await stream.aclose()
