"""The holder: a small process that keeps the fanotify group alive between daemons and hands it to
each new one (docs/fanotify.md). It owns no cache state, talks to no store, never reads events:
it only keeps the group fd open (so its marks stay and unanswered reads wait instead of reading
zeros) and answers `handover` requests on `CACHE/fanotify.sock`.

    python -m fuse_client.fanotify.holder CACHE_DIR GROUP_FD GROUP_ID

It ignores SIGTERM, SIGINT and SIGHUP (a stray signal must not turn waiting reads into zeros);
it exits on a `Q` request from root, with SIGKILL, once the cache directory is gone (removed with
everything in it: a node torn down, a test's temporary directory), or once it is useless: no
daemon has claimed it (`C`: a connection a daemon keeps open while it runs) for `IDLE_EXIT`
seconds *and* the group holds no mark (its fdinfo lists none: nothing mounted on the group can
raise an event, so closing it lets no hole read as zeros) *and* no attachment is persisted (no
layer is mounted on the group: a new group would be a new generation, and the shim would
remount those layers). With a mark or an attachment left it stays, however long no daemon
comes: it is what keeps those reads waiting.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

from . import handover, kernel

CHECK_INTERVAL = 2.0  # seconds between checks that the cache directory still exists
IDLE_EXIT = float(os.environ.get("LAYERSTORE_FANOTIFY_HOLDER_IDLE", "30"))  # unclaimed and markless: exit


def bind(cache_dir: Path, path: Path | None = None, kind: int = socket.SOCK_STREAM) -> socket.socket:
    """Listen on CACHE/fanotify.sock (or `path`, a socket of `kind`: the keeper's), mode 0600 from
    the start (bound in a private directory, renamed into place: also replaces a stale socket)."""
    path = path or handover.socket_path(cache_dir)
    tmpdir = tempfile.mkdtemp(prefix=".fanotify-", dir=cache_dir)
    try:
        tmp = Path(tmpdir) / "s"
        s = socket.socket(socket.AF_UNIX, kind)
        s.bind(os.fspath(tmp))
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.rmdir(tmpdir)
    if kind == socket.SOCK_STREAM:
        s.listen(16)
    return s


def useless(claims: int, idle_since: float, now: float, marks: int, attached: int,
            idle_exit: float = IDLE_EXIT) -> bool:
    """Whether the holder may exit: no daemon claims it, none has for `idle_exit` seconds, the
    group holds no mark and no blob is attached (pure)."""
    return claims == 0 and now - idle_since >= idle_exit and marks == 0 and attached == 0


def serve(cache_dir: Path, group: int, group_id: str) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    srv = bind(cache_dir)
    handover.write_identity(cache_dir, os.getpid(), group_id)
    me = json.dumps({"pid": os.getpid(), "group": group_id}).encode()
    claims: list[socket.socket] = []  # daemons' open claim connections (EOF: that daemon is gone)
    idle_since = time.monotonic()
    while True:
        ready, _, _ = select.select([srv, *claims], [], [], CHECK_INTERVAL)
        for c in [r for r in ready if r is not srv]:
            with contextlib.suppress(OSError):
                if c.recv(64):
                    continue  # (a claimant says nothing more; ignore)
            claims.remove(c)
            c.close()
            if not claims:
                idle_since = time.monotonic()
        if srv in ready:
            what = _one_request(srv, group, me, claims)
            if what == b"Q":
                break
            if what == b"G":
                idle_since = time.monotonic()
        if not cache_dir.is_dir():
            break
        if (not claims and time.monotonic() - idle_since >= IDLE_EXIT
                and useless(0, idle_since, time.monotonic(), kernel.group_marks(group),
                            len(handover.load_attachments(cache_dir)))):
            break
    for c in claims:
        c.close()
    srv.close()


def _one_request(srv: socket.socket, group: int, me: bytes, claims: list[socket.socket]) -> bytes:
    """Accept one connection and answer its request: `G` (the group fd), `Q` (quit), `C` (claim:
    the connection is kept). Returns the request ("" if refused or broken)."""
    try:
        conn, _ = srv.accept()
    except OSError:
        return b""
    keep = False
    try:
        conn.settimeout(5)
        if not handover.peer_is_root(conn):
            return b""
        what = conn.recv(1)
        if what == b"G":
            handover.send_fd(conn, me, group)
        elif what in (b"Q", b"C"):
            conn.sendall(me)
            if what == b"C":
                conn.setblocking(False)
                claims.append(conn)
                keep = True
        return what
    except OSError:
        return b""
    finally:
        if not keep:
            conn.close()


def main(argv: list[str]) -> int:
    cache_dir, group, group_id = Path(argv[1]), int(argv[2]), argv[3]
    os.set_inheritable(group, False)
    serve(cache_dir, group, group_id)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
