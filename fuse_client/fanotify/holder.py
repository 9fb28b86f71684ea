"""The holder: a small process that keeps the fanotify group alive between daemons and hands it to
each new one (docs/fanotify.md). It owns no cache state, talks to no store, never reads events:
it only keeps the group fd open (so its marks stay and unanswered reads wait instead of reading
zeros) and answers `handover` requests on `CACHE/fanotify.sock`.

    python -m fuse_client.fanotify.holder CACHE_DIR GROUP_FD GROUP_ID

It ignores SIGTERM, SIGINT and SIGHUP (a stray signal must not turn waiting reads into zeros);
it exits on a `Q` request from root, with SIGKILL, or once the cache directory is gone (removed
with everything in it: a node torn down, a test's temporary directory).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import tempfile
from pathlib import Path

from . import handover

CHECK_INTERVAL = 2.0  # seconds between checks that the cache directory still exists


def bind(cache_dir: Path) -> socket.socket:
    """Listen on CACHE/fanotify.sock, mode 0600 from the start (bound in a private directory,
    renamed into place: also replaces a stale socket)."""
    path = handover.socket_path(cache_dir)
    tmpdir = tempfile.mkdtemp(prefix=".fanotify-", dir=cache_dir)
    try:
        tmp = Path(tmpdir) / "s"
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(os.fspath(tmp))
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.rmdir(tmpdir)
    s.listen(16)
    return s


def serve(cache_dir: Path, group: int, group_id: str) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    srv = bind(cache_dir)
    handover.write_identity(cache_dir, os.getpid(), group_id)
    me = json.dumps({"pid": os.getpid(), "group": group_id}).encode()
    srv.settimeout(CHECK_INTERVAL)
    while True:
        try:
            conn, _ = srv.accept()
        except TimeoutError:
            if not cache_dir.is_dir():
                break
            continue
        with conn:
            conn.settimeout(5)
            try:
                if not handover.peer_is_root(conn):
                    continue
                what = conn.recv(1)
                if what == b"G":
                    handover.send_fd(conn, me, group)
                elif what == b"Q":
                    conn.sendall(me)
                    break
            except OSError:
                continue
    srv.close()


def main(argv: list[str]) -> int:
    cache_dir, group, group_id = Path(argv[1]), int(argv[2]), argv[3]
    os.set_inheritable(group, False)
    serve(cache_dir, group, group_id)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
