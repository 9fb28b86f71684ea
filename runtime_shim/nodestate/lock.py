"""The node lock: one flock(2) on NODE/lock held across every read-decide-write sequence, and the
per-blob locks a layer mount is waited for on (`BlobLock`).

The node directory is local disk, where flock is reliable. The node lock is held for milliseconds
(state transactions and the sub-millisecond mounts that must be atomic with them), never while a
layer's image is read, nor while a container runs; the kernel drops a flock when its holder dies,
so a crashed shim never leaves the node (or a blob) locked.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from pathlib import Path


class NodeLock:
    """Reentrant per thread: nested `with` blocks of one thread share its flock; threads sharing
    one object (a node agent's threads over one `Shim`) each open the lock file themselves, so
    flock serialises them as it does processes. `waited` is the calling thread's total time spent
    waiting for the lock.

    Each thread keeps its descriptor of the lock file open between acquisitions (flock, then
    LOCK_UN) instead of opening it every time: two system calls fewer per acquisition, four per
    mount. A descriptor is the calling process's only: a forked child (which shares the parent's
    open file description, and so its flock) opens its own on its first acquisition."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._local = threading.local()

    @property
    def waited(self) -> float:
        return float(getattr(self._local, "waited", 0.0))

    @property
    def held(self) -> bool:
        """Does the calling thread (of this process) hold the lock?"""
        return getattr(self._local, "pid", None) == os.getpid() and self._local.depth > 0

    def __enter__(self) -> NodeLock:
        local = self._local
        if getattr(local, "pid", None) != os.getpid():  # a forked child holds nothing of its parent's
            local.pid, local.depth, local.fd = os.getpid(), 0, None
        depth = local.depth
        if depth == 0:
            t = time.monotonic()
            fd = local.fd
            if fd is None:
                fd = local.fd = _LockFile(self.path)
            fcntl.flock(fd.fd, fcntl.LOCK_EX)
            local.waited = self.waited + time.monotonic() - t
        local.depth = depth + 1
        return self

    def __exit__(self, *exc: object) -> None:
        local = self._local
        local.depth -= 1
        if local.depth == 0:
            fcntl.flock(local.fd.fd, fcntl.LOCK_UN)

    def close(self) -> None:
        """Close the calling thread's descriptor (other threads' close when they end)."""
        fd = getattr(self._local, "fd", None)
        if fd is not None and not self.held and getattr(self._local, "pid", None) == os.getpid():
            self._local.fd = None
            fd.close()


class _LockFile:
    """One open descriptor of a lock file, closed when dropped (a thread's ends with it)."""

    def __init__(self, path: Path) -> None:
        self.pid = os.getpid()
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0 and self.pid == os.getpid():
            os.close(fd)

    def __del__(self) -> None:
        self.close()


class BlobLock:
    """The lock file of one layer blob (NODE/locks/<hex>). The process that claimed a layer's
    mount holds it exclusively from the claim (taken under the node lock) until the outcome is in
    the state; others wait for that outcome by taking it shared, without the node lock."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def hold(self) -> BlobLock:
        self._fd = _flock(self.path, fcntl.LOCK_EX)
        return self

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def wait(self) -> None:
        """Return once no one holds the lock exclusively."""
        os.close(_flock(self.path, fcntl.LOCK_SH))


def _flock(path: Path, how: int) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, how)
    except BaseException:
        os.close(fd)
        raise
    return fd
