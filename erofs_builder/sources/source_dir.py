"""Entries from a directory tree on disk (I/O edge of the builder).

Depth-first, names sorted bytewise within each directory, so the same tree always gives the
same entries. Hard links are found by (st_dev, st_ino): the first path seen carries the data,
later ones become `hardlink` entries. Sparse files are read with SEEK_DATA/SEEK_HOLE and their
holes handed on as `Hole`s. File contents are read lazily, when the writer consumes them.

A tree someone else may be changing while it is read (a running sandbox's upper being committed)
is walked by `untrusted_entries` instead: through directory descriptors, one component at a
time, never following a symlink, opening nothing but a regular file it has just checked to be the
inode its walk saw (with openat2 beneath a directory: `layerstore.linux.beneath`).
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from layerstore.errors import BadInput, LayerstoreError
from layerstore.linux.beneath import entry_path, open_regular_beneath

from ..tree import Data, Entry, Hole, Kind

READ_SIZE = 1 << 20

_KINDS = {stat.S_IFDIR: Kind.DIR, stat.S_IFREG: Kind.REG, stat.S_IFLNK: Kind.SYMLINK, stat.S_IFCHR: Kind.CHR,
          stat.S_IFBLK: Kind.BLK, stat.S_IFIFO: Kind.FIFO, stat.S_IFSOCK: Kind.SOCK}


def read_xattrs(target: bytes | int) -> dict[bytes, bytes]:
    """The xattrs of a path (not followed if a symlink) or of an open descriptor."""
    kw = {} if isinstance(target, int) else {"follow_symlinks": False}
    try:
        names = os.listxattr(target, **kw)
    except OSError as e:
        if e.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            return {}
        raise
    out = {}
    for name in sorted(names):
        try:
            out[name.encode("utf-8", "surrogateescape")] = os.getxattr(target, name, **kw)
        except OSError as e:
            if e.errno in (errno.ENODATA, errno.ENOTSUP):
                continue  # removed meanwhile, or hidden from us
            raise
    return out


def file_data(path: bytes, size: int, sparse: bool) -> Data:
    """The content of a regular file as byte strings and `Hole`s, read when iterated."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        yield from fd_data(fd, size, sparse, path)
    finally:
        os.close(fd)


def fd_data(fd: int, size: int, sparse: bool, path: bytes) -> Data:
    """The first `size` bytes of an open regular file as byte strings and `Hole`s (the caller
    closes `fd`)."""
    pos = 0
    while pos < size:
        if sparse:
            try:
                data_at = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError as e:
                if e.errno != errno.ENXIO:
                    raise
                data_at = size  # only a hole is left
            data_at = min(data_at, size)
            if data_at > pos:
                yield Hole(data_at - pos)
                pos = data_at
                continue
            hole_at = min(os.lseek(fd, pos, os.SEEK_HOLE), size)
        else:
            hole_at = size
        while pos < hole_at:
            buf = os.pread(fd, min(READ_SIZE, hole_at - pos), pos)
            if not buf:
                raise BadInput(f"{os.fsdecode(path)}: file shrank while it was read")
            yield buf
            pos += len(buf)


SMALL_READ = 256 << 10  # regular files up to this size are read in one call when their entry is made


def _read_all(fd: int, size: int, path: bytes) -> bytes:
    buf = os.read(fd, size)
    while len(buf) < size:  # short reads are legal
        more = os.read(fd, size - len(buf))
        if not more:
            raise BadInput(f"{os.fsdecode(path)}: file shrank while it was read")
        buf += more
    return buf


def dir_entries(root: Path, *, all_root: bool = False) -> Iterator[tuple[Entry, Data | None]]:
    """Every path under `root` (root itself first, as b""), with its content for regular files.

    Each directory is listed through one descriptor and its entries are looked up relative to it
    (no walk of the whole path per entry); a small regular file is read in one call, and its
    xattrs listed through the same descriptor, when its entry is made."""
    top = os.fsencode(root)
    first_path: dict[tuple[int, int], bytes] = {}
    st = os.lstat(top)
    yield from _entry(b"", top, st, all_root, first_path)
    if not stat.S_ISDIR(st.st_mode):
        return
    # depth first, names sorted: (layer path prefix, disk path, sorted names, next index)
    stack: list[tuple[bytes, bytes, list[bytes], int]] = [(b"", top, sorted(os.listdir(top)), 0)]
    while stack:
        prefix, disk, names, i = stack.pop()
        dfd = os.open(disk, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            while i < len(names):
                name = names[i]
                i += 1
                path = prefix + name
                st = os.lstat(name, dir_fd=dfd)
                if (stat.S_ISREG(st.st_mode) and st.st_size <= SMALL_READ
                        and (st.st_nlink == 1 or (st.st_dev, st.st_ino) not in first_path)
                        and st.st_blocks * 512 >= st.st_size):
                    if st.st_nlink > 1:
                        first_path[(st.st_dev, st.st_ino)] = path
                    fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=dfd)
                    try:
                        xattrs = read_xattrs(fd)
                        buf = _read_all(fd, st.st_size, disk + b"/" + name) if st.st_size else b""
                    finally:
                        os.close(fd)
                    yield _make(path, Kind.REG, st, all_root, xattrs), (buf,)
                    continue
                sub = disk + b"/" + name
                yield from _entry(path, sub, st, all_root, first_path)
                if stat.S_ISDIR(st.st_mode):  # descend; come back to the next name afterwards
                    stack.append((prefix, disk, names, i))
                    stack.append((path + b"/", sub, sorted(os.listdir(sub)), 0))
                    break
        finally:
            os.close(dfd)


