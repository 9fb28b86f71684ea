"""Plain file I/O that every layer of the house needs, written once: whole reads and writes at an
offset however many system calls they take, and files replaced whole or not at all.

Portable POSIX, no Linux-only calls (those live in `layerstore.linux`, with the mount code): the
store, the manifests and the builder sit below the node daemon and use these too.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

from .errors import LayerstoreError, PermissionDenied


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


def private_dir(path: str | os.PathLike[str], *, gid: int | None = None, parents: bool = False) -> Path:
    """`path` as a directory no other user can enter: created 0700 if missing (its missing
    `parents` too, with the default mode), and an existing one narrowed to 0700 whatever its mode
    was. With `gid`: 0710 and that group, so the group's members can reach a name they know inside
    (a socket) but list nothing. Refuses (`PermissionDenied`) a symlink, a non-directory or a
    directory owned by another user: whoever planted it could still open what goes inside."""
    path = Path(path)
    mode = 0o700 if gid is None else 0o710
    if parents:
        path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, mode)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise PermissionDenied(f"{path}: a symlink or not a directory; want a directory of this node's own "
                                   "(remove it, or name the real path)") from None
        raise
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise PermissionDenied(f"{path}: owned by uid {st.st_uid}, not by this node's user (uid {os.geteuid()}): "
                                   "its owner could read what goes inside; remove it")
        if gid is not None and st.st_gid != gid:
            os.fchown(fd, -1, gid)
        if stat.S_IMODE(st.st_mode) != mode:
            os.fchmod(fd, mode)  # (after the chown, which would clear a setgid bit)
    finally:
        os.close(fd)
    return path


LMDB_FILES = ("data.mdb", "lock.mdb")  # the files of an LMDB environment (subdir=True)


def narrow_files(directory: str | os.PathLike[str], names: tuple[str, ...], mode: int = 0o600) -> None:
    """chmod the regular files `names` in `directory` to `mode` where they exist with more (files a
    library created with its own default mode, e.g. LMDB's 0644)."""
    for name in names:
        try:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) & ~mode:
                os.fchmod(fd, mode)
        finally:
            os.close(fd)
