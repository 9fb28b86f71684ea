"""Who may talk to the keeper (docs/security.md; docs/fanotify.md, "A keeper without systemd"):
its two sockets are 0600 in the cache directory (0700); and with those modes loosened by hand
the request socket still answers a non-root peer nothing (SO_PEERCRED): no group handed out, and
its `Q` does not end the keeper."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from testkit.fuse_helpers import wait_until

from fuse_client.fanotify import keeper, kernel

NOBODY = 65534
# What a peer gets once connected: "refused" (closed unanswered: EOF, a reset since its request
# was left unread, or a broken pipe if it closed first), else the bytes answered and the control
# messages (an fd would be one).
ASK = """import socket, sys
s = socket.socket(socket.AF_UNIX)
s.settimeout(10)
s.connect(sys.argv[1])
try:
    s.sendall(sys.argv[2].encode())
    msg, anc, _flags, _addr = s.recvmsg(4096, socket.CMSG_SPACE(4))
except (ConnectionResetError, BrokenPipeError):
    msg, anc = b"", []
print("refused" if not msg and not anc else f"{len(msg)} {len(anc)}")
"""


@pytest.mark.root
def test_the_keepers_sockets_admit_root_only() -> None:
    base = Path(tempfile.mkdtemp(prefix="keeper-access-", dir="/var/tmp"))  # (a path nobody may walk)
    cache = base / "cache"
    pid = keeper.ensure(cache, {**os.environ, keeper.OPT_IN_ENV: "1"})
    group = kernel.init_group()
    try:
        assert pid is not None
        assert stat.S_IMODE(cache.stat().st_mode) == 0o700
        for name in (keeper.NOTIFY_NAME, keeper.SOCKET_NAME):
            st = (cache / name).lstat()
            assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == 0, name
        assert keeper.store(cache, group, "cafe")
        wait_until(lambda: keeper.held(cache) == "cafe", 10, "the keeper to keep the group")
        for d in (base, cache):  # loosened by hand: only the peer check is left
            os.chmod(d, 0o755)
        os.chmod(cache / keeper.SOCKET_NAME, 0o666)
        python = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable
        for request in ("G", "I", "Q"):
            p = subprocess.run([python, "-I", "-c", ASK, os.fspath(cache / keeper.SOCKET_NAME), request],
                               user=NOBODY, group=NOBODY, extra_groups=[], capture_output=True, text=True,
                               timeout=60, cwd="/")
            assert p.returncode == 0, p.stderr  # (connected: the mode no longer refuses it)
            assert p.stdout.strip() == "refused", (request, p.stdout)  # (no answer, no fd)
        ans = subprocess.run([python, "-I", "-c", ASK, os.fspath(cache / keeper.SOCKET_NAME), "I"],
                             capture_output=True, text=True, timeout=60)
        assert ans.stdout.split()[1:] == ["0"], ans  # (the same script as root: answered, no fd)
        assert keeper.running(cache) == pid and keeper.held(cache) == "cafe"  # (a root peer still gets answers)
    finally:
        os.close(group)
        keeper.stop(cache)
        with contextlib.suppress(OSError):
            shutil.rmtree(base)