def _make(path: bytes, kind: Kind, st: os.stat_result, all_root: bool, xattrs: dict[bytes, bytes]) -> Entry:
    mtime_ns = st.st_mtime_ns
    return Entry(path=path, kind=kind, mode=stat.S_IMODE(st.st_mode), uid=0 if all_root else st.st_uid,
                 gid=0 if all_root else st.st_gid, mtime=mtime_ns // 1_000_000_000,
                 mtime_nsec=mtime_ns % 1_000_000_000, size=st.st_size if kind is Kind.REG else 0, xattrs=xattrs)


def _entry(rel: bytes, disk: bytes, st: os.stat_result, all_root: bool,
           first_path: dict[tuple[int, int], bytes]) -> Iterator[tuple[Entry, Data | None]]:
    """The entry for one path (any type), its content read lazily."""
    kind = _KINDS.get(stat.S_IFMT(st.st_mode))
    if kind is None:
        raise BadInput(f"{os.fsdecode(disk)}: unsupported file type")
    if kind is not Kind.DIR and st.st_nlink > 1:
        key = (st.st_dev, st.st_ino)
        if key in first_path:
            yield Entry(rel, kind, hardlink=first_path[key]), None
            return
        first_path[key] = rel
    entry = _make(rel, kind, st, all_root, read_xattrs(disk))
    data: Data | None = None
    if kind is Kind.REG:
        data = file_data(disk, st.st_size, st.st_blocks * 512 < st.st_size)
    elif kind is Kind.SYMLINK:
        entry.symlink = os.readlink(disk)
    elif kind in (Kind.CHR, Kind.BLK):
        entry.rdev = (os.major(st.st_rdev), os.minor(st.st_rdev))
    yield entry, data


# -- trees someone else may be changing (a running sandbox's upper) --------------------------------
DIR_OPEN = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def untrusted_entries(root: Path, *, all_root: bool = False) -> Iterator[tuple[Entry, Data | None]]:
    """`dir_entries` for a tree its owner may be changing while it is read, and whose owner may
    be hostile (a sandbox's upper): the same entries, in the same order, for a tree that holds
    still; for one that does not, sandbox content only or `BadInput`, never a hang.

    `root` itself is the caller's (followed as given). Below it every directory is opened from
    its parent's descriptor by one name with O_NOFOLLOW and checked to be the directory the
    walk's lstat saw; every regular file is opened with `open_regular_beneath` (openat2: no
    symlink on the path, never leaving the directory, nothing but the regular file checked) and checked
    likewise (content read later, for a large file, is opened again from the root, beneath it,
    and checked again); a symlink is recorded by readlinkat, never followed; nothing on another
    filesystem than the root's is taken. Whiteouts (character device 0/0), FIFOs and sockets are
    recorded as nodes and never opened; any other device node is refused (`BadInput`)."""
    top = os.fsencode(root)
    rootfd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    # depth first, names sorted: (layer path prefix, directory fd, sorted names, next index); every
    # fd on the stack is closed in the end, whatever happens
    stack: list[tuple[bytes, int, list[bytes], int]] = [(b"", rootfd, [], 0)]
    try:
        st = os.fstat(rootfd)
        walk = _UntrustedWalk(top, all_root, st.st_dev)
        stack[0] = (b"", rootfd, _names(rootfd), 0)
        yield _make(b"", Kind.DIR, st, all_root, read_xattrs(rootfd)), None
        while stack:
            prefix, dfd, names, i = stack[-1]
            if i == len(names):
                stack.pop()
                os.close(dfd)
                continue
            stack[-1] = (prefix, dfd, names, i + 1)
            path = prefix + names[i]
            entry, data, subfd = walk.entry(dfd, names[i], path)
            if subfd is not None:  # descend; come back to the next name afterwards
                stack.append((path + b"/", subfd, [], 0))
                stack[-1] = (path + b"/", subfd, _names(subfd), 0)
            yield entry, data
    finally:
        for _prefix, fd, _listed, _i in stack:
            os.close(fd)


