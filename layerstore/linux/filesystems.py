"""A file's filesystem and its blocks: statfs(2) (which filesystem holds a path, how big it is),
the sparse-file calls of the node cache (hole punching, SEEK_DATA) and writeback (sync_file_range,
syncfs).
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Iterator

from .libc import libc

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02

# statfs(2) f_type values (linux/magic.h)
OVERLAYFS_MAGIC = 0x794C7630
EROFS_MAGIC = 0xE0F5E1E2
FUSE_MAGIC = 0x65735546


class _Statfs(ctypes.Structure):
    _fields_ = [("f_type", ctypes.c_long), ("f_bsize", ctypes.c_long), ("f_blocks", ctypes.c_ulong),
                ("f_bfree", ctypes.c_ulong), ("f_bavail", ctypes.c_ulong), ("f_files", ctypes.c_ulong),
                ("f_ffree", ctypes.c_ulong), ("f_fsid", ctypes.c_int * 2), ("f_namelen", ctypes.c_long),
                ("f_frsize", ctypes.c_long), ("f_flags", ctypes.c_long), ("f_spare", ctypes.c_long * 4)]


libc.statfs.argtypes = [ctypes.c_char_p, ctypes.POINTER(_Statfs)]
libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
libc.fallocate.restype = ctypes.c_int
libc.syncfs.argtypes = [ctypes.c_int]
libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]


def fs_type(path: str | os.PathLike[str]) -> int | None:
    """statfs(2) f_type of the filesystem holding `path` (compare with *_MAGIC); None if unreadable."""
    buf = _Statfs()
    if libc.statfs(os.fsencode(path), ctypes.byref(buf)) != 0:
        return None
    return int(buf.f_type) & 0xFFFFFFFF


def fs_size(path: str | os.PathLike[str]) -> int:
    """Total bytes of the filesystem holding `path` (statvfs)."""
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize


# -- sparse files ---------------------------------------------------------------------------------
def punch_hole(fd: int, offset: int, length: int) -> None:
    """Deallocate [offset, offset+length) of a file, keeping its size; the range reads as zeros.
    OSError on failure."""
    if length <= 0:
        return
    if libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"punching a hole at {offset}+{length}: {os.strerror(err)}")


def data_extents(fd: int, size: int) -> Iterator[tuple[int, int]]:
    """(start, end) of the allocated regions of a sparse file, via SEEK_DATA/SEEK_HOLE."""
    pos = 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as e:
            if e.errno == errno.ENXIO:  # no data after pos
                return
            raise
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        if end <= start:
            return
        yield start, end
        pos = end


SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int) -> None:
    """sync_file_range(2) with SYNC_FILE_RANGE_WRITE over the whole file: start writing its dirty
    pages back without waiting (and, on ext4 with delayed allocation, allocate their blocks now).
    It makes nothing durable by itself. OSError on failure."""
    if libc.sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"sync_file_range: {os.strerror(err)}")


def syncfs(path: str | os.PathLike[str]) -> None:
    """syncfs(2): write back the whole filesystem holding `path`."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if libc.syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"syncfs {os.fsdecode(path)}: {os.strerror(err)}")
    finally:
        os.close(fd)

