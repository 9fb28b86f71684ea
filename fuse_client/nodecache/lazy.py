"""The node cache filled lazily from the store: what every front end (the FUSE file system, a
fanotify listener) and the control socket use. It knows no transport: no FUSE, no HTTP.

`LazyCache` puts together the node cache (`NodeCache`: what is on this node's disk; it also
works offline, without a store), the fetcher (chunk maps and chunks from the store), the
counters and the access trace. A front end looks a blob up (`entry`), opens a `Reader` per open
file (`open_reader`; `Reader.read_cached` is the inline hot path, `read_missing` the slow one),
and may fetch ahead (`ensure`, `ensure_metadata`, `prefetch`). Maintenance (`ls`, `verify`,
`evict`, durable pins) is `NodeCache`'s, reachable as `.cache`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from layerstore.chunkmap import ChunkMap
from layerstore.errors import BadInput, LayerstoreError

from .cache import NodeCache
from .entry import BlobEntry
from .fetcher import DEFAULT_BATCH, DEFAULT_CONCURRENCY, DEFAULT_DEADLINE, ChunkSource, Fetcher
from .reader import DEFAULT_READAHEAD, MetadataHook, Reader
from .stats import Stats
from .trace import TraceRecorder

log = logging.getLogger("layerstore.fuse.cache")


class LazyCache:
    def __init__(self, cache: NodeCache, store: ChunkSource, *, nursery: trio.Nursery, stats: Stats | None = None,
                 trace: TraceRecorder | None = None, concurrency: int = DEFAULT_CONCURRENCY,
                 deadline: float = DEFAULT_DEADLINE, readahead: int = DEFAULT_READAHEAD,
                 guard: Callable[[str], Awaitable[None]] | None = None, batch: int | None = None) -> None:
        """`nursery`: where fetches run (a reader giving up must not cancel a fetch that others
        wait for); `concurrency`: the node's cap on store requests in flight; `batch`: chunks
        one batched read asks for where the store reads in batches (default
        `LAYERSTORE_FETCH_BATCH`, else 16; 1: one request a chunk);
        `readahead`: the largest window of a sequential stream, in chunks (0: none);
        `guard(blob)`: awaited before the cache relies on a blob for a lookup, a prefetch or a pin
        (the node lease's `NodeLease.guard`: docs/gc.md, the node side); reads of open files skip it."""
        self.cache = cache
        self.guard = guard
        self.stats = stats if stats is not None else Stats(gauges=cache.gauges)
        self.trace = trace
        self.readahead = readahead
        if batch is None:
            batch = fetch_batch_from_env()
        self.fetcher = Fetcher(store, cache, self.stats, nursery=nursery, concurrency=concurrency, deadline=deadline,
                               batch=batch)

    # -- blobs ---------------------------------------------------------------------------------
    async def entry(self, blob: str) -> BlobEntry:
        """The blob's entry, its chunk map fetched from the store on first use (`NotFound` if
        the store does not have it); the blob is counted in the stats from now on."""
        if self.guard is not None:
            await self.guard(blob)
        entry = await self.fetcher.entry(blob)
        self.stats.blob(blob, entry.size)
        return entry

    def blobs(self) -> list[tuple[str, int]]:
        """(blob, size) of every blob this node has seen, sorted (not the whole store)."""
        return self.cache.blobs()

    def open_reader(self, entry: BlobEntry, *, on_metadata_read: MetadataHook | None = None) -> Reader:
        """A reader of the blob, for one open file; `Reader.close` when the file is closed."""
        return Reader(entry, self.cache, self.fetcher, self.stats.blob(entry.blob, entry.size), self.trace,
                      self.readahead, on_metadata_read)

    # -- fetching ahead -------------------------------------------------------------------------
    async def ensure(self, entry: BlobEntry, idxs: list[int]) -> None:
        """Return once the chunks are present (missing ones fetched in parallel, at demand
        priority, pinned until then), or raise `CorruptObject` / `StoreUnavailable`."""
        self.cache.pin(entry, idxs)
        try:
            await self.fetcher.ensure(entry, idxs)
        finally:
            self.cache.unpin(entry, idxs)

    async def ensure_metadata(self, entry: BlobEntry) -> None:
        """Every metadata chunk present: an EROFS mount reads superblock, inodes and
        directories first, chunk by chunk; this fetches all of them in parallel at once."""
        if entry.metadata and entry.metadata_missing():
            await self.ensure(entry, entry.metadata)

    async def prefetch(self, blob: str, *, chunks: list[int] | None = None, ranges: list[Any] | None = None,
                       all_chunks: bool = False, wait: bool = False) -> dict[str, Any]:
        """Fetch chunks of a blob below demand priority (see `prefetch_order`), in the
        background, or waited for with `wait`."""
        if self.guard is not None:
            await self.guard(blob)
        entry = await self.fetcher.entry(blob)
        idxs = prefetch_order(entry.cmap, entry.metadata, chunks=chunks, ranges=ranges, all_chunks=all_chunks)
        if wait:
            done, failed = await self.fetcher.prefetch(entry, idxs)
            return {"blob": blob, "queued": len(idxs), "done": done, "failed": failed}
        self.fetcher.prefetch_soon(entry, idxs)
        return {"blob": blob, "queued": len(idxs)}

    # -- durable pins ---------------------------------------------------------------------------
    async def pin_blob(self, blob: str, holder: str) -> Path:
        """`Pins.pin_blob`, after fetching the chunk map of a blob the node has not seen
        (`NotFound` if the store lacks it; else `BlobIncomplete` says how much is missing)."""
        if self.guard is not None:
            await self.guard(blob)
        entry = self.cache.get(blob)
        if entry is None:
            entry = await self.fetcher.entry(blob)
        if entry.unverified_idxs():
            # A pin re-hashes every recovered chunk; it repairs what fails from the store when it
            # can (else `Pins.pin_blob` refuses: BlobIncomplete).
            bad = await self.cache.verifier.verify_all_unverified(entry)
            if bad:
                with contextlib.suppress(LayerstoreError):
                    await self.ensure(entry, bad)
        return await self.cache.pins.pin_blob(blob, holder)

    async def verify_pinned(self) -> None:
        """Re-hash the recovered chunks of every pinned blob (their files may be mounted
        directly, with no FUSE hop to verify a read), in the background, one blob after the
        other; a chunk that fails is logged (ERROR), loses its record and is fetched from the
        store again, which rewrites the verified bytes in place (what the direct mounts read)."""
        for blob in sorted(self.cache.holds.pinned):
            entry = self.cache.get(blob)
            if entry is None or not entry.unverified_idxs():
                continue
            bad = await self.cache.verifier.verify_all_unverified(entry)
            if bad:
                log.error("pinned blob %s: %d chunk(s) changed on disk since they were verified; fetching them again",
                          blob, len(bad))
                await self.fetcher.prefetch(entry, bad)


def fetch_batch_from_env() -> int:
    """`LAYERSTORE_FETCH_BATCH` (chunks a batched read asks for; 1 turns batching off), else 16."""
    raw = os.environ.get("LAYERSTORE_FETCH_BATCH", "")
    try:
        return max(1, int(raw)) if raw.strip() else DEFAULT_BATCH
    except ValueError:
        log.warning("LAYERSTORE_FETCH_BATCH=%r is not a number: batches of %d", raw, DEFAULT_BATCH)
        return DEFAULT_BATCH


def prefetch_order(cmap: ChunkMap, metadata: list[int], *, chunks: list[Any] | None = None,
                   ranges: list[Any] | None = None, all_chunks: bool = False) -> list[int]:
    """Chunk indexes to prefetch, in order, without repeats: every chunk (metadata first) for
    `all_chunks`, else the given chunk indexes, else the chunks of the given [offset, length]
    byte ranges, else the metadata chunks."""
    n = len(cmap.chunks)
    if all_chunks:
        meta = set(metadata)
        return list(metadata) + [i for i in range(n) if i not in meta]
    out: list[int] = []
    seen: set[int] = set()
    if chunks is not None:
        cand: list[int] = []
        for i in chunks:
            if not isinstance(i, int) or not 0 <= i < n:
                raise BadInput(f"chunk index {i!r} out of range for {cmap.blob} ({n} chunks)")
            cand.append(i)
    elif ranges is not None:
        cand = []
        for r in ranges:
            if not (isinstance(r, list | tuple) and len(r) == 2 and all(isinstance(x, int) and x >= 0 for x in r)):
                raise BadInput(f"bad range {r!r} (want [offset, length])")
            cand.extend(cmap.span(r[0], r[1]))
    else:
        cand = list(metadata)
    for i in cand:
        if i not in seen:
            seen.add(i)
            out.append(i)
    return out