def _names(dirfd: int) -> list[bytes]:
    """A directory's names, sorted bytewise (listing a descriptor gives str: back to bytes, lossless)."""
    return sorted(os.fsencode(name) for name in os.listdir(dirfd))


class _UntrustedWalk:
    def __init__(self, top: bytes, all_root: bool, dev: int) -> None:
        self.top, self.all_root, self.dev = top, all_root, dev
        self.first_path: dict[tuple[int, int], bytes] = {}

    def changed(self, path: bytes, why: object) -> BadInput:
        return BadInput(f"{os.fsdecode(path)}: changed while the tree was read ({why})")

    def entry(self, dfd: int, name: bytes, path: bytes) -> tuple[Entry, Data | None, int | None]:
        """The entry for `name` in the directory `dfd`, its content, and (a directory) its fd."""
        try:
            st = os.lstat(name, dir_fd=dfd)
        except OSError as e:
            raise self.changed(path, e.strerror) from None
        kind = _KINDS.get(stat.S_IFMT(st.st_mode))
        if kind is None:
            raise BadInput(f"{os.fsdecode(path)}: unsupported file type")
        if st.st_dev != self.dev:
            raise BadInput(f"{os.fsdecode(path)}: on another filesystem than the tree's root (refused)")
        if kind is Kind.BLK or (kind is Kind.CHR and st.st_rdev != 0):
            raise BadInput(f"{os.fsdecode(path)}: a device node ({os.major(st.st_rdev)}:{os.minor(st.st_rdev)}) "
                           "in an untrusted tree (refused, not opened; only 0:0 whiteouts are taken)")
        if kind is Kind.DIR:
            try:
                subfd = os.open(name, DIR_OPEN, dir_fd=dfd)
            except OSError as e:  # ELOOP: a symlink now; ENOTDIR: a file now
                raise self.changed(path, e.strerror) from None
            try:
                got = os.fstat(subfd)
                if (got.st_dev, got.st_ino) != (st.st_dev, st.st_ino):
                    raise self.changed(path, "another directory is at its path now")
                return _make(path, kind, got, self.all_root, read_xattrs(subfd)), None, subfd
            except BaseException:
                os.close(subfd)
                raise
        if st.st_nlink > 1:
            key = (st.st_dev, st.st_ino)
            if key in self.first_path:
                return Entry(path, kind, hardlink=self.first_path[key]), None, None
            self.first_path[key] = path
        if kind is Kind.REG:
            return *self.regular(dfd, name, path, st), None
        try:
            xattrs = read_xattrs(entry_path(dfd, name))  # llistxattr: nothing is opened
        except OSError as e:  # ENOENT: gone since the lstat
            raise self.changed(path, e.strerror) from None
        entry = _make(path, kind, st, self.all_root, xattrs)
        if kind is Kind.SYMLINK:
            try:
                entry.symlink = os.readlink(name, dir_fd=dfd)
            except OSError as e:  # EINVAL: not a symlink any more
                raise self.changed(path, e.strerror) from None
        elif kind is Kind.CHR:
            entry.rdev = (0, 0)
        return entry, None, None

    def open(self, dirfd: int, rel: bytes, path: bytes, st: os.stat_result) -> int:
        try:
            return open_regular_beneath(dirfd, rel, expect=(st.st_dev, st.st_ino))
        except LayerstoreError as e:
            raise self.changed(path, e) from None

    def regular(self, dfd: int, name: bytes, path: bytes, st: os.stat_result) -> tuple[Entry, Data]:
        fd = self.open(dfd, name, path, st)
        try:
            xattrs = read_xattrs(fd)
            sparse = st.st_blocks * 512 < st.st_size
            if st.st_size <= SMALL_READ and not sparse:
                buf = _read_all(fd, st.st_size, path) if st.st_size else b""
                return _make(path, Kind.REG, st, self.all_root, xattrs), (buf,)
        finally:
            os.close(fd)
        return _make(path, Kind.REG, st, self.all_root, xattrs), self.later(path, st, sparse)

    def later(self, path: bytes, st: os.stat_result, sparse: bool) -> Data:
        """A large file's content, read when the writer gets to it: opened again from the root,
        beneath it, and only if it is still the inode the walk saw."""
        rootfd = os.open(self.top, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fd = self.open(rootfd, path, path, st)
        finally:
            os.close(rootfd)
        try:
            yield from fd_data(fd, st.st_size, sparse, path)
        finally:
            os.close(fd)
