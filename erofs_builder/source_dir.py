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


def read_xattrs(path: bytes) -> dict[bytes, bytes]:
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError as e:
        if e.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            return {}
        raise
    out = {}
    for name in sorted(names):
        try:
            out[name.encode("utf-8", "surrogateescape")] = os.getxattr(path, name, follow_symlinks=False)
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


def dir_entries(root: Path, *, all_root: bool = False) -> Iterator[tuple[Entry, Data | None]]:
    """Every path under `root` (root itself first, as b""), with its content for regular files."""
    top = os.fsencode(root)
    first_path: dict[tuple[int, int], bytes] = {}
    stack: list[tuple[bytes, bytes]] = [(b"", top)]  # (layer path, disk path)
    while stack:
        rel, disk = stack.pop()
        st = os.lstat(disk)
        kind = _KINDS.get(stat.S_IFMT(st.st_mode))
        if kind is None:
            raise BadInput(f"{os.fsdecode(disk)}: unsupported file type")
        if kind is not Kind.DIR and st.st_nlink > 1:
            key = (st.st_dev, st.st_ino)
            if key in first_path:
                yield Entry(rel, kind, hardlink=first_path[key]), None
                continue
            first_path[key] = rel
        entry = Entry(
            path=rel, kind=kind, mode=stat.S_IMODE(st.st_mode),
            uid=0 if all_root else st.st_uid, gid=0 if all_root else st.st_gid,
            mtime=st.st_mtime_ns // 1_000_000_000, mtime_nsec=st.st_mtime_ns % 1_000_000_000,
            xattrs=read_xattrs(disk),
        )
        data: Data | None = None
        if kind is Kind.REG:
            entry.size = st.st_size
            sparse = st.st_blocks * 512 < st.st_size
            data = file_data(disk, st.st_size, sparse)
        elif kind is Kind.SYMLINK:
            entry.symlink = os.readlink(disk)
        elif kind in (Kind.CHR, Kind.BLK):
            entry.rdev = (os.major(st.st_rdev), os.minor(st.st_rdev))
        yield entry, data
        if kind is Kind.DIR:
            names = sorted(os.listdir(disk))
            for name in reversed(names):
                stack.append((rel + b"/" + name if rel else name, disk + b"/" + name))
