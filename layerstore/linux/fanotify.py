"""fanotify's two system calls, fanotify_init(2) and fanotify_mark(2), raising `OSError` (errno
kept). What the daemon asks of them (the group's flags, the marks, the answers, the probe) is
`fuse_client.fanotify.kernel`'s; the event format is `fuse_client.fanotify.abi`'s.
"""

from __future__ import annotations

import ctypes
import os

from .libc import check, libc

AT_FDCWD = -100

libc.fanotify_init.argtypes = [ctypes.c_uint, ctypes.c_uint]
libc.fanotify_init.restype = ctypes.c_int
libc.fanotify_mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p]
libc.fanotify_mark.restype = ctypes.c_int


def fanotify_init(flags: int, event_flags: int) -> int:
    """A new fanotify group: its fd."""
    return check(libc.fanotify_init(flags, event_flags), "fanotify_init")


def fanotify_mark(group: int, flags: int, mask: int, path: str | os.PathLike[str] | None, what: str) -> None:
    """fanotify_mark(2) on `path` (relative to the working directory; None for `FAN_MARK_FLUSH`);
    `OSError` naming `what` on failure."""
    check(libc.fanotify_mark(group, flags, mask, AT_FDCWD, None if path is None else os.fsencode(path)), what)
