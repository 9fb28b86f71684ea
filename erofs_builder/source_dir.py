"""Entries from a directory tree on disk (I/O edge of the builder).

Depth-first, names sorted bytewise within each directory, so the same tree always gives the
same entries. Hard links are found by (st_dev, st_ino): the first path seen carries the data,
later ones become `hardlink` entries. Sparse files are read with SEEK_DATA/SEEK_HOLE and their
holes handed on as `Hole`s. File contents are read lazily, when the writer consumes them.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from layerstore.errors import BadInput

from .tree import Data, Entry, Hole, Kind

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
    finally:
        os.close(fd)


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
