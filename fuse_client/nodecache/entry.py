"""One blob in the node cache (`BlobEntry`) and one operation in progress on some of its chunk
positions (`Flight`). Both are mutated on the trio thread only; worker threads touch an entry
only through `write_sync` / `read_sync`, under its `io_lock`.

Front ends (FUSE, fanotify) read a blob's size and chunk map and call the methods below; the
fields (`present`, `last_use`, `pins`, `open_count`, `streams`, `fd`, ...) are the cache's own
(see docs/fuse-client.md, "Who owns which state").
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from array import array
from collections.abc import Container, Iterable, Sequence

import trio

from layerstore.chunkmap import ChunkMap
from layerstore.fileio import pwrite_all

from . import frames
from .readahead import Streams

log = logging.getLogger("layerstore.fuse.cache")


class Flight:
    """One operation in progress on some chunk positions; waiters block on `done`."""

    __slots__ = ("priority", "done", "error", "kind")

    def __init__(self, priority: int, kind: str) -> None:
        self.priority = priority
        self.kind = kind
        self.done = trio.Event()
        self.error: BaseException | None = None


class BlobEntry:
    """The cache's picture of one blob. Mutated only on the trio thread.

    `present[i]` says chunk i may be served: its bytes are in the blob's data file and were
    verified (hashed against the chunk map) since this process opened the cache. `unverified[i]`
    says chunk i was committed before (recovery found its record and its bytes) but has not been
    re-hashed yet: it counts as cached (disk usage, eviction) but is never served until the
    fetcher or a pin verifies it (`Verifier.check_unverified`). A cache hit
    is this lookup plus a pread of the data file, or, for a long sequential stream, a slice of
    its read-only mapping (`mapped_range`): then the kernel copies the bytes from the page cache
    into its reply, and the daemon copies nothing. The pages mapped that way are unmapped again
    by the cache's release loop (they stay in the page cache), so the daemon's resident size
    does not grow with what it served."""

    __slots__ = ("blob", "cmap", "fd", "present", "unverified", "last_use", "pins", "open_count", "metadata",
                 "is_meta", "use_dirty", "streams", "_positions", "view", "mapped",
                 "_map", "_map_failed", "io_lock", "closed", "mappable", "stored")

    def __init__(self, cmap: ChunkMap, fd: int, *, compressed: bool = False) -> None:
        n = len(cmap.chunks)
        self.blob = cmap.blob
        self.cmap = cmap
        self.fd = fd
        self.present = bytearray(n)
        self.unverified = bytearray(n)
        self.last_use = [0.0] * n
        self.pins: dict[int, int] = {}
        self.open_count = 0
        self.metadata = [i for i, c in enumerate(cmap.chunks) if c.metadata]
        self.is_meta = bytearray(1 if c.metadata else 0 for c in cmap.chunks)
        self.use_dirty = False
        self.streams = Streams()  # sequential readers of this blob (readahead)
        self._positions: dict[str, list[int]] | None = None
        # The data file mapped read-only (on first use): `mapped_range` answers long streams and misses.
        self.view: memoryview | None = None
        self.mapped = False  # pages may have been mapped by reads since the last `release_pages`
        self._map: mmap.mmap | None = None
        self._map_failed = False
        # Fetch threads may outlive their flight (abandoned at shutdown): they write under this
        # lock and only while the entry is open, so no write ever reaches a closed (and maybe
        # reused) descriptor.
        self.io_lock = threading.Lock()
        self.closed = False
        # False: never mapped (`NodeCache.disable_mapping`): with a fanotify pre-content mark on
        # the file, mmap(2) and page faults raise an event while CPython holds the GIL, and the
        # daemon's own event thread could never answer it.
        self.mappable = not compressed
        # A zstd cache (`frames`): the stored length of each written chunk (its frame, or its
        # plain length when kept raw), set when it is written or recovered; None in a plain cache.
        self.stored: array[int] | None = array("I", bytes(4 * n)) if compressed else None

    @property
    def size(self) -> int:
        return self.cmap.size

    def positions(self, digest: str) -> list[int]:
        """Every index of this blob whose chunk has `digest` (identical files share chunks)."""
        if self._positions is None:
            pos: dict[str, list[int]] = {}
            for i, c in enumerate(self.cmap.chunks):
                pos.setdefault(c.digest, []).append(i)
            self._positions = pos
        return self._positions.get(digest, [])

    def missing(self, idxs: Iterable[int]) -> list[int]:
        present = self.present
        return [i for i in idxs if not present[i]]

    def metadata_missing(self) -> list[int]:
        """The metadata chunks (METADATA in the chunk map) that are not cached."""
        return self.missing(self.metadata)

    def cached_bytes(self) -> int:
        """Bytes of verified (servable) chunks."""
        chunks = self.cmap.chunks
        return sum(chunks[i].length for i, p in enumerate(self.present) if p)

    def unverified_idxs(self) -> list[int]:
        """Recovered chunks not yet re-hashed (on disk, recorded, not servable)."""
        return [i for i, u in enumerate(self.unverified) if u]

    def held_bytes(self) -> int:
        """Bytes the blob holds on disk under a record: verified and unverified chunks."""
        chunks = self.cmap.chunks
        return sum(chunks[i].length for i, (p, u) in enumerate(zip(self.present, self.unverified, strict=True))
                   if p or u)

    def complete(self) -> bool:
        """Every chunk present (one scan of the bytearray in C: cheap enough per read event)."""
        return 0 not in self.present

    def missing_bytes(self) -> int:
        chunks = self.cmap.chunks
        return sum(chunks[i].length for i, p in enumerate(self.present) if not p)

    def metadata_near(self, i: int, max_bytes: int, skip: Container[int] = ()) -> list[int]:
        """Cached metadata chunk `i` and the cached metadata chunks nearest to it, up to about
        `max_bytes` in all, in index order, leaving out those in `skip`; [] if `i` itself is not
        cached or is in `skip`. (EROFS jumps between inodes and directories all over the
        metadata region: a reader of one metadata chunk reads the nearest ones soon.)"""
        present = self.present
        if not present[i] or i in skip:
            return []
        chunks = self.cmap.chunks
        idxs = [i]
        budget = max_bytes - chunks[i].length
        for j in sorted(self.metadata, key=lambda j: abs(j - i)):
            if budget <= 0:
                break
            if j != i and present[j] and j not in skip:
                idxs.append(j)
                budget -= chunks[j].length
        idxs.sort()
        return idxs

    # -- the data file ------------------------------------------------------------------------
    def map(self) -> memoryview | None:
        """The read-only view of the whole data file, mapped on first use; None if it cannot be
        mapped (e.g. vm.max_map_count reached): then reads fall back to pread."""
        if self.view is None and not self._map_failed and self.mappable and self.cmap.size:
            try:
                self._map = mmap.mmap(self.fd, self.cmap.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            except (OSError, ValueError) as e:
                log.warning("blob %s: cannot map the cache file (%s); serving it with pread", self.blob, e)
                self._map_failed = True
                return None
            self.view = memoryview(self._map)
        return self.view

    def mapped_range(self, off: int, end: int) -> memoryview | None:
        """Bytes [off, end) of the data file, a slice of its mapping (None if the file cannot be
        mapped). A fault on a page that is not in the page cache reads the device's whole
        readahead window around it, synchronously: right for a long sequential stream, a
        stall for a small read (see `reader.Reader.read_cached`)."""
        v = self.view if self.view is not None else self.map()
        if v is None:
            return None
        self.mapped = True
        return v[off:end]

    def read_sync(self, off: int, end: int) -> bytes:
        """Any thread: the blob's bytes [off, end); EBADF once the entry is closed (its
        descriptor may have been reused). A plain cache: a pread of the data file. A zstd cache:
        [off, end) must lie in written chunks; each is read, decompressed and checked against its
        digest (`frames.StoredChunkCorrupt`, an EIO, if it does not match)."""
        with self.io_lock:
            if self.closed:
                raise OSError(errno.EBADF, "the cache is closed")
            if self.stored is None:
                return os.pread(self.fd, end - off, off)
            cmap, stored = self.cmap, self.stored
            parts = []
            for i in cmap.span(off, end - off):
                ref = cmap.chunks[i]
                data = frames.read_stored(self.fd, ref, stored[i], self.blob, i)
                parts.append(memoryview(data)[max(off, ref.offset) - ref.offset:min(end, ref.end) - ref.offset])
            return b"".join(parts)

    def write_sync(self, positions: Sequence[int], payload: bytes | memoryview,
                   frame: bytes | memoryview | None = None) -> None:
        """Worker thread: put a chunk's bytes at each position (not yet servable: the cache's
        `commit` makes them so). A zstd cache writes `frame` (the store's verified zstd frame of
        `payload`) when it is smaller than the payload, else the payload (`frames.to_store`)."""
        chunks = self.cmap.chunks
        data = payload if self.stored is None else frames.to_store(payload, frame)
        with self.io_lock:
            if self.closed:
                raise OSError(errno.EBADF, "the cache is closed")
            for i in positions:
                pwrite_all(self.fd, data, chunks[i].offset)
                if self.stored is not None:  # the position is the caller's flight's: nobody reads this yet
                    self.stored[i] = len(data)

    def release_pages(self) -> None:
        """Unmap the pages reads touched (they stay in the page cache, reclaimable as usual).
        Trio thread only: a reply that uses the mapping is sent before any other task runs."""
        self.mapped = False
        if self._map is not None:
            self._map.madvise(mmap.MADV_DONTNEED)

    def stop_writes(self) -> None:
        """No write reaches the data file from now on (a fetch thread still writing finishes
        first); its descriptor stays open (the cache's seal takes the file's identity, `seal`)."""
        with self.io_lock:
            self.closed = True

    def close(self) -> None:
        self.stop_writes()
        if self._map is not None:
            assert self.view is not None
            try:
                self.view.release()
                self._map.close()
            except BufferError:  # a slice is still referenced somewhere: unmapped when it goes
                pass
            self._map = self.view = None
        os.close(self.fd)

    def touch(self, start: int, stop: int, now: float) -> None:
        lu = self.last_use
        for i in range(start, stop):
            lu[i] = now
        self.use_dirty = True
