"""Getting the group at daemon start: from the live holder (a restart: same group, same marks,
same generation), else a new group and a new holder process that keeps a copy (docs/fanotify.md).
"""

from __future__ import annotations

import logging
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

from . import handover, kernel

log = logging.getLogger("layerstore.fanotify")

HOLDER_READY = 10.0


def spawn_holder(cache_dir: Path, group: int, group_id: str) -> int:
    """Start a holder with a copy of `group` in its own session (it outlives this process);
    return its pid once its socket answers."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "fuse_client.fanotify.holder", os.fspath(cache_dir), str(group), group_id],
        pass_fds=(group,), start_new_session=True, stdin=subprocess.DEVNULL, close_fds=True)
    deadline = time.monotonic() + HOLDER_READY
    while time.monotonic() < deadline:
        ident = handover.read_identity(cache_dir)
        if ident is not None and ident[0] == proc.pid:
            return proc.pid
        if proc.poll() is not None:
            raise OSError(f"the fanotify holder exited at start ({proc.returncode})")
        time.sleep(0.01)
    proc.kill()
    proc.wait()
    raise OSError("the fanotify holder did not start")


def take_over(cache_dir: Path) -> tuple[int, str, bool] | None:
    """(group fd, group id, False) from the live holder, None if none answers."""
    got = handover.fetch_group(cache_dir)
    if got is None:
        return None
    fd, pid, group_id = got
    log.info("fanotify group %s taken over from holder %d", group_id, pid)
    return fd, group_id, False


def quit_holder(cache_dir: Path, group_id: str) -> None:
    """Stop the holder of `group_id` (nothing is mounted on the group any more)."""
    ident = handover.read_identity(cache_dir)
    if ident is not None and ident[1] == group_id:
        handover.quit_holder(cache_dir)


def acquire(cache_dir: Path) -> tuple[int, str, bool]:
    """(group fd, group id, created): the holder's group if one answers, else a new one (with
    a new holder). Blocking."""
    got = take_over(cache_dir)
    if got is not None:
        return got
    fd = kernel.init_group()
    group_id = secrets.token_hex(8)
    try:
        pid = spawn_holder(cache_dir, fd, group_id)
    except BaseException:
        os.close(fd)
        raise
    log.info("new fanotify group %s, held by holder %d", group_id, pid)
    return fd, group_id, True


def ensure_holder(cache_dir: Path, group: int, group_id: str) -> bool:
    """If the holder is gone (the group lives on in this daemon), start a new one with this
    daemon's copy; True if one was started."""
    ident = handover.read_identity(cache_dir)
    if ident is not None and ident[1] == group_id:
        return False
    log.error("the fanotify holder of group %s is gone: starting a new one", group_id)
    spawn_holder(cache_dir, group, group_id)
    return True
