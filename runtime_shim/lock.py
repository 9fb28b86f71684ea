"""The node lock: one flock(2) on NODE/lock held across every read-decide-mount-write sequence.

The node directory is local disk, where flock is reliable. The lock is held for milliseconds
(mount(2) of EROFS and overlayfs is sub-millisecond), never while a container runs; the kernel
drops it when the holder dies, so a crashed shim never leaves the node locked.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


class NodeLock:
    """Reentrant within one object (nested `with` blocks share the one flock)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        self._depth = 0

    def __enter__(self) -> NodeLock:
        if self._depth == 0:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except BaseException:
                os.close(fd)
                raise
            self._fd = fd
        self._depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth == 0 and self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the last descriptor releases the flock
