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

The parts, each an object `NodeCache` constructs and owns, built with the core's narrow seam
(`core.Core`) and only the other collaborators it needs: `holds` (who pins or protects which
blob) and `pins` (changing them), `verifier` (re-hashing recovered and cached chunks), `evictor`
(eviction; its policy in `eviction`), `forgetting` (unused blobs and idle maps; its policy in
`unused`). Front ends call the parts directly (`cache.pins.pin_blob`, `cache.evictor.evict`, ...).
This module keeps the core: entries, the busy flights, usage, the journal (commit, flush), the
background tasks, the gauges.

Usage counts the bytes each chunk occupies on disk: its length in a plain cache, its stored
length (the zstd frame, or the plain bytes when kept raw) in a zstd cache.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Container, Iterable, Sequence
from pathlib import Path

import trio

from layerstore.chunkmap import ChunkMap

from . import frames, seal
from . import index as ci
from .cacheformat import format_named
from .core import Punch
from .entry import BlobEntry, Flight
from .eviction import Budget
from .evictor import Evictor
from .files import BlobFiles
from .forgetting import Forgetting
from .inflight import FetchWriter
from .pins import (  # noqa: F401 - re-exported
    MAX_HOLDER,
    PROTECTED_NAME,
    Holds,
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


class NodeCache:
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
        self.busy: dict[tuple[str, int], Flight] = {}
        self.usage = 0
        self.corrupt_cached_chunks = 0  # recovered, verified or read chunks whose bytes did not match
        self._pending: list[ci.Op] = []
        self._punches: list[Punch] = []
        self._protected_pending: list[str] | None = None  # the protected set to write with the next batch
        self._apply_lock = trio.Lock()
        self._journal_kick = trio.Event()
        self.journal_batches = 0
        self.journal_chunk_records = 0  # PutChunk records committed since start
        self._journal_failures = 0
        self.map_files = True  # data files may be mapped (see `disable_mapping`)
        # The parts (see the module doc): each gets this core through `core.Core` and nothing else
        # of the cache but what it names.
        self.holds = Holds()
        self.evictor = Evictor(self, self.holds, budget)
        self.verifier = Verifier(self, self.holds, self.evictor.drop)
        self.pins = Pins(self, self.holds, root=self.root, direct_image=self.chunk_format.direct_image,
                         verify_all=self.verifier.verify_all_unverified, evict_if_over=self.evictor.kick_if_over)
        self.forgetting = Forgetting(self, self.holds, map_budget)

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
        self.enqueue([ci.PutMap(cmap.blob, cmap.encode())])
        forgetting = self.forgetting
        if forgetting.map_budget:
            forgetting.forget_idle_maps(keep=cmap.blob)
        return entry

    def remove_blob(self, blob: str) -> int:
        """Trio thread, no await: take the blob out of the cache (its entry, data file and, at the
        next batch, its index records and map; the caller checked nothing uses it). Returns the
        bytes it held."""
        e = self.entries.pop(blob)  # a request from now on makes a fresh entry (and a fresh data file)
        held = self.held_disk_bytes(e)
        e.close()
        self.files.remove(blob)
        self.usage -= held
        self.enqueue([ci.DelBlob(blob)])  # after every record queued for it, before any new one
        return held

    def data_path(self, blob: str) -> Path:
        """The blob's data file."""
        return self.files.path(blob)

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

    def held_bytes(self, blobs: Container[str]) -> int:
        """Disk bytes held by the blobs among `blobs` (e.g. the pinned or protected ones)."""
        return sum(self.held_disk_bytes(e) for b, e in self.entries.items() if b in blobs)

    def release(self, entry: BlobEntry, idxs: Iterable[int]) -> int:
        """Trio thread, no await: chunks `idxs` of the blob (present or unverified) become absent
        (no reader starts on them) and leave usage; their records stay until the caller queues
        their deletion. Returns the disk bytes they held."""
        present, unverified = entry.present, entry.unverified
        n = 0
        for i in idxs:
            if present[i] or unverified[i]:
                present[i] = unverified[i] = 0
                n += self.disk_bytes(entry, i)
        self.usage -= n
        return n

    def count_corrupt(self, n: int) -> None:
        self.corrupt_cached_chunks += n

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
        self.holds.unrecording(entry.blob, [i])
        entry.present[i] = 0
        self.usage -= self.disk_bytes(entry, i)
        self.corrupt_cached_chunks += 1
        if self.lru is not None:
            self.lru.discard((entry.blob, i))
        log.error("cache: %s; dropped, fetched again on the next read", why)
        self.enqueue([ci.DelChunk(entry.blob, i)])

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
        evictor = self.evictor
        if evictor.episode:
            evictor.kick()

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
        self.enqueue(ops)
        budget, evictor = self.budget, self.evictor
        if budget is not None and (evictor.episode or self.usage > budget.high):
            evictor.kick()

    # -- the journal -------------------------------------------------------------------------
    def enqueue(self, ops: list[ci.Op], punches: Sequence[Punch] = ()) -> None:
        """Queue index ops and, after them, punches (never of a held blob) for the next batch."""
        self._pending.extend(ops)
        for punch in punches:
            assert not self.holds.held(punch[0]), punch[0]
            self._punches.append(punch)
        self._journal_kick.set()

    def queue_protected(self, blobs: list[str]) -> None:
        """The protected set (`pins.Holds.protected`) changed: write it with the next batch."""
        self._protected_pending = blobs
        self._journal_kick.set()

    async def flush_op(self, op: ci.Op) -> bool:
        """Queue one op and wait for its batch (with everything queued before it), shielded.
        False if a batch failed meanwhile: the op is then withdrawn (not retried)."""
        failures = self._journal_failures
        self.enqueue([op])
        with trio.CancelScope(shield=True):
            await self.flush()
        if self._journal_failures == failures:
            return True
        self._pending[:] = [o for o in self._pending if o is not op]
        return False

    async def flush(self) -> None:
        """Return once everything queued before the call is committed to the index.

        Whoever holds the lock takes every queued op, in order, so batches never overtake each
        other: a chunk's record is deleted after it was put, and punched after it was deleted."""
        async with self._apply_lock:
            ops, punches = self._pending, self._punches
            self._pending, self._punches = [], []
            protected, self._protected_pending = self._protected_pending, None
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
                if protected is not None and self._protected_pending is None:
                    self._protected_pending = protected  # (written with the next batch, unless changed since)
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
            self.enqueue(ops)

    # -- background tasks --------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._journal_loop)
            nursery.start_soon(self._touch_loop)
            nursery.start_soon(self._release_loop)
            if self.budget is not None:
                nursery.start_soon(self.evictor.run)
                self.evictor.kick_if_over()
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

    def _apply_sync(self, ops: list[ci.Op], punches: list[Punch],
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
        ev, holds, pins = self.evictor, self.holds, self.pins
        g: dict[str, float] = {
            "cache_used_bytes": self.usage,
            "cache_blobs": len(self.entries),
            "cache_busy_chunks": len(self.busy),
            "cache_evicted_chunks": ev.evicted_chunks,
            "cache_evicted_bytes": ev.evicted_bytes,
            "cache_unverified_chunks": sum(e.unverified.count(1) for e in self.entries.values()),
            "cache_verified_chunks": self.verifier.verified_chunks,
            "cache_corrupt_cached_chunks": self.corrupt_cached_chunks,
            "cache_write_failures": ev.write_failures,
            "cache_disk_full": ev.disk_full,
            "cache_protected_blobs": len(holds.protected),
            "cache_protected_bytes": pins.protected_bytes(),
            "cache_map_entries": self.forgetting.map_entries(),
            "cache_maps_forgotten": self.forgetting.maps_forgotten,
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
        ev, holds = self.evictor, self.holds
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
                          "protected": blob in holds.protected, "unverified_chunks": sum(e.unverified),
                          "unverified_bytes": held - e.cached_bytes(), "disk_bytes": alloc, "open": e.open_count,
                          "complete": held == e.size, "pinned_by": sorted(holds.pinned.get(blob, ()))})
        pins = [{"blob": blob, "holder": h, "since": since, "path": str(self.files.path(blob).absolute())}
                for blob, holders in sorted(holds.pinned.items()) for h, since in sorted(holders.items())]
        return {"format": self.format, "used_bytes": self.usage, "disk_bytes": disk,
                "pinned_bytes": self.pins.pinned_bytes(), "pins": pins,
                "protected_bytes": self.pins.protected_bytes(), "protected": sorted(holds.protected),
                "unverified_bytes": unverified, "verified_chunks": self.verifier.verified_chunks,
                "corrupt_cached_chunks": self.corrupt_cached_chunks, "write_failures": ev.write_failures,
                "disk_full": ev.disk_full,
                "budget": self.budget.to_json() if self.budget else None,
                "evicted_chunks": ev.evicted_chunks, "evicted_bytes": ev.evicted_bytes,
                "journal": {"batches": self.journal_batches, "chunk_records": self.journal_chunk_records,
                            "failures": self._journal_failures, "pending": len(self._pending)},
                "blobs": blobs}


