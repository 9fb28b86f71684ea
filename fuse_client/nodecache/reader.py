"""A reader of one blob (one open file of a front end): the read path.

`read_cached` is the hot path: if every chunk of the range is present, it answers inline (no
await, no thread hop: a thread hop costs 2.5x on 2 cores) with a pread of the blob's data file or,
for a long sequential stream, a slice of its mapping; else it says None, and the front end awaits
`read_missing`, which fetches the missing chunks (pinned meanwhile) and answers the same way.
Both keep last use, readahead streams, counters and the access trace.

An answer is valid until the caller's next await: no eviction can slip in between (eviction
punches holes from the trio thread too). A caller that keeps an answer longer must copy it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from .cache import NodeCache
from .entry import BlobEntry
from .errors import CacheIOError
from .fetcher import Fetcher
from .frames import StoredChunkCorrupt
from .stats import BlobStats
from .trace import TraceRecorder

log = logging.getLogger("layerstore.fuse.fs")

DEFAULT_READAHEAD = 16  # chunks: the largest readahead window of a sequential stream
# A hit is served from the data file's mapping once its stream has read this much (see `read_cached`).
MAP_STREAM_MIN = 4 << 20

# Called on a cached read smaller than its chunk that falls in a metadata chunk, with the entry
# and the chunk index: a hint that the reader walks metadata a page at a time (EROFS reads
# inodes and directories so); a front end may hand the whole chunk over at once.
MetadataHook = Callable[[BlobEntry, int], None]


class Reader:
    """Made by `LazyCache.open_reader`; `close` when the front end's file is closed (the
    metadata chunks of blobs with open readers are evicted last)."""

    __slots__ = ("entry", "cache", "fetcher", "stats", "trace", "window", "on_metadata_read", "clock", "closed")

    def __init__(self, entry: BlobEntry, cache: NodeCache, fetcher: Fetcher, stats: BlobStats,
                 trace: TraceRecorder | None, window: int, on_metadata_read: MetadataHook | None) -> None:
        self.entry = entry
        self.cache = cache
        self.fetcher = fetcher
        self.stats = stats
        self.trace = trace
        self.window = window  # chunks: the largest readahead window
        self.on_metadata_read = on_metadata_read
        self.clock = cache.clock
        self.closed = False
        entry.open_count += 1

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.entry.open_count -= 1

    def read_cached(self, off: int, size: int) -> bytes | memoryview | None:
        """Bytes [off, off+size) (cut at the blob's end) if every chunk there is cached, else
        None (then `read_missing`). Inline on the calling thread; `CacheIOError` if the data
        file cannot be read.

        Where the pages are not in the page cache (a warm node cache after a reboot, or after
        reclaim), how they are read decides the speed. A pread reads ahead as the kernel does
        for any file: a small read reads little, a stream's windows grow and are read
        asynchronously. A fault on the mapping reads the device's whole readahead window
        around the page, synchronously (8 MiB, 5 ms, here), while the kernel waits for the
        reply: a stall for a small file, but large reads with large folios for a stream, and
        no copy in the daemon. So a request that continues a stream of `MAP_STREAM_MIN`
        bytes or more is a slice of the mapping, any other a pread (walk + hash of a tree of
        small files, warm, page cache dropped: 0.67 -> 0.85 of EROFS on a local file; 0.94
        with the 4 MiB kernel readahead, docs/benchmarks-read.md)."""
        # The hot path: one presence lookup and one pread (or a mapping slice), no call layers
        # beyond the streams' bookkeeping.
        e = self.entry
        cmap = e.cmap
        end = off + size
        if end > cmap.size:
            end = cmap.size
        if off >= end:
            return b""
        first = cmap.index_at(off)
        last = cmap.index_at(end - 1) + 1
        if e.present.find(0, first, last) >= 0:
            return None
        data: bytes | memoryview | None = None
        if e.stored is not None:  # a zstd cache: the LRU, else one pread of each frame, decompressed
            data = self.read_frames(off, end, first, last)
            if data is None:
                return None  # a stored frame was wrong: dropped; `read_missing` fetches it again
        elif e.streams.run_to(off) >= MAP_STREAM_MIN:
            data = e.mapped_range(off, end)
        if data is None:
            try:
                data = os.pread(e.fd, end - off, off)
            except OSError as err:
                raise self.read_error(off, end, err) from None
        now = self.clock()
        lu = e.last_use
        for i in range(first, last):
            lu[i] = now
        e.use_dirty = True
        if not e.is_meta[first]:  # metadata reads interleave with streams; they neither start nor end one
            w = e.streams.on_read(off, end, last, len(e.present), self.window, now, cmap.chunks[first].length)
            if w is not None:
                self.fetcher.readahead(e, w[0], w[1])
        elif self.on_metadata_read is not None and end - off < cmap.chunks[first].length:
            self.on_metadata_read(e, first)
        st = self.stats
        st.hits += 1
        st.served_bytes += len(data)
        if self.trace is not None:
            self.trace.record(e.blob, len(e.present), first, last)
        return data

    def _noted(self, off: int, end: int) -> range:
        """The chunks of [off, end) (not empty), recorded in the trace, with readahead started for
        a data read that continues a stream: before the caller waits, so the fetches overlap."""
        e = self.entry
        cmap = e.cmap
        first = cmap.index_at(off)
        last = cmap.index_at(end - 1) + 1
        if self.trace is not None:
            self.trace.record(e.blob, len(e.present), first, last)
        if not e.is_meta[first]:
            w = e.streams.on_read(off, end, last, len(e.present), self.window, self.clock(),
                                  cmap.chunks[first].length)
            if w is not None:
                self.fetcher.readahead(e, w[0], w[1])
        return range(first, last)

    async def read_missing(self, off: int, size: int) -> bytes | memoryview:
        """The slow path, after `read_cached` said None: pin the range's chunks (eviction skips
        pinned chunks), fetch the missing ones (in parallel, single-flight), answer with a slice
        of the mapping (the chunks just fetched were just written: their pages are in the page
        cache, nothing to read around them), unpin. `CorruptObject` / `StoreUnavailable` when
        the fetch fails."""
        e = self.entry
        end = min(off + size, e.cmap.size)
        if off >= end:
            return b""
        idxs = self._noted(off, end)
        self.cache.pin(e, idxs)
        try:
            await self.fetcher.ensure(e, idxs)
            # Present now, and nothing awaits before the reply.
            data: bytes | memoryview | None
            if e.stored is not None:
                data = self.read_frames(off, end, idxs.start, idxs.stop)
                if data is None:
                    raise CacheIOError(f"blob {e.blob}: a chunk just written at {off}+{end - off} reads back wrong")
            else:
                data = e.mapped_range(off, end)
            if data is None:
                try:
                    data = os.pread(e.fd, end - off, off)
                except OSError as err:
                    raise self.read_error(off, end, err) from None
        finally:
            self.cache.unpin(e, idxs)
        e.touch(idxs.start, idxs.stop, self.clock())
        self.stats.misses += 1
        self.stats.served_bytes += len(data)
        return data

    async def fill(self, off: int, size: int) -> None:
        """`read_missing` without the read: make the range's chunks present (fetched in
        parallel, single-flight, pinned meanwhile; readahead streams, counters and the trace kept
        as for a read) for a front end whose reader reads the data file itself (fanotify)."""
        e = self.entry
        end = min(off + size, e.cmap.size)
        if off >= end:
            return
        idxs = self._noted(off, end)
        missing = e.missing(idxs)
        if missing:
            self.cache.pin(e, idxs)
            try:
                await self.fetcher.ensure(e, idxs)
            finally:
                self.cache.unpin(e, idxs)
            self.stats.misses += 1
        else:
            self.stats.hits += 1
        e.touch(idxs.start, idxs.stop, self.clock())
        self.stats.served_bytes += end - off

    def read_frames(self, off: int, end: int, first: int, last: int) -> bytes | memoryview | None:
        """A zstd cache: bytes [off, end) of present chunks [first, last), each from the cache's
        LRU or decompressed and checked (`NodeCache.chunk_bytes`); None if one of them was wrong
        (it is dropped: no longer present)."""
        e = self.entry
        chunks = e.cmap.chunks
        try:
            if last - first == 1:
                ref = chunks[first]
                if off == ref.offset and end == ref.end:
                    return self.cache.chunk_bytes(e, first, keep=False)
                return memoryview(self.cache.chunk_bytes(e, first))[off - ref.offset:end - ref.offset]
            parts = []
            for i in range(first, last):
                ref = chunks[i]
                lo, hi = max(off, ref.offset), min(end, ref.end)
                data = self.cache.chunk_bytes(e, i, keep=lo > ref.offset or hi < ref.end)
                parts.append(memoryview(data)[lo - ref.offset:hi - ref.offset])
            return b"".join(parts)
        except StoredChunkCorrupt:
            return None
        except OSError as err:
            raise self.read_error(off, end, err) from None

    def read_error(self, off: int, end: int, err: OSError) -> CacheIOError:
        log.error("blob %s: reading the cache at %d+%d: %s", self.entry.blob, off, end - off, err)
        return CacheIOError(f"blob {self.entry.blob}: reading the cache at {off}+{end - off}: {err.strerror or err}")
