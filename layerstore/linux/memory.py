"""The page cache: which pages of a file are resident (mincore(2)) and how many bytes (cachestat(2)).
Benchmarks and the VM memory figures (runtime_shim.vm.hostmem) measure with these.
"""

from __future__ import annotations

import ctypes
import mmap
import os

from .libc import libc


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted",
                                               "nr_recently_evicted")]


libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
MAP_FAILED = ctypes.c_void_p(-1).value
SYS_CACHESTAT = 451  # x86_64 and most others (Linux 6.5+)
PAGE = mmap.PAGESIZE


def resident_pages(path: str | os.PathLike[str], *, follow: bool = False) -> bytes:
    """mincore(2) of a whole file: one byte per page, bit 0 set when the page is in the page cache
    (over a shared mapping of it, which faults nothing in). A symlink at `path` is refused
    (O_NOFOLLOW) unless `follow`."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW))
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return b""
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr == MAP_FAILED or addr is None:
            raise OSError(ctypes.get_errno(), f"mmap {os.fsdecode(path)}")
        try:
            vec = ctypes.create_string_buffer((size + PAGE - 1) // PAGE)
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore {os.fsdecode(path)}")
            return vec.raw
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def cached_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes of `path` in the page cache (cachestat(2)); 0 if it cannot be asked."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return 0
    try:
        rng, st = _CachestatRange(0, 0), _Cachestat()
        if libc.syscall(SYS_CACHESTAT, fd, ctypes.byref(rng), ctypes.byref(st), 0) != 0:
            return 0
        return int(st.nr_cache) * PAGE
    finally:
        os.close(fd)

