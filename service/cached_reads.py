"""Reads of a local POSIX store's objects that the page cache answers, done in the event loop.

A backend call runs in a worker thread (`anyio.to_thread`); on the shared 2-core machine that
hand-off (wake a thread, run it, wake the loop again) cost more than reading a 1 MiB chunk from the
page cache. So for a `PosixBackend` on a local filesystem the service first tries the read here,
with `preadv(RWF_NOWAIT)`: the kernel answers from the page cache or refuses (EAGAIN) instead of
going to the disk. Anything but a whole, cached read of a regular file (a miss, a short read, a
symlink, an error of any kind) answers None, and the caller takes the backend's own path in a
thread, which has the error translation and the disk waits. Network and FUSE filesystems (CephFS,
NFS) are never read here: their open(2) alone may wait on a server."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

from layerstore.backends.posix import PosixBackend
from layerstore.linux import OVERLAYFS_MAGIC, fs_type

EXT4_MAGIC = 0xEF53
XFS_MAGIC = 0x58465342
BTRFS_MAGIC = 0x9123683E
TMPFS_MAGIC = 0x01021994
LOCAL_FILESYSTEMS = frozenset({EXT4_MAGIC, XFS_MAGIC, BTRFS_MAGIC, TMPFS_MAGIC, OVERLAYFS_MAGIC})
OPEN_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY

Span = Callable[[int], "tuple[int, int] | None"]  # object size -> (offset, length), None: past the end


class CachedReader:
    def __init__(self, root: Path) -> None:
        self.root = root

    @classmethod
    def for_backend(cls, backend: object) -> CachedReader | None:
        """A reader for `backend` if it is a POSIX store on a local filesystem, else None."""
        if not isinstance(backend, PosixBackend) or not hasattr(os, "RWF_NOWAIT"):
            return None
        if fs_type(backend.root) not in LOCAL_FILESYSTEMS:
            return None
        return cls(Path(backend.root))

    def read(self, key: str, max_size: int, span: Span | None = None) -> tuple[int, int, memoryview | None] | None:
        """(the object's size, the offset read, the bytes (None: the range is past the end)) of
        `key` (already checked against the key grammar), the whole object or `span(size)`; None
        when the page cache cannot answer all of it without waiting, or anything is unusual."""
        try:
            fd = os.open(self.root / key, OPEN_FLAGS)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > max_size:
                return None
            size = st.st_size
            offset, length = (0, size) if span is None else (span(size) or (0, -1))
            if length < 0:
                return size, 0, None
            length = min(length, size - offset)
            buf = bytearray(length)
            if length and os.preadv(fd, [buf], offset, os.RWF_NOWAIT) != length:
                return None
            return size, offset, memoryview(buf)
        except OSError:
            return None
        finally:
            os.close(fd)
