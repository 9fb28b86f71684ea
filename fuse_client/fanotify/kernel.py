"""What the daemon asks of fanotify (the system calls themselves are `layerstore.linux.fanotify`'s)
and the probe that decides the data path.

The group is opened with `O_RDWR`: the event fds are used to nothing but `fstat` (the daemon
writes through its own descriptors), `O_LARGEFILE` for files beyond 2 GiB.
"""

from __future__ import annotations

import contextlib
import errno as errnos
import os
import tempfile
from pathlib import Path

from layerstore.linux.fanotify import fanotify_init, fanotify_mark

from . import abi

GROUP_FLAGS = abi.FAN_CLASS_PRE_CONTENT | abi.FAN_CLOEXEC | abi.FAN_UNLIMITED_QUEUE | abi.FAN_UNLIMITED_MARKS
EVENT_FLAGS = os.O_RDONLY | os.O_LARGEFILE | os.O_CLOEXEC


def init_group() -> int:
    """A new pre-content group: its fd."""
    return fanotify_init(GROUP_FLAGS, EVENT_FLAGS)


def mark(group: int, path: str | os.PathLike[str], mask: int = abi.FAN_PRE_ACCESS) -> None:
    """Add an inode mark for `mask` on `path` (a regular file; symlinks not followed)."""
    fanotify_mark(group, abi.FAN_MARK_ADD | abi.FAN_MARK_DONT_FOLLOW, mask, path, f"fanotify_mark add {path}")


def unmark(group: int, path: str | os.PathLike[str], mask: int = abi.FAN_PRE_ACCESS) -> bool:
    """Remove the mark; False if there was none (ENOENT) or the file is gone."""
    try:
        fanotify_mark(group, abi.FAN_MARK_REMOVE | abi.FAN_MARK_DONT_FOLLOW, mask, path, f"fanotify_mark remove {path}")
    except OSError as e:
        if e.errno == errnos.ENOENT:  # no such mark, or no such file
            return False
        raise
    return True


def flush_marks(group: int) -> None:
    """Remove every inode mark of the group (`FAN_MARK_FLUSH`)."""
    fanotify_mark(group, abi.FAN_MARK_FLUSH, 0, None, "fanotify_mark flush")


def respond(group: int, fd: int, *, allow: bool, errno: int = 0) -> bool:
    """Answer the permission event `fd`; False if the kernel has no such pending event (ENOENT:
    answered already)."""
    try:
        os.write(group, abi.response(fd, allow=allow, errno=errno))
        return True
    except FileNotFoundError:
        return False


def probe(where: str | os.PathLike[str] | None = None) -> str | None:
    """None if this kernel gives pre-content events (a `FAN_CLASS_PRE_CONTENT` group and a
    `FAN_PRE_ACCESS` mark on a scratch file in `where` both work), else why not."""
    try:
        group = init_group()
    except OSError as e:
        return f"fanotify_init(FAN_CLASS_PRE_CONTENT): {e.strerror}"
    try:
        with tempfile.NamedTemporaryFile(dir=where, prefix=".fanotify-probe-") as f:
            try:
                mark(group, f.name)
            except OSError as e:
                return f"fanotify_mark(FAN_PRE_ACCESS): {e.strerror}"
        return None
    finally:
        os.close(group)


def open_fds() -> int:
    """How many fds this process has open (an over-count by one: the listing's own)."""
    return len(os.listdir("/proc/self/fd"))


def group_marks(group: int) -> int:
    """How many marks the group `group` (an fd of this process) holds (its fdinfo's mark lines)."""
    with open(f"/proc/self/fdinfo/{group}", "rb") as f:
        return abi.count_marks(f.read())


def fd_path(fd: int) -> Path | None:
    """What an event fd refers to (its /proc link), None if unreadable."""
    with contextlib.suppress(OSError):
        return Path(os.readlink(f"/proc/self/fd/{fd}"))
    return None
