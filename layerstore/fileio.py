"""Plain file I/O that every layer of the house needs, written once: whole reads and writes at an
offset however many system calls they take, and files replaced whole or not at all.

Portable POSIX, no Linux-only calls (those live in `fuse_client.linux`, with the mount code): the
store, the manifests and the builder sit below the node daemon and use these too.
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path

from .errors import LayerstoreError


def pread_exact(fd: int, length: int, offset: int, what: object) -> bytes:
    """`length` bytes at `offset`, however many reads that takes; a file that ends early is an error."""
    data = os.pread(fd, length, offset)
    while len(data) < length:
        more = os.pread(fd, length - len(data), offset + len(data))
        if not more:
            raise LayerstoreError(f"{what}: file shrank while it was being read")
        data += more
    return data


def pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    """Write all of `data` at `offset` (pwrite may write less than asked)."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a rename or link in `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_name(path: Path) -> Path:
    """The temporary name a writer of `path` uses beside it (hidden, per process)."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def write_atomic(path: str | os.PathLike[str], data: bytes, *, durable: bool = True, mode: int = 0o600,
                 exclusive: bool = False) -> None:
    """Write `path` whole or not at all: a temporary file beside it, then rename (or, with
    `exclusive`, link, which fails with FileExistsError if `path` exists: no check-then-write
    race). `durable=False` skips the fsyncs: the file then survives a process crash but maybe
    not a power loss. A failure leaves no temporary file behind."""
    path = Path(path)
    tmp = temp_name(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        try:
            pwrite_all(fd, data, 0)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        if exclusive:
            os.link(tmp, path)
        else:
            os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):  # renamed away, or left by a failure
            os.unlink(tmp)
    if durable:
        fsync_dir(path.parent)


def rmdir_quiet(path: str | os.PathLike[str]) -> None:
    """Remove an empty directory; nothing if it is gone, not empty or a busy mount point."""
    try:
        os.rmdir(path)
    except OSError as e:
        if e.errno not in (errno.ENOENT, errno.ENOTEMPTY, errno.EBUSY):
            raise
