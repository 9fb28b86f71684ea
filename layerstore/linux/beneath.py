"""Files a sandbox controls: opened beneath a directory with openat2(2), never through a symlink,
never a FIFO or a device.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat

from layerstore.errors import BadInput, NotFound

from .libc import libc

# A sandbox can swap any path in its tree for a symlink, a FIFO or a device node at any moment; the
# host must never follow, block on or open what it planted. openat2(2) resolves a whole path in the
# kernel under rules (no symlink in any component, never above the starting directory, never across
# a mount), so nothing can be swapped between a check and the open. A file is first opened O_PATH
# (no open(2) reaches a device driver, no FIFO blocks), checked with fstat, and only a regular file
# is then reopened for reading through its descriptor (/proc/self/fd: the very inode checked).
SYS_OPENAT2 = 437  # x86_64 and the generic syscall table alike (Linux 5.6+)
RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE_STRICT = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV
SAFE_OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def openat2(dirfd: int, path: str | bytes, flags: int, mode: int = 0, resolve: int = 0) -> int:
    """openat2(2); the new descriptor, or OSError (ELOOP: a symlink on the way with
    RESOLVE_NO_SYMLINKS; EXDEV: the path leaves `dirfd` or crosses a mount)."""
    how = _OpenHow(flags, mode, resolve)
    fd = libc.syscall(SYS_OPENAT2, ctypes.c_long(dirfd), ctypes.c_char_p(os.fsencode(path)), ctypes.byref(how),
                      ctypes.c_size_t(ctypes.sizeof(how)))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), os.fsdecode(path))
    return int(fd)


def open_beneath(dirfd: int, relpath: str | bytes, flags: int = os.O_RDONLY, *,
                 resolve: int = RESOLVE_STRICT) -> int:
    """Open `relpath` below the directory `dirfd` without following a symlink in any component
    (a trailing one too: O_NOFOLLOW; with O_PATH the symlink itself is opened), never leaving
    `dirfd` and (by default) never crossing a mount; O_NONBLOCK, O_CLOEXEC and O_NOCTTY are
    added, so a FIFO does not block the open (with O_PATH only O_NOFOLLOW and O_CLOEXEC:
    openat2 refuses the others there). OSError as `openat2`."""
    extra = os.O_NOFOLLOW | os.O_CLOEXEC if flags & os.O_PATH else SAFE_OPEN_FLAGS
    return openat2(dirfd, relpath, flags | extra, 0, resolve)


_KIND_NAMES = {stat.S_IFDIR: "directory", stat.S_IFLNK: "symlink", stat.S_IFIFO: "FIFO", stat.S_IFSOCK: "socket",
               stat.S_IFCHR: "character device", stat.S_IFBLK: "block device"}


def _path_beneath(dirfd: int, relpath: str | bytes) -> int:
    """An O_PATH descriptor of `relpath` below `dirfd` (resolved as `open_beneath`: nothing is
    opened, no FIFO blocks, no driver is reached); `BadInput` for a symlink on the path or a path
    leaving `dirfd`, `NotFound` if absent."""
    name = os.fsdecode(relpath)
    try:
        return open_beneath(dirfd, relpath, os.O_PATH)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise BadInput(f"{name}: a symlink on the path (refused, not followed)") from None
        if e.errno == errno.EXDEV:
            raise BadInput(f"{name}: leaves its directory or crosses a mount (refused)") from None
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            raise NotFound(f"{name}: no such file") from None
        raise


def _regular(name: str, st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        kind = _KIND_NAMES.get(stat.S_IFMT(st.st_mode), "special file")
        raise BadInput(f"{name}: a {kind} where a regular file was expected (refused, not opened)")


def open_regular_beneath(dirfd: int, relpath: str | bytes, *, expect: tuple[int, int] | None = None) -> int:
    """A read-only descriptor (O_NONBLOCK, O_CLOEXEC) of the regular file `relpath` below
    `dirfd`, resolved as `open_beneath`; with `expect`, only if it is that (st_dev, st_ino) (the
    inode a walk's lstat saw). Refusals, never opening anything but the regular file checked:
    `BadInput` for a symlink anywhere on the path, a path leaving `dirfd`, any other type of
    file (FIFO, device, socket, directory) or another inode than `expect`; `NotFound` if absent."""
    name = os.fsdecode(relpath)
    pfd = _path_beneath(dirfd, relpath)
    try:
        st = os.fstat(pfd)
        _regular(name, st)
        if expect is not None and (st.st_dev, st.st_ino) != expect:
            raise BadInput(f"{name}: changed while it was read (another file is at its path now)")
        fd = os.open(f"/proc/self/fd/{pfd}", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    finally:
        os.close(pfd)
    return fd


def entry_path(dirfd: int, name: bytes) -> bytes:
    """A path naming the entry `name` of the open directory `dirfd` whatever happens to the
    directory's own path meanwhile (through its descriptor: /proc/self/fd); for the calls that
    take no directory descriptor (llistxattr, lgetxattr). `name` is one component."""
    if b"/" in name or name in (b"", b".", b".."):
        raise BadInput(f"{os.fsdecode(name)!r}: not one path component")
    return b"/proc/self/fd/%d/%s" % (dirfd, name)


def regular_size_beneath(root: str | os.PathLike[str], relpath: str | bytes, max_size: int) -> int | None:
    """The size of `relpath` below the directory `root` if it is a regular file of at most
    `max_size` bytes, None if it is absent; `BadInput` (naming it) for anything else: a symlink
    on the path, a path leaving `root` or crossing a mount, a FIFO, device, socket or directory,
    a larger file. Nothing is opened but O_PATH (a FIFO cannot block, a device is never reached):
    the check for a file that another program (a container runtime) will open later."""
    rel = os.fsencode(relpath).lstrip(b"/") or b"."
    name = os.fsdecode(rel)
    rootfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            pfd = _path_beneath(rootfd, rel)
        except NotFound:
            return None
    finally:
        os.close(rootfd)
    try:
        st = os.fstat(pfd)
    finally:
        os.close(pfd)
    _regular(name, st)
    if st.st_size > max_size:
        raise BadInput(f"{name}: larger than {max_size} bytes (refused)")
    return st.st_size


def read_regular_beneath(root: str | os.PathLike[str] | int, relpath: str | bytes, max_size: int) -> bytes:
    """The content of the regular file `relpath` (a leading "/" is taken as relative) below
    `root` (a directory path the caller trusts, or an open directory descriptor), opened as
    `open_regular_beneath`: never through a symlink, never a FIFO or device. More than
    `max_size` bytes is `BadInput`; an absent file is `NotFound`."""
    rel = os.fsencode(relpath).lstrip(b"/") or b"."
    rootfd = root if isinstance(root, int) else os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = open_regular_beneath(rootfd, rel)
    finally:
        if not isinstance(root, int):
            os.close(rootfd)
    try:
        chunks, got = [], 0
        while True:
            buf = os.read(fd, max_size + 1 - got)
            if not buf:
                break
            chunks.append(buf)
            got += len(buf)
            if got > max_size:
                raise BadInput(f"{os.fsdecode(rel)}: larger than {max_size} bytes (refused)")
        return b"".join(chunks)
    finally:
        os.close(fd)

