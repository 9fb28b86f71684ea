"""The node cache's data files: one sparse file per blob, each chunk's bytes at its offset in
the blob, so a cached read of any range is a single pread at the offset the kernel asked for.

A byte range of a data file means nothing until the cache index (`index`) says its chunk
is committed; ranges that are not committed are holes, or junk that recovery punches out.
Eviction punches holes (fallocate PUNCH_HOLE | KEEP_SIZE), which frees the blocks and keeps the
file's size. Punching only ever touches the bytes of the range given, so chunks that share a
filesystem block with their neighbours are safe to evict one by one.

Every function here is blocking file I/O and touches no shared Python state: callers run them
in worker threads (or inline on the read fast path, for pread).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from layerstore import digest as digestmod
from layerstore import linux
from layerstore.errors import LayerstoreError

from .errors import CacheIOError


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Deallocate [offset, offset+length) of a data file, keeping its size (`linux.punch_hole`)."""
    try:
        linux.punch_hole(fd, offset, length)
    except OSError as e:
        raise CacheIOError(str(e.strerror or e)) from None


RESERVE_BYTES = 1 << 20


class BlobFiles:
    """Where the data files live: DIR/data/<2 hex>/<64 hex>; and DIR/reserve, blocks held back
    for the index (see `ensure_reserve`)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root) / "data"
        self.reserve = Path(root) / "reserve"

    def ensure_reserve(self, nbytes: int = RESERVE_BYTES) -> bool:
        """Allocate the reserve file (blocks the data files cannot take): when the disk is full,
        releasing it lets the index commit the deletions that eviction needs before it may punch
        holes. False if the disk has no room for it now."""
        try:
            fd = os.open(self.reserve, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError:
            return False
        try:
            os.posix_fallocate(fd, 0, nbytes)
            return True
        except OSError:
            os.ftruncate(fd, 0)
            return False
        finally:
            os.close(fd)

    def has_reserve(self) -> bool:
        try:
            return os.stat(self.reserve).st_blocks > 0
        except OSError:
            return False

    def release_reserve(self) -> bool:
        """Free the reserve's blocks; False if it held none."""
        try:
            had = os.stat(self.reserve).st_blocks > 0
            os.truncate(self.reserve, 0)
            return had
        except OSError:
            return False

    def path(self, blob: str) -> Path:
        hexd = digestmod.hex_of(blob)
        return self.root / hexd[:2] / hexd

    def open(self, blob: str, size: int) -> int:
        """An O_RDWR descriptor for the blob's data file, created sparse at its full size."""
        path = self.path(blob)
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise CacheIOError(f"cannot open cache file {path}: {os.strerror(e.errno or 0)}") from None
        try:
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)
        except OSError as e:
            os.close(fd)
            raise CacheIOError(f"cannot size cache file {path}: {os.strerror(e.errno or 0)}") from None
        return fd

    def exists(self, blob: str) -> bool:
        return self.path(blob).is_file()

    def remove(self, blob: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(blob))

    def blobs(self) -> Iterator[str]:
        """Digests of every data file present (including ones the index does not know)."""
        if not self.root.is_dir():
            return
        for sub in sorted(self.root.iterdir()):
            if not sub.is_dir():
                continue
            for f in sorted(sub.iterdir()):
                try:
                    yield digestmod.from_hex(f.name)
                except LayerstoreError:
                    continue

    def sync_all(self, blobs: Iterable[str]) -> None:
        """Make the data written so far to these blobs' files durable (any descriptor of a file
        will do). Writeback of every file is started first and only then is each one
        fdatasync'ed: the blocks ext4 allocates for all of them at writeback land in one journal
        transaction, which the first fdatasync commits and the others find committed, instead
        of one commit per file (a journal batch touches many blobs in a burst; docs/benchmarks-cache.md,
        "Node disk writes")."""
        fds: list[int] = []
        try:
            for blob in blobs:
                try:
                    fds.append(os.open(self.path(blob), os.O_RDONLY | os.O_CLOEXEC))
                except FileNotFoundError:
                    continue
            if len(fds) > 1:
                for fd in fds:
                    linux.start_writeback(fd)
            for fd in fds:
                os.fdatasync(fd)
        finally:
            for fd in fds:
                os.close(fd)

    def punch(self, blob: str, ranges: list[tuple[int, int]]) -> None:
        """Punch (offset, length) ranges out of a blob's data file, if it still exists."""
        try:
            fd = os.open(self.path(blob), os.O_WRONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return
        try:
            for off, length in ranges:
                punch_hole(fd, off, length)
        finally:
            os.close(fd)

    def allocated_bytes(self, blob: str) -> int:
        try:
            return os.stat(self.path(blob)).st_blocks * 512
        except FileNotFoundError:
            return 0
