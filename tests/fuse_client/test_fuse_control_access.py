"""Who may use the daemon's control socket: root, or a member of its control group. The socket
is created with its final mode (never briefly wider), and every connection's peer is checked
with SO_PEERCRED / SO_PEERGROUPS, so even a socket whose mode was widened answers nobody else."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

import fuse_client.control.server as servermod
from fuse_client.control import request_json, socket_path
from fuse_client.control.server import ControlAPI, ControlServer
from layerstore.store import Store
from tests.fuse_client.test_fuse_handlers import rig

NOBODY = 65534
OTHER_GID = 54321  # a group nobody is in by default

# Runs as another user: a raw HTTP request on the socket; prints what came back (or the errno).
CLIENT = r"""
import os, socket, sys
groups = [int(g) for g in sys.argv[3].split(",") if g]
os.setgroups(groups)
os.setgid(int(sys.argv[2]))
os.setuid(65534)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect(sys.argv[1])
except OSError as e:
    print("connect-errno", e.errno)
    sys.exit(0)
data = b""
try:
    s.sendall(b"GET /stats HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    while True:
        b = s.recv(65536)
        if not b:
            break
        data += b
except OSError:  # closed by the daemon: refused
    pass
print("answer", data.split(b"\r\n", 1)[0].decode() if data else "none")
"""

pytestmark = pytest.mark.root


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A cache directory that another uid can traverse (pytest's own tmp dirs are 0700)."""
    d = Path(tempfile.mkdtemp(prefix="lsctl-", dir="/tmp"))
    try:
        d.chmod(0o755)
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _as_nobody(sock: Path, gid: int = NOBODY, groups: tuple[int, ...] = ()) -> str:
    r = subprocess.run([sys.executable, "-c", CLIENT, str(sock), str(gid), ",".join(map(str, groups))],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


@contextlib.asynccontextmanager
async def _serving(store: Store, cache_dir: Path, group: int | None = None):  # type: ignore[no-untyped-def]
    async with rig(store, cache_dir) as r:
        kw = {} if group is None else {"group": group}
        server = ControlServer(socket_path(cache_dir), ControlAPI(r.lazy), **kw)
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve)
            yield server
            nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_the_socket_is_created_with_its_final_mode(store: Store, open_dir: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[int, int, int]] = []
    real_rename = os.rename

    def rename(src: str, dst: object) -> None:  # the socket's mode and its directory's, before it appears
        st, dst_ = os.stat(src), os.stat(os.path.dirname(src))
        seen.append((st.st_mode & 0o777, st.st_gid, dst_.st_mode & 0o777))
        real_rename(src, dst)  # type: ignore[arg-type]

    monkeypatch.setattr(servermod.os, "rename", rename)
    cache_dir = open_dir / "cache"
    async with _serving(store, cache_dir):
        assert os.stat(socket_path(cache_dir)).st_mode & 0o777 == 0o600
    assert seen == [(0o600, 0, 0o700)]
    seen.clear()
    async with _serving(store, cache_dir, group=OTHER_GID):
        st = os.stat(socket_path(cache_dir))
        assert (st.st_mode & 0o777, st.st_gid) == (0o660, OTHER_GID)
    assert seen == [(0o660, OTHER_GID, 0o700)]
    assert not [p for p in cache_dir.iterdir() if p.name.startswith(".control-")]


@pytest.mark.trio
async def test_another_uid_is_refused_even_through_a_widened_socket(store: Store, open_dir: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    cache_dir = open_dir / "cache"
    sock = socket_path(cache_dir)
    async with _serving(store, cache_dir) as server:
        cache_dir.chmod(0o755)
        # The mode alone keeps nobody out ...
        assert await trio.to_thread.run_sync(_as_nobody, sock) == "connect-errno 13"
        # ... and with the mode widened (a mistake, a bind mount), the peer check still does.
        sock.chmod(0o666)
        with caplog.at_level(logging.WARNING, "layerstore.fuse.control"):
            assert await trio.to_thread.run_sync(_as_nobody, sock) == "answer none"
            assert await trio.to_thread.run_sync(_as_nobody, sock) == "answer none"
        assert getattr(server, "refused", None) == 2
        assert caplog.text.count("refused a connection from uid 65534") == 1  # once per peer
        # Root still gets its answers.
        assert "blobs" in await trio.to_thread.run_sync(request_json, cache_dir, "GET", "/stats")


@pytest.mark.trio
async def test_members_of_the_control_group_are_allowed(store: Store, open_dir: Path) -> None:
    cache_dir = open_dir / "cache"
    sock = socket_path(cache_dir)
    async with _serving(store, cache_dir, group=OTHER_GID) as server:
        cache_dir.chmod(0o755)
        # (the status line carries no reason phrase: hypercorn, through h11, sends none)
        assert await trio.to_thread.run_sync(_as_nobody, sock, OTHER_GID) == "answer HTTP/1.1 200"
        # A supplementary group counts too (SO_PEERGROUPS).
        assert await trio.to_thread.run_sync(_as_nobody, sock, NOBODY, (OTHER_GID,)) == "answer HTTP/1.1 200"
        assert await trio.to_thread.run_sync(_as_nobody, sock) == "connect-errno 13"
        assert server.refused == 0
