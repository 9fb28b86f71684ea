"""Getting the group at daemon start: from the live holder (a restart: same group, same marks,
same generation), else from the service manager's fd store (systemd kept a copy: `fdstore`),
else a new group and a new holder process that keeps a copy (docs/fanotify.md). A new group is
made under `CACHE/fanotify.lock` only, so a daemon and the shim's supervision (`regroup`) never
make two groups for one cache (two groups marking the same files would each have to answer every
event: a group nobody reads would block those reads forever).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from . import fdstore, handover, keeper, kernel
from .journal import InflightJournal

log = logging.getLogger("layerstore.fanotify")

HOLDER_READY = 10.0
JOURNAL_NAME = "fanotify.inflight"


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


LOCK_NAME = "fanotify.lock"
FDSTORE_NAME = "fanotify.fdstore"  # the group id the service manager's fd store keeps a copy of


@contextlib.contextmanager
def group_lock(cache_dir: Path) -> Iterator[None]:
    """Held while a group is made (and its holder started) for this cache. Blocking."""
    fd = os.open(Path(cache_dir) / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def take_over(cache_dir: Path) -> tuple[int, str, bool] | None:
    """(group fd, group id, False) from the live holder, else from the service manager's fd
    store or the keeper (then a holder is started again with a copy); None if none has one."""
    stored = fdstore.take_listened()
    from_keeper = False
    if stored is None:
        stored = keeper.fetch(cache_dir)
        from_keeper = stored is not None
    got = handover.fetch_group(cache_dir)
    if got is not None:
        fd, pid, group_id = got
        if stored is not None and stored[1] != group_id:
            # A stale group in the manager's store (the holder's is live and newer): its marks
            # would make every access wait for an answer nobody gives. Unmark it and let it go.
            with contextlib.suppress(OSError):
                kernel.flush_marks(stored[0])
            if from_keeper:
                keeper.forget(cache_dir, stored[1])
            else:
                fdstore.forget(stored[1])
            log.warning("dropped the stale fanotify group %s the service manager kept", stored[1])
        if stored is not None:
            os.close(stored[0])
        if stored_group(cache_dir) != group_id:
            hand_to_manager(cache_dir, fd, group_id)  # (a group made before the manager kept one)
        log.info("fanotify group %s taken over from holder %d", group_id, pid)
        return fd, group_id, False
    if stored is None:
        return None
    fd, group_id = stored
    with contextlib.suppress(OSError):
        spawn_holder(cache_dir, fd, group_id)
    return fd, group_id, False


def stored_group(cache_dir: Path) -> str | None:
    """The id of the group the service manager's fd store keeps for this cache, else the one the
    live keeper keeps (asked: a keeper started again keeps nothing until a daemon hands it one)."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        return str(json.loads((Path(cache_dir) / FDSTORE_NAME).read_text())["group"])
    return keeper.held(cache_dir)


def hand_to_manager(cache_dir: Path, fd: int, group_id: str) -> None:
    """A copy of the group into the service manager's fd store, when there is one (remembered in
    CACHE/fanotify.fdstore: the shim's supervision then leaves that group to the manager), else to
    the keeper, when one runs (`keeper`: it says itself which group it keeps)."""
    if fdstore.store(fd, group_id):
        tmp = Path(cache_dir) / (FDSTORE_NAME + ".tmp")
        tmp.write_text(json.dumps({"group": group_id}))
        os.replace(tmp, Path(cache_dir) / FDSTORE_NAME)
    elif keeper.store(cache_dir, fd, group_id):
        log.info("fanotify group %s handed to the keeper", group_id)


def keep_copy(cache_dir: Path, fd: int, group_id: str) -> None:
    """A live keeper that does not keep this group (it was started again) gets a copy."""
    if keeper.running(cache_dir) is not None and keeper.held(cache_dir) != group_id:
        keeper.store(cache_dir, fd, group_id)


def quit_holder(cache_dir: Path, group_id: str) -> None:
    """Stop the holder of `group_id` and drop the manager's copy (nothing is mounted on the
    group any more)."""
    ident = handover.read_identity(cache_dir)
    if ident is not None and ident[1] == group_id:
        handover.quit_holder(cache_dir)
    if stored_group(cache_dir) == group_id:
        fdstore.forget(group_id)
        with contextlib.suppress(OSError):
            (Path(cache_dir) / FDSTORE_NAME).unlink()
    keeper.forget(cache_dir, group_id)


def new_group(cache_dir: Path, blobs_files: list[Path] | None = None) -> tuple[int, str, int]:
    """A new group (with inode marks on `blobs_files` first, if given: the files of the layers
    still mounted on a dead group), held by a new holder, and handed to the service manager if
    there is one; the in-flight journal belongs to the dead group, so callers reset it.
    Returns (group fd, group id, holder pid). Caller holds `group_lock`."""
    fd = kernel.init_group()
    group_id = secrets.token_hex(8)
    try:
        for path in blobs_files or []:
            try:
                kernel.mark(fd, path)
            except OSError as e:
                log.error("new fanotify group: cannot mark %s: %s", path, e.strerror)
        pid = spawn_holder(cache_dir, fd, group_id)
    except BaseException:
        os.close(fd)
        raise
    hand_to_manager(cache_dir, fd, group_id)
    log.info("new fanotify group %s, held by holder %d", group_id, pid)
    return fd, group_id, pid


def acquire(cache_dir: Path) -> tuple[int, str, bool]:
    """(group fd, group id, created): the holder's group if one answers (or the manager's),
    else a new one (with a new holder). Blocking."""
    got = take_over(cache_dir)
    if got is not None:
        return got
    with group_lock(cache_dir):
        got = take_over(cache_dir)  # (made meanwhile by the shim's supervision: `regroup`)
        if got is not None:
            return got
        fd, group_id, _pid = new_group(cache_dir)
    return fd, group_id, True


def regroup(cache_dir: Path, data_file: Callable[[str], Path]) -> str | None:
    """Every process that held this cache's group died (no holder answers, no daemon runs, no
    service manager keeps a copy): at once, before any daemon starts, make a new group with the
    data files of every persisted attachment marked again (the layers still mounted on them raise
    events to it from then on: no more holes read as zeros), held by a new holder; the journal
    is reset (its events were the dead group's). The next daemon takes this group over. Returns
    the new group's id, or None when there was nothing to do (a holder answers, the manager
    keeps the group, or nothing is attached). Blocking; the caller knows no daemon runs."""
    attached = handover.load_attachments(cache_dir)
    if not attached or handover.read_identity(cache_dir) is not None or stored_group(cache_dir) is not None:
        return None
    with group_lock(cache_dir):
        if handover.read_identity(cache_dir) is not None:
            return None
        files = [data_file(b) for b in sorted(attached)]
        fd, group_id, _pid = new_group(cache_dir, [f for f in files if f.exists()])
        try:
            journal = InflightJournal(Path(cache_dir) / JOURNAL_NAME)
            journal.reset()
            journal.close()
        finally:
            os.close(fd)  # (the holder keeps it)
    log.warning("fanotify group re-made by the supervision: %s, %d attached file(s) marked again", group_id,
                len(files))
    return group_id


def ensure_holder(cache_dir: Path, group: int, group_id: str) -> bool:
    """If the holder is gone (the group lives on in this daemon), start a new one with this
    daemon's copy; True if one was started."""
    ident = handover.read_identity(cache_dir)
    if ident is not None and ident[1] == group_id:
        return False
    log.error("the fanotify holder of group %s is gone: starting a new one", group_id)
    spawn_holder(cache_dir, group, group_id)
    return True
