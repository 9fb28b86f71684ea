"""The node cache: shared by every reader on the node, persistent across daemon restarts.

State and ownership (see docs/fuse-client.md for the full protocol and the crash table):

- `BlobEntry.present[i]` (memory, trio thread only) says chunk i of a blob may be served (see
  `entry`); readers reach it only through `reader.Reader` and the methods of `BlobEntry`.
- `busy[(blob, i)]` (memory) holds the `Flight` of the one operation allowed on a position at a
  time: a fetch writing it (`begin_fetch`: a `FetchWriter` ends it with `commit` or `abort`), a
  check re-hashing it or an eviction punching it. Readers that need the position wait on it.
- The LMDB index (`index`) is the durable commit record, written only by the journal task
  (`run`), one batch at a time, in the order operations were made.

Commit: fetched bytes are pwritten to the data file (worker thread), then `commit` marks them
present (servable at once) and queues an index record; the journal syncs the data files of the
batch, then commits the batch to LMDB. Eviction: mark absent (no new reader can start), queue the
record's deletion, and punch the hole only after that deletion committed. A crash can therefore
leave data without a record (recovery punches it), never a record without data.

A record says the bytes were verified once, not that they still are: after a restart (a crash, or
someone writing to the data files meanwhile) recovery keeps recorded chunks as `unverified`, and
nothing serves them until they are re-hashed against the chunk map (`check_unverified`: by the
fetcher on first demand, by `pin_blob` before a direct mount, by `verify`). A clean close writes
the verified seal (`seal`): the next open serves at once the recorded chunks of every data file
that was not changed since (the seal is removed on open: a crash leaves none).

The parts, each a module mixed into `NodeCache`: durable pins and protected blobs (`pins`),
re-hashing recovered and cached chunks (`verify`), eviction (`evictor`, its policy in
`eviction`), forgetting unused blobs and idle maps (`forgetting`, its policy in `unused`). This
module keeps the core: entries, the journal (commit, flush), the background tasks, the stats.

Usage counts the bytes each chunk occupies on disk: its length in a plain cache, its stored
length (the zstd frame, or the plain bytes when kept raw) in a zstd cache.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import trio

from layerstore.chunkmap import ChunkMap

from . import frames, seal
from . import index as ci
from .cacheformat import format_named
from .entry import BlobEntry, Flight
from .eviction import Budget
from .evictor import Evictor
from .files import BlobFiles
from .forgetting import Forgetting
from .inflight import FetchWriter
from .pins import (  # noqa: F401 - re-exported
    MAX_HOLDER,
    PROTECTED_NAME,
    Pins,
    check_holder,
    protect_before_open,
    read_protected,
    write_protected,
)
from .verify import Verifier

log = logging.getLogger("layerstore.fuse.cache")

TOUCH_INTERVAL = 30.0
# Seconds a journal batch waits for more ops (group commit). Every batch costs an fdatasync of
# each data file it vouches for, a synchronous LMDB transaction (copy-on-write pages) and the
# ext4 journal commits they force: at 50 ms a burst whose fetches trickle in over a minute wrote
# ~8 MB of index pages for 55 MB of chunks, at 1 s 0.4 MB, and the node disk's journal and
# metadata writes fell by ~14 MB (docs/benchmarks-cache.md, "Node disk writes"). Nothing waits for a batch on
# the read path (chunks are served from memory at once) and whoever needs durability now (pins,
# eviction, shutdown) flushes itself; a crash loses at most this much of fetched chunks' records
# (the chunks are fetched again).
JOURNAL_GATHER = 1.0
RELEASE_INTERVAL = 1.0  # seconds between unmapping the pages that reads touched










class NodeCache(Pins, Verifier, Evictor, Forgetting):
    def __init__(self, root: Path, files: BlobFiles, index: ci.CacheIndex, *, budget: Budget | None = None,
                 clock: Callable[[], float] = time.time, cache_format: str = frames.PLAIN,
                 lru_bytes: int = frames.DEFAULT_LRU_BYTES, map_budget: int = 0) -> None:
        self.root = Path(root)
        # How chunks are stored (`cacheformat`): fixed for the directory's life (`cachedir`).
        self.chunk_format = format_named(cache_format)
        self.format = self.chunk_format.name
        # Decompressed chunks of a zstd cache (trio thread only); None in a plain cache.
        self.lru: frames.ChunkLRU | None = self.chunk_format.new_lru(lru_bytes)
        self.files = files
        self.index = index
        self.budget = budget
        self.clock = clock
        self.entries: dict[str, BlobEntry] = {}
        # Chunk-map entries the node keeps in memory (0: no limit): past it, adding a map forgets
        # the least recently used blobs nothing uses (`forget_idle_maps`; issue 27).
        self.map_budget = map_budget
        self.maps_forgotten = 0
        # Durable pins (LMDB "pins"): blob -> {holder: since}. A pinned blob's data file is an
        # image some holder mounted directly: nothing here modifies it (no eviction, no punch).
        self.pins: dict[str, dict[str, float]] = {}
        self._pin_log_at = float("-inf")
        self.busy: dict[tuple[str, int], Flight] = {}
        self.usage = 0
        self.evicted_chunks = 0
        self.evicted_bytes = 0
        self._pending: list[ci.Op] = []
        self._punches: list[tuple[str, list[tuple[int, int]]]] = []
        self._apply_lock = trio.Lock()
        self._journal_kick = trio.Event()
        self._evict_kick = trio.Event()
        self._episode = False
        self.journal_batches = 0
        self.journal_chunk_records = 0  # PutChunk records committed since start
        self._journal_failures = 0
        self.verified_chunks = 0  # recovered chunks whose bytes matched their digest again
        self.corrupt_cached_chunks = 0  # recovered or verified chunks whose bytes did not
        self.write_failures = 0  # chunk writes into the data files that failed
        self.disk_full = 0  # ... of them with ENOSPC (each kicks an eviction)
        self._disk_full = False
        self._disk_full_at = float("-inf")
        # blob -> when (wall clock) something beyond an open handle or a pin last used it, inf
        # while it is in use: set by the daemon (the node lease's view: lookups, prefetches, pins
        # in progress, mounts); for `gc_unused`.
        self.in_use: Callable[[], Mapping[str, float]] | None = None
        # Blobs whose data files a front end mounted directly (`protect`): never punched. Durable
        # (PROTECTED_NAME, written with the next journal batch once `_protected_dirty`).
        self.protected: set[str] = set()
        self._protected_dirty = False
        self._protected_logged = False  # "usage stays above the target because of protected blobs", once
        # Called on the trio thread with (blob, chunk indexes) just before chunks of a protected blob
        # become absent without a punch (found bad): the front end makes reads of them raise events
        # again and may fetch them again (docs/fanotify.md).
        self.on_unrecord: Callable[[str, list[int]], None] | None = None
        self.map_files = True  # data files may be mapped (see `disable_mapping`)

    def close(self) -> None:
        """Close every data file and write the verified seal (`seal`): what this process
        verified, and each data file's identity once no write can reach it any more."""
        entries = list(self.entries.values())
        for e in entries:
            e.stop_writes()
        sealed: dict[str, seal.Sealed] = {}
        try:
            stats = {e.blob: os.fstat(e.fd) for e in entries if 1 in e.present}
            seal.settle_clock([st.st_ctime_ns for st in stats.values()])
            for e in entries:
                if e.blob in stats:
                    sealed[e.blob] = seal.Sealed(seal.file_identity(os.fstat(e.fd)), seal.map_digest(e.cmap.encode()),
                                                 seal.runs_of(e.present))
        except OSError as err:
            log.warning("cache: no verified seal (%s): the next start re-hashes recovered chunks", err)
            sealed = {}
        for e in entries:
            e.close()
        self.entries.clear()
        if sealed:
            try:
                seal.write(self.root, sealed)
            except OSError as err:
                log.warning("cache: cannot write the verified seal (%s): the next start re-hashes recovered chunks",
                            err)

    # -- blobs ---------------------------------------------------------------------------
    def get(self, blob: str) -> BlobEntry | None:
        return self.entries.get(blob)

    def blobs(self) -> list[tuple[str, int]]:
        """(blob, size) of every blob this node has seen (whose chunk map it holds), sorted."""
        return sorted((blob, e.size) for blob, e in self.entries.items())

    def add_blob(self, cmap: ChunkMap) -> BlobEntry:
        entry = self.entries.get(cmap.blob)
        if entry is not None:
            return entry
        entry = self.new_entry(cmap, self.files.open(cmap.blob, cmap.size))
        self.entries[cmap.blob] = entry
        self._enqueue([ci.PutMap(cmap.blob, cmap.encode())])
        if self.map_budget:
            self.forget_idle_maps(keep=cmap.blob)
        return entry

    @property
    def compressed(self) -> bool:
        """A zstd cache (chunks kept as their store frames)."""
        return self.chunk_format.compressed

    @staticmethod
    def disk_bytes(entry: BlobEntry, i: int) -> int:
        """What chunk i of the blob occupies on disk (what usage and the budget count): its
        stored length in a zstd cache (`BlobEntry.stored`), its length in a plain one."""
        stored = entry.stored
        return stored[i] if stored is not None else entry.cmap.chunks[i].length

    def held_disk_bytes(self, entry: BlobEntry) -> int:
        """Disk bytes of the blob's chunks under a record (verified and unverified)."""
        if entry.stored is None:
            return entry.held_bytes()
        stored = entry.stored
        return sum(stored[i] for i, (p, u) in enumerate(zip(entry.present, entry.unverified, strict=True))
                   if p or u)

    def new_entry(self, cmap: ChunkMap, fd: int) -> BlobEntry:
        entry = self.chunk_format.new_entry(cmap, fd)
        entry.mappable = self.map_files and self.chunk_format.direct_image
        return entry

    # -- a zstd cache's chunks (`frames`) -------------------------------------------------------
    def chunk_bytes(self, entry: BlobEntry, i: int, keep: bool = True) -> bytes:
        """Trio thread, inline (the read hot path of a zstd cache): present chunk i's plain
        bytes, from the LRU or read, decompressed and re-hashed (then kept in the LRU if `keep`:
        a request for a whole chunk does not keep it, the kernel's page cache of the FUSE file
        does, and filling the LRU with whole chunks costs a fresh 1 MiB allocation per chunk). A
        chunk whose stored bytes do not match is dropped at once (`discard_corrupt`) and
        `frames.StoredChunkCorrupt` raised: the caller fetches it again or fails the read."""
        lru = self.lru
        assert lru is not None and entry.stored is not None
        key = (entry.blob, i)
        data = lru.get(key)
        if data is None:
            try:
                data = frames.read_stored(entry.fd, entry.cmap.chunks[i], entry.stored[i], entry.blob, i)
            except frames.StoredChunkCorrupt as e:
                self.discard_corrupt(entry, i, str(e))
                raise
            if keep:
                lru.put(key, data)
        return data

    def discard_corrupt(self, entry: BlobEntry, i: int, why: str) -> None:
        """Trio thread, no await: a present chunk whose stored bytes turned out wrong on a read is
        no longer served; its record's deletion is queued (no punch: a fetch of it writes the
        verified bytes over the same range, and its record is queued after this deletion; a
        crash before that leaves unrecorded bytes, which recovery punches)."""
        if not entry.present[i]:
            return
        if entry.blob in self.protected and self.on_unrecord is not None:
            self.on_unrecord(entry.blob, [i])
        entry.present[i] = 0
        self.usage -= self.disk_bytes(entry, i)
        self.corrupt_cached_chunks += 1
        if self.lru is not None:
            self.lru.discard((entry.blob, i))
        log.error("cache: %s; dropped, fetched again on the next read", why)
        self._enqueue([ci.DelChunk(entry.blob, i)])

    def disable_mapping(self) -> None:
        """Serve every read with pread, never a mapping of the data files (a front end that
        watches the files with fanotify needs this: `BlobEntry.mappable`). Before any read."""
        self.map_files = False
        for e in self.entries.values():
            e.mappable = False

    # -- readers ---------------------------------------------------------------------------
    def pin(self, entry: BlobEntry, idxs: Iterable[int]) -> None:
        pins = entry.pins
        for i in idxs:
            pins[i] = pins.get(i, 0) + 1

    def unpin(self, entry: BlobEntry, idxs: Iterable[int]) -> None:
        pins = entry.pins
        for i in idxs:
            n = pins[i] - 1
            if n:
                pins[i] = n
            else:
                del pins[i]
        if self._episode:
            self._evict_kick.set()

    # -- writers ---------------------------------------------------------------------------
    def in_flight(self, blob: str, i: int) -> Flight | None:
        """The operation in progress on chunk i of the blob (a fetch, a check, an eviction), if any."""
        return self.busy.get((blob, i))

    def begin_fetch(self, entry: BlobEntry, positions: list[int], priority: int) -> FetchWriter:
        """Trio thread: a fetch of the chunk at `positions` (one digest; none of them busy)
        starts: readers of them wait for it from now on (`inflight`). End it with the writer's
        `commit` or `abort`."""
        fl = Flight(priority, "fetch")
        busy, blob = self.busy, entry.blob
        for i in positions:
            assert (blob, i) not in busy, (blob, i)
            busy[(blob, i)] = fl
        return FetchWriter(busy, self.commit, entry, positions, fl)

    def commit(self, entry: BlobEntry, positions: Sequence[int]) -> None:
        """Trio thread, after `write_sync` returned: the positions become servable now and
        durable at the journal's next batch."""
        now = self.clock()
        ops: list[ci.Op] = []
        for i in positions:
            if entry.unverified[i]:  # its verified bytes were just written over it
                entry.unverified[i] = 0
                entry.present[i] = 1
            elif not entry.present[i]:
                entry.present[i] = 1
                self.usage += self.disk_bytes(entry, i)
            entry.last_use[i] = now
            ops.append(ci.PutChunk(entry.blob, i, now, entry.stored[i] if entry.stored is not None else 0))
        self._enqueue(ops)
        if self.budget is not None and (self._episode or self.usage > self.budget.high):
            self._evict_kick.set()

    def _enqueue(self, ops: list[ci.Op], punches: tuple[str, list[tuple[int, int]]] | None = None) -> None:
        self._pending.extend(ops)
        if punches is not None:
            assert punches[0] not in self.protected
            self._punches.append(punches)
        self._journal_kick.set()

    async def flush(self) -> None:
        """Return once everything queued before the call is committed to the index.

        Whoever holds the lock takes every queued op, in order, so batches never overtake each
        other: a chunk's record is deleted after it was put, and punched after it was deleted."""
        async with self._apply_lock:
            ops, punches = self._pending, self._punches
            self._pending, self._punches = [], []
            protected = sorted(self.protected) if self._protected_dirty else None
            self._protected_dirty = False
            if not ops and not punches and protected is None:
                return
            try:
                try:
                    # Not abandonable: a batch half-way through a commit must finish before exit.
                    await trio.to_thread.run_sync(self._apply_sync, ops, punches, protected)
                except Exception as e:
                    # A full disk: the reserve's blocks go to the index, so that the deletions
                    # eviction needs commit, and its punches free the disk (same batch, at once).
                    if not ci.is_disk_full(e) or not await trio.to_thread.run_sync(self.files.release_reserve):
                        raise
                    log.warning("cache journal: the disk is full; the index gets the reserved blocks")
                    await trio.to_thread.run_sync(self._apply_sync, ops, punches, protected)
                self.journal_batches += 1
                self.journal_chunk_records += sum(isinstance(op, ci.PutChunk) for op in ops)
            except Exception:
                # Nothing of the batch is lost: LMDB aborted it whole, and its ops go back to the
                # front of the queue for the next batch. Its punches are not retried: by then a
                # fetch may have written the range again (the bytes stay, unrecorded, until
                # recovery punches them).
                self._journal_failures += 1
                self._pending[:0] = ops
                if protected is not None:
                    self._protected_dirty = True  # (written with the next batch)
                log.exception("cache journal: a batch of %d op(s) failed (retried with the next batch; %d range(s) "
                              "left unpunched); the chunks stay served from memory", len(ops),
                              sum(len(r) for _, r in punches))

    def queue_touches(self) -> None:
        """Queue the last-use times of recently read blobs (off the read path, batched)."""
        ops: list[ci.Op] = []
        for e in self.entries.values():
            if e.use_dirty:
                e.use_dirty = False
                ops.extend(ci.Touch(e.blob, i, e.last_use[i]) for i, p in enumerate(e.present) if p)
        if ops:
            self._enqueue(ops)

    # -- background tasks --------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._journal_loop)
            nursery.start_soon(self._touch_loop)
            nursery.start_soon(self._release_loop)
            if self.budget is not None:
                nursery.start_soon(self._evict_loop)
                if self.usage > self.budget.high:
                    self._evict_kick.set()
            task_status.started()

    async def _journal_loop(self) -> None:
        """Group commit: a batch goes out `JOURNAL_GATHER` seconds after the first op queued
        since the last one (chunks are served from memory at once; only their durability
        waits), so a stream of fetches costs one fdatasync + LMDB transaction per interval, not
        per chunk. Callers that need durability now (pins, eviction) call `flush` themselves."""
        while True:
            await self._journal_kick.wait()
            await trio.sleep(JOURNAL_GATHER)
            self._journal_kick = trio.Event()
            await self.flush()

    def _apply_sync(self, ops: list[ci.Op], punches: list[tuple[str, list[tuple[int, int]]]],
                    protected: list[str] | None = None) -> None:
        if protected is not None:  # (before any punch of the batch: none of them is of a protected blob)
            write_protected(self.root, protected)
        # the bytes are durable before the record that vouches for them (one journal commit for all)
        self.files.sync_all({op.blob for op in ops if isinstance(op, ci.PutChunk)})
        self.index.apply(ops)
        for blob, ranges in punches:  # the records are gone before the bytes are
            self.files.punch(blob, ranges)
        if punches and not self.files.has_reserve():
            self.files.ensure_reserve()  # space was freed: hold some back for the index again

    async def _touch_loop(self) -> None:
        while True:
            await trio.sleep(TOUCH_INTERVAL)
            self.queue_touches()

    async def _release_loop(self) -> None:
        while True:
            await trio.sleep(RELEASE_INTERVAL)
            for e in self.entries.values():
                if e.mapped:
                    e.release_pages()

    async def shutdown_flush(self) -> None:
        """Final batch at a clean shutdown (shielded by the caller)."""
        self.queue_touches()
        await self.flush()

    # -- maintenance ---------------------------------------------------------------------------
    def gauges(self) -> dict[str, float]:
        """The cache's gauges for the metrics endpoint."""
        g: dict[str, float] = {
            "cache_used_bytes": self.usage,
            "cache_blobs": len(self.entries),
            "cache_busy_chunks": len(self.busy),
            "cache_evicted_chunks": self.evicted_chunks,
            "cache_evicted_bytes": self.evicted_bytes,
            "cache_unverified_chunks": sum(e.unverified.count(1) for e in self.entries.values()),
            "cache_verified_chunks": self.verified_chunks,
            "cache_corrupt_cached_chunks": self.corrupt_cached_chunks,
            "cache_write_failures": self.write_failures,
            "cache_disk_full": self.disk_full,
            "cache_protected_blobs": len(self.protected),
            "cache_protected_bytes": self.protected_bytes(),
            "cache_map_entries": self.map_entries(),
            "cache_maps_forgotten": self.maps_forgotten,
        }
        if self.lru is not None:
            g["cache_decompressed_lru_bytes"] = self.lru.size
            g["cache_decompressed_lru_hits"] = self.lru.hits
            g["cache_decompressed_lru_misses"] = self.lru.misses
        if self.budget is not None:
            g["cache_budget_bytes"] = self.budget.size
            g["cache_high_watermark_bytes"] = self.budget.high
            g["cache_low_watermark_bytes"] = self.budget.low
        return g

    def ls(self) -> dict[str, object]:
        blobs = []
        disk = 0
        unverified = 0
        for blob, e in sorted(self.entries.items()):
            n = sum(e.present)
            alloc = self.files.allocated_bytes(blob)
            disk += alloc
            held = e.held_bytes()
            unverified += held - e.cached_bytes()
            blobs.append({"blob": blob, "size": e.size, "chunks": len(e.present), "cached_chunks": n,
                          "cached_bytes": e.cached_bytes(), "stored_bytes": self.held_disk_bytes(e),
                          "protected": blob in self.protected, "unverified_chunks": sum(e.unverified),
                          "unverified_bytes": held - e.cached_bytes(), "disk_bytes": alloc, "open": e.open_count,
                          "complete": held == e.size, "pinned_by": sorted(self.pins.get(blob, ()))})
        pins = [{"blob": blob, "holder": h, "since": since, "path": str(self.files.path(blob).absolute())}
                for blob, holders in sorted(self.pins.items()) for h, since in sorted(holders.items())]
        return {"format": self.format, "used_bytes": self.usage, "disk_bytes": disk,
                "pinned_bytes": self.pinned_bytes(), "pins": pins,
                "protected_bytes": self.protected_bytes(), "protected": sorted(self.protected),
                "unverified_bytes": unverified, "verified_chunks": self.verified_chunks,
                "corrupt_cached_chunks": self.corrupt_cached_chunks, "write_failures": self.write_failures,
                "disk_full": self.disk_full,
                "budget": self.budget.to_json() if self.budget else None,
                "evicted_chunks": self.evicted_chunks, "evicted_bytes": self.evicted_bytes,
                "journal": {"batches": self.journal_batches, "chunk_records": self.journal_chunk_records,
                            "failures": self._journal_failures, "pending": len(self._pending)},
                "blobs": blobs}


