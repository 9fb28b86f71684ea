"""The node cache: shared by every reader on the node, persistent across daemon restarts.

State and ownership (see docs/fuse-client.md for the full protocol and the crash table):

- `BlobEntry.present[i]` (memory, trio thread only) says chunk i of a blob may be served (see
  `entry`); readers reach it only through `reader.Reader` and the methods of `BlobEntry`.
- `busy[(blob, i)]` (memory) holds the `Flight` of the one operation allowed on a position at a
  time: a fetch writing it or an eviction punching it. Readers that need the position wait on it.
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

Protected blobs (`protect`): a front end that mounts a blob's data file directly and sees only the
start of each read (fanotify: after its answer the kernel's read goes on without it) cannot know
when a read of a chunk has finished; a punch under such a read would hand it a hole (zeros). So
nothing punches a protected blob's file: eviction skips its chunks and picks other blobs, and a
chunk found bad loses its record without a punch (`on_unrecord` tells the front end). The set is
durable (PROTECTED_NAME, written by the journal), so recovery and the first eviction of a
restarted daemon leave the files alone before the front end takes them back.

Usage counts the bytes each chunk occupies on disk: its length in a plain cache, its stored
length (the zstd frame, or the plain bytes when kept raw) in a zstd cache.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import blake3
import trio

from layerstore import digest as digestmod
from layerstore.chunkmap import ChunkMap
from layerstore.errors import BadInput, ConfigError, LayerstoreError
from layerstore.fileio import fsync_dir

from . import frames, seal
from . import index as ci
from .entry import BlobEntry, Flight
from .errors import BlobIncomplete, BlobPinned, CacheIOError, NoPlainImage
from .eviction import Budget, Candidate, choose_victims
from .files import BlobFiles
from .limiter import DEMAND
from .unused import BlobUse, choose_over_budget, choose_unused

log = logging.getLogger("layerstore.fuse.cache")

TOUCH_INTERVAL = 30.0
# Seconds a journal batch waits for more ops (group commit). Every batch costs an fdatasync of
# each data file it vouches for, a synchronous LMDB transaction (copy-on-write pages) and the
# ext4 journal commits they force: at 50 ms a burst whose fetches trickle in over a minute wrote
# ~8 MB of index pages for 55 MB of chunks, at 1 s 0.4 MB, and the node disk's journal and
# metadata writes fell by ~14 MB (docs/fuse-client.md, "Node disk writes"). Nothing waits for a batch on
# the read path (chunks are served from memory at once) and whoever needs durability now (pins,
# eviction, shutdown) flushes itself; a crash loses at most this much of fetched chunks' records
# (the chunks are fetched again).
JOURNAL_GATHER = 1.0
SETTLE = 0.5  # seconds without commits that end an eviction episode
RELEASE_INTERVAL = 1.0  # seconds between unmapping the pages that reads touched
PIN_LOG_INTERVAL = 60.0  # at most one "budget not met because of pins" warning per this many seconds
VERIFY_BATCH_BYTES = 32 << 20  # recovered chunks re-hashed per worker-thread call (held busy meanwhile)
DISK_FULL_INTERVAL = 1.0  # at most one disk-full eviction per this many seconds
MAX_HOLDER = 256  # bytes of a pin holder's name (utf-8)
PROTECTED_NAME = "protected.json"  # the protected blobs, {"blobs": [...]} (see `protect`)


def read_protected(root: Path) -> set[str]:
    """The protected blobs recorded in the cache directory (a missing or unreadable file: none)."""
    try:
        data = json.loads((Path(root) / PROTECTED_NAME).read_text())
        return {digestmod.parse(b) for b in data["blobs"]}
    except FileNotFoundError:
        return set()
    except (OSError, ValueError, KeyError, TypeError, LayerstoreError) as e:
        log.error("cache: %s is unreadable (%s): no blob is protected from punches until a front end "
                  "protects its mounted blobs again", Path(root) / PROTECTED_NAME, e)
        return set()


def write_protected(root: Path, blobs: Iterable[str]) -> None:
    """Blocking: PROTECTED_NAME replaced atomically (synced, then renamed, the directory synced)."""
    path = Path(root) / PROTECTED_NAME
    tmp = path.with_name(f".{PROTECTED_NAME}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, json.dumps({"blobs": sorted(blobs)}).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def protect_before_open(root: Path, blobs: Iterable[str]) -> None:
    """Blocking, before the cache is opened: make sure `blobs` are recorded as protected, so that
    recovery and the first evictions leave their files alone (a front end with mounts that outlived
    its daemon: they may have been attached by a version that did not record protections)."""
    want = {digestmod.parse(b) for b in blobs}
    have = read_protected(root)
    if not want <= have:
        write_protected(root, have | want)


def check_holder(holder: object) -> str:
    if not isinstance(holder, str) or not holder or len(holder.encode()) > MAX_HOLDER:
        raise BadInput(f"a pin holder is a non-empty string of at most {MAX_HOLDER} bytes, got {holder!r}")
    return holder


class NodeCache:
    def __init__(self, root: Path, files: BlobFiles, index: ci.CacheIndex, *, budget: Budget | None = None,
                 clock: Callable[[], float] = time.time, cache_format: str = frames.PLAIN,
                 lru_bytes: int = frames.DEFAULT_LRU_BYTES, map_budget: int = 0) -> None:
        self.root = Path(root)
        # How chunks are stored (`frames`): fixed for the directory's life (`cachedir`).
        self.format = cache_format
        # Decompressed chunks of a zstd cache (trio thread only); None in a plain cache.
        self.lru: frames.ChunkLRU | None = frames.ChunkLRU(lru_bytes) if self.compressed else None
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

    def map_entries(self) -> int:
        """Entries of the chunk maps held in memory (each ~`chunkmap.DECODED_ENTRY` bytes)."""
        return sum(len(e.cmap.chunks) for e in self.entries.values())

    def forget_idle_maps(self, keep: str | None = None) -> list[str]:
        """Trio thread, no await: while the maps held exceed `map_budget` entries, forget the
        least recently used blobs that nothing uses (`forget_blob`: the map, the cached chunks,
        the data file; a later lookup fetches the map again), never `keep`. Returns them."""
        sizes = {blob: len(e.cmap.chunks) for blob, e in self.entries.items()}
        if sum(sizes.values()) <= self.map_budget:
            return []
        forgotten = [u.blob for u in choose_over_budget(self.blob_uses(), sizes, self.map_budget, keep)
                     if self.forget_blob(u.blob) is not None]
        if forgotten:
            self.maps_forgotten += len(forgotten)
            log.info("cache: forgot %d unused blob(s) to keep chunk maps within %d entries (%d held)",
                     len(forgotten), self.map_budget, self.map_entries())
        return forgotten

    @property
    def compressed(self) -> bool:
        """A zstd cache (chunks kept as their store frames)."""
        return self.format == frames.ZSTD

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
        entry = BlobEntry(cmap, fd, compressed=self.compressed)
        entry.mappable = self.map_files and not self.compressed
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

    # -- durable pins (direct mounts of complete blobs) ----------------------------------------
    async def pin_blob(self, blob: str, holder: str) -> Path:
        """Record that `holder` uses the blob's data file as an image, and return the file's
        path. Only a complete blob (every chunk committed) can be pinned: `BlobIncomplete`
        otherwise, and nothing is recorded. When this returns, the pin and every chunk record
        of the blob are committed (the data synced before them), so the file is the image,
        durably; from then on eviction, `verify` and recovery leave the file's bytes alone."""
        check_holder(holder)
        if self.compressed:
            raise NoPlainImage(f"blob {blob}: the node cache {self.root} keeps chunks compressed (format zstd): "
                               f"it has no plain image file to mount directly; mount the daemon's file of the blob")
        e = self.entries.get(blob)
        if e is None:
            raise BlobIncomplete(f"blob {blob} is not in the node cache", None)
        # The kernel will read the file with no FUSE hop: every recovered chunk is re-hashed
        # first; a bad one is dropped, and the blob is then incomplete.
        await self.verify_all_unverified(e)
        missing = e.missing_bytes()
        if missing:
            raise BlobIncomplete(f"blob {blob} is not complete in the node cache: {missing} byte(s) missing",
                                 missing)
        # No await between the check and this: no eviction can start on the blob in between.
        holders = self.pins.setdefault(blob, {})
        before = holders.get(holder)
        holders[holder] = self.clock()
        await self._commit_pin_change(ci.PutPin(blob, holder, holders[holder]),
                                      lambda: self._restore_pin(blob, holder, before))
        return self.files.path(blob).absolute()

    async def unpin_blob(self, blob: str, holder: str) -> bool:
        """Drop `holder`'s pin (durably); False if it had none (idempotent). The blob's chunks
        become evictable again once no holder is left."""
        check_holder(holder)
        holders = self.pins.get(blob)
        if not holders or holder not in holders:
            return False
        before = holders.pop(holder)
        if not holders:
            del self.pins[blob]
            e = self.entries.get(blob)
            if e is not None:  # its last use is now: a direct mount read it without a FUSE hop
                e.touch(0, len(e.present), self.clock())
        await self._commit_pin_change(ci.DelPin(blob, holder), lambda: self._restore_pin(blob, holder, before))
        if self.budget is not None and self.usage > self.budget.high:
            self._evict_kick.set()
        return True

    def _restore_pin(self, blob: str, holder: str, since: float | None) -> None:
        if since is None:
            holders = self.pins.get(blob, {})
            holders.pop(holder, None)
            if not holders:
                self.pins.pop(blob, None)
        else:
            self.pins.setdefault(blob, {})[holder] = since

    async def _commit_pin_change(self, op: ci.Op, undo: Callable[[], None]) -> None:
        """Queue a pin op and wait for its batch (with every chunk record queued before it);
        if a journal batch failed meanwhile, undo the change in memory and fail."""
        failures = self._journal_failures
        self._enqueue([op])
        with trio.CancelScope(shield=True):
            await self.flush()
        if self._journal_failures != failures:
            self._pending[:] = [o for o in self._pending if o is not op]  # not retried: the caller is told
            undo()
            raise CacheIOError(f"cannot record the pin change of blob {op.blob} in the cache index (see the log)")

    def holders(self, blob: str) -> list[str]:
        """Who pins the blob (sorted; [] if nobody)."""
        return sorted(self.pins.get(blob, ()))

    def pinned_bytes(self) -> int:
        return sum(self.held_disk_bytes(e) for b, e in self.entries.items() if b in self.pins)

    # -- protected blobs (mounted directly by a front end that cannot see a read end) -------------
    async def protect(self, blob: str) -> None:
        """From when this returns until `unprotect`, nothing punches the blob's data file (nor
        removes it): no eviction (budget, explicit, disk full), no `verify`, no recovery. An
        eviction of the blob already under way finishes first: its chunks were made absent and
        its punches queued in one step (no await in between), so the flush here, which waits
        for any batch being applied and applies what is queued, returns after its last punch.
        Durable when this returns (a restart's recovery and first eviction leave the file alone)."""
        digestmod.parse(blob)
        if blob not in self.protected:
            self.protected.add(blob)
            self._protected_dirty = True
        with trio.CancelScope(shield=True):
            await self.flush()

    def unprotect(self, blob: str) -> None:
        """Trio thread, no await: the blob is evictable again (its mounts are gone); recorded
        with the next journal batch (a crash before: it stays protected until a front end
        settles the set, `settle_protected`)."""
        if blob in self.protected:
            self.protected.discard(blob)
            self._protected_dirty = True
            self._journal_kick.set()
            if self.budget is not None and self.usage > self.budget.high:
                self._evict_kick.set()

    def settle_protected(self, keep: set[str]) -> list[str]:
        """Trio thread: unprotect every protected blob not in `keep` (a front end at start-up, with
        the blobs it mounted: protections a crash left behind go). Returns those unprotected."""
        gone = sorted(self.protected - keep)
        for blob in gone:
            self.unprotect(blob)
        return gone

    def protected_bytes(self) -> int:
        """Disk bytes held by protected blobs (eviction cannot free them while they are protected)."""
        return sum(self.held_disk_bytes(e) for b, e in self.entries.items() if b in self.protected)


    # -- recovered chunks: re-hashed before they are served ----------------------------------------
    async def check_unverified(self, entry: BlobEntry, positions: Sequence[int]) -> tuple[list[int], list[int]]:
        """Re-hash recovered chunks against the chunk map (worker thread); the caller holds a
        flight on every position in `busy` (so no eviction or other check touches them). A
        match becomes present (servable, no store fetch); a mismatch is dropped (record
        deleted, bytes punched unless the blob is pinned), counted and logged, before this
        returns, so the caller may write verified bytes there. Returns (good, bad)."""
        positions = [i for i in positions if entry.unverified[i]]
        if not positions:
            return [], []
        wrong = await trio.to_thread.run_sync(_rehash, entry, positions)
        bad = set(wrong)
        good = [i for i in positions if i not in bad]
        for i in good:
            entry.unverified[i] = 0
            entry.present[i] = 1
        self.verified_chunks += len(good)
        if wrong:
            await self._discard_unverified(entry, wrong)
        return good, wrong

    async def _discard_unverified(self, entry: BlobEntry, idxs: Sequence[int]) -> None:
        chunks = entry.cmap.chunks
        pinned = entry.blob in self.pins
        for i in idxs:
            entry.unverified[i] = 0
            self.usage -= self.disk_bytes(entry, i)
            log.error("cache: blob %s chunk %d (%s): the cached bytes do not match the digest (changed since they "
                      "were verified); %s", entry.blob, i, chunks[i].digest,
                      "record dropped, not punched (the blob is pinned: its direct mounts read these bytes "
                      "until the chunk is fetched again)" if pinned else "dropped")
        self.corrupt_cached_chunks += len(idxs)
        ops: list[ci.Op] = [ci.DelChunk(entry.blob, i) for i in idxs]
        # (a protected blob's bytes stay too: a fetch writes the verified bytes over them)
        keep = pinned or entry.blob in self.protected
        self._enqueue(ops, None if keep else (entry.blob, [(chunks[i].offset, chunks[i].length) for i in idxs]))
        with trio.CancelScope(shield=True):
            await self.flush()  # punched before the caller writes anything there

    async def verify_unverified(self, entry: BlobEntry) -> tuple[list[int], list[int]]:
        """Re-hash the blob's recovered chunks that no flight holds, in batches of about
        `VERIFY_BATCH_BYTES` (each batch held busy, so readers of it wait for it only).
        Returns (good, bad) over all batches."""
        good: list[int] = []
        bad: list[int] = []
        busy, blob, chunks = self.busy, entry.blob, entry.cmap.chunks
        todo = [i for i in entry.unverified_idxs() if (blob, i) not in busy]
        while todo:
            batch: list[int] = []
            size = 0
            while todo and size < VERIFY_BATCH_BYTES:
                i = todo.pop(0)
                if entry.unverified[i] and (blob, i) not in busy:
                    batch.append(i)
                    size += chunks[i].length
            if not batch:
                continue
            fl = Flight(DEMAND, "verify")
            for i in batch:
                busy[(blob, i)] = fl
            try:
                g, b = await self.check_unverified(entry, batch)
            finally:
                for i in batch:
                    if busy.get((blob, i)) is fl:
                        del busy[(blob, i)]
                fl.done.set()
            good += g
            bad += b
        return good, bad

    async def verify_all_unverified(self, entry: BlobEntry) -> list[int]:
        """`verify_unverified`, then wait for flights that held some of them (a fetch verifies
        what it holds) until no recovered chunk of the blob is left. Returns the bad ones."""
        bad: list[int] = []
        while True:
            bad += (await self.verify_unverified(entry))[1]
            held = [self.busy[(entry.blob, i)] for i in entry.unverified_idxs() if (entry.blob, i) in self.busy]
            if not held:
                return bad
            await held[0].done.wait()

    # -- writers ---------------------------------------------------------------------------
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

    # -- eviction ----------------------------------------------------------------------------
    async def _next_kick(self) -> None:
        await self._evict_kick.wait()
        self._evict_kick = trio.Event()

    async def _evict_loop(self) -> None:
        """Watermark eviction. Crossing the high watermark starts an episode: evict to the low
        watermark now, again whenever commits push usage half-way back up to the high watermark,
        and once more when the cache has been quiet for `SETTLE` seconds, so that usage ends
        under the low watermark."""
        assert self.budget is not None
        while True:
            await self._next_kick()
            if self._disk_full:
                self._disk_full = False
                # The disk filled before the budget did (other files share it, or the budget is
                # larger than the disk): give back a quarter of what the cache holds, at once.
                await self.evict_to(min(self.budget.low, int(self.usage * self.budget.low_fraction
                                                              / self.budget.high_fraction)))
            if self.usage <= self.budget.high:
                continue
            self._episode = True
            # While fetches keep coming, evict in batches (each pass sorts every cached chunk).
            midpoint = (self.budget.low + self.budget.high) // 2
            try:
                await self.evict_to(self.budget.low)
                while True:
                    if self.usage > midpoint:
                        await self.evict_to(self.budget.low)
                    quiet = True
                    with trio.move_on_after(SETTLE):
                        await self._next_kick()
                        quiet = False
                    if quiet:
                        n, _ = await self.evict_to(self.budget.low)
                        if self.usage <= self.budget.low or n == 0:
                            break
            finally:
                self._episode = False
            if self.usage > self.budget.high:
                # Stuck above the budget (pinned or protected blobs hold it): every commit would
                # start another pass over every cached chunk; one per SETTLE is enough.
                await trio.sleep(SETTLE)

    def write_failed(self, err: int | None) -> None:
        """A chunk could not be written to the data files (the fetcher calls this). With
        ENOSPC the disk is full: evict (at most once per `DISK_FULL_INTERVAL`); a punch frees
        blocks on a full disk, so eviction works there."""
        self.write_failures += 1
        if err != errno.ENOSPC:
            return
        self.disk_full += 1
        now = time.monotonic()
        if self.budget is not None and now - self._disk_full_at >= DISK_FULL_INTERVAL:
            self._disk_full_at = now
            self._disk_full = True
            self._evict_kick.set()

    def _candidates(self, only: str | None = None) -> list[Candidate]:
        out = []
        busy = self.busy
        for blob, e in self.entries.items() if only is None else [(only, self.entries[only])]:
            if blob in self.pins or blob in self.protected:
                continue  # a holder or a front end mounted its data file: never punched
            meta = set(e.metadata) if e.open_count else ()
            pins = e.pins
            unverified = e.unverified
            for i, p in enumerate(e.present):
                if (p or unverified[i]) and i not in pins and (blob, i) not in busy:
                    out.append(Candidate(blob, i, self.disk_bytes(e, i), e.last_use[i], i in meta))
        return out

    async def evict_to(self, target: int) -> tuple[int, int]:
        """Drop least recently used chunks until usage <= target (as far as unpinned chunks
        allow). Returns (chunks, bytes) dropped."""
        victims = choose_victims(self._candidates(), self.usage, target)
        res = await self.drop([(v.blob, v.index) for v in victims])
        self._note_protected(target)
        if self.usage > target and self.pins:
            pinned = self.pinned_bytes()
            now = time.monotonic()
            if pinned and now - self._pin_log_at >= PIN_LOG_INTERVAL:
                self._pin_log_at = now
                log.warning("cache: usage %d stays above the target %d: %d byte(s) of %d pinned blob(s) cannot "
                            "be evicted (their files are mounted directly)", self.usage, target, pinned,
                            len(self.pins))
        return res

    def _note_protected(self, target: int) -> None:
        """Say once (not per eviction pass) that usage stays above a target because protected
        blobs hold the rest; said again only after a pass met its target."""
        if self.usage <= target:
            self._protected_logged = False
            return
        if self._protected_logged or not self.protected:
            return
        held = self.protected_bytes()
        if held:
            self._protected_logged = True
            log.warning("cache: usage %d stays above the target %d: %d byte(s) of %d blob(s) mounted directly "
                        "(fanotify) are not evicted while mounted (evictable once detached; "
                        "`layerctl cache ls`: protected_bytes)", self.usage, target, held, len(self.protected))

    async def evict(self, *, blob: str | None = None, all_chunks: bool = False,
                    to_bytes: int | None = None) -> dict[str, int]:
        """An explicit eviction (`cache evict`, through the daemon or offline): every chunk of
        one blob, every chunk, down to `to_bytes`, or else down to the low watermark."""
        if blob:
            n, b = await self.drop_blob(digestmod.parse(blob))
        elif all_chunks:
            n, b = await self.evict_to(0)
        elif to_bytes is not None:
            n, b = await self.evict_to(int(to_bytes))
        elif self.budget is not None:
            n, b = await self.evict_to(self.budget.low)
        else:
            raise ConfigError("no cache budget set: say which blob, --all or --to BYTES")
        out: dict[str, object] = {"evicted_chunks": n, "evicted_bytes": b, "used_bytes": self.usage,
                                  "pinned_bytes": self.pinned_bytes(), "protected_bytes": self.protected_bytes()}
        if blob and digestmod.parse(blob) in self.protected:
            out["skipped"] = ("protected: its data file is mounted directly (fanotify data path); "
                              "evictable once it is detached")
        return out

    async def drop_blob(self, blob: str) -> tuple[int, int]:
        holders = self.pins.get(blob)
        if holders:
            raise BlobPinned(f"blob {blob} is pinned by {', '.join(sorted(holders))} (its cache file is "
                             f"mounted directly): unpin it first")
        if blob not in self.entries or blob in self.protected:
            return 0, 0
        return await self.drop([(c.blob, c.index) for c in self._candidates(blob)])

    async def drop(self, victims: Sequence[tuple[str, int]]) -> tuple[int, int]:
        """Evict specific chunks (skipping any that are pinned, protected, busy or absent). The
        chunks are made absent and their records' deletion and punches queued in one step, with
        no await in between (`protect` relies on it), then flushed."""
        flight = Flight(DEMAND, "evict")
        per_blob: dict[str, list[tuple[int, int]]] = {}
        ops: list[ci.Op] = []
        taken: list[tuple[str, int]] = []
        nbytes = 0
        for blob, i in victims:
            e = self.entries.get(blob)
            if (e is None or not (e.present[i] or e.unverified[i]) or i in e.pins or (blob, i) in self.busy
                    or blob in self.pins or blob in self.protected):
                continue
            ref = e.cmap.chunks[i]
            e.present[i] = e.unverified[i] = 0  # from here on no reader starts on it
            self.busy[(blob, i)] = flight
            taken.append((blob, i))
            n = self.disk_bytes(e, i)
            self.usage -= n
            nbytes += n
            ops.append(ci.DelChunk(blob, i))
            per_blob.setdefault(blob, []).append((ref.offset, ref.length))
        if not taken:
            return 0, 0
        self._pending.extend(ops)
        self._punches.extend(per_blob.items())
        try:
            with trio.CancelScope(shield=True):
                await self.flush()
        finally:
            for key in taken:
                del self.busy[key]
            flight.done.set()
        self.evicted_chunks += len(taken)
        self.evicted_bytes += nbytes
        log.info("cache: evicted %d chunk(s), %d bytes; usage now %d", len(taken), nbytes, self.usage)
        return len(taken), nbytes

    # -- forgetting unused blobs (`cache gc`) ------------------------------------------------
    def blob_uses(self, file_times: Mapping[str, float] | None = None) -> list[BlobUse]:
        """Every blob's use (see `unused`): why it must stay, if anything uses it, and its last
        use: the latest of its chunks' last use, `file_times` (its data file's last write) and
        the daemon's in-use view (`in_use`)."""
        seen = self.in_use() if self.in_use is not None else {}
        files = file_times or {}
        busy = {blob for blob, _ in self.busy}
        out = []
        for blob, e in self.entries.items():
            daemon = seen.get(blob, 0.0)
            why = ("pinned" if blob in self.pins else "protected" if blob in self.protected
                   else "open" if e.open_count else "busy" if blob in busy
                   else "reading" if e.pins else "in use" if daemon == math.inf else "")
            last = max(max(e.last_use, default=0.0), files.get(blob, 0.0), daemon if daemon != math.inf else 0.0)
            out.append(BlobUse(blob, self.held_disk_bytes(e), last, why))
        return out

    def _file_times(self, blobs: Sequence[str]) -> dict[str, float]:
        out = {}
        for blob in blobs:
            try:
                out[blob] = os.stat(self.files.path(blob)).st_mtime
            except OSError:
                continue
        return out

    async def gc_unused(self, older_than: float, *, dry_run: bool = False) -> dict[str, object]:
        """Forget every blob nothing uses and nobody used for `older_than` seconds (see
        `unused.choose_unused`); never one that is pinned, open, in flight or in use."""
        if older_than < 0:
            raise BadInput(f"older than {older_than} s: want a duration >= 0")
        times = await trio.to_thread.run_sync(self._file_times, list(self.entries))
        now = self.clock()
        choice = choose_unused(self.blob_uses(times), now - older_than)
        dropped: list[dict[str, object]] = []
        freed = 0
        for u in choice.victims:
            if dry_run:
                dropped.append({"blob": u.blob, "bytes": u.held_bytes, "last_used": u.last_used})
                freed += u.held_bytes
                continue
            n = self.forget_blob(u.blob)  # (no await in between: the choice still holds)
            if n is not None:
                dropped.append({"blob": u.blob, "bytes": n, "last_used": u.last_used})
                freed += n
        if dropped and not dry_run:
            with trio.CancelScope(shield=True):
                await self.flush()
            log.info("cache gc: forgot %d blob(s) unused for %g s, %d bytes", len(dropped), older_than, freed)
        return {"dry_run": dry_run, "older_than": older_than, "dropped": dropped, "dropped_blobs": len(dropped),
                "dropped_bytes": freed, "kept_in_use": len(choice.kept_in_use),
                "kept_recent": len(choice.kept_recent), "used_bytes": self.usage}

    def forget_blob(self, blob: str) -> int | None:
        """Trio thread, no await: take the blob out of the cache (its entry, data file and, at the
        next batch, its index records and map). Returns the bytes it held, or None if something
        uses it (pinned, open, in flight, held by a reader) or it is unknown."""
        e = self.entries.get(blob)
        if (e is None or blob in self.pins or blob in self.protected or e.open_count or e.pins
                or any(b == blob for b, _ in self.busy)):
            return None
        held = self.held_disk_bytes(e)
        del self.entries[blob]  # a request from now on makes a fresh entry (and a fresh data file)
        e.close()
        self.files.remove(blob)
        self.usage -= held
        self._enqueue([ci.DelBlob(blob)])  # after every record queued for it, before any new one
        return held

    # -- maintenance ---------------------------------------------------------------------------
    async def verify(self) -> dict[str, object]:
        """Re-hash every committed chunk, verified or recovered; drop the bad ones. Chunks are
        pinned while checked (recovered ones held busy). A bad chunk of a pinned blob is
        reported and loses its record (the FUSE path never serves it; a read there fetches it
        again and rewrites the verified bytes in place), but its bytes are not punched: a holder
        mounted the file."""
        checked = 0
        bad: list[dict[str, object]] = []
        for blob, e in list(self.entries.items()):
            idxs = [i for i, p in enumerate(e.present) if p]
            good_r, bad_r = await self.verify_unverified(e)
            checked += len(good_r) + len(bad_r)
            bad += [{"blob": blob, "chunk": i, "digest": e.cmap.chunks[i].digest, "pinned": blob in self.pins}
                    for i in bad_r]
            if not idxs:
                continue
            self.pin(e, idxs)
            try:
                wrong = await trio.to_thread.run_sync(_rehash, e, idxs)
            finally:
                self.unpin(e, idxs)
            checked += len(idxs)
            if not wrong:
                continue
            self.corrupt_cached_chunks += len(wrong)
            pinned = blob in self.pins
            keep = pinned or blob in self.protected
            for i in wrong:
                log.error("cache verify: blob %s chunk %d (%s) does not match its digest; %s", blob, i,
                          e.cmap.chunks[i].digest, "dropped" if not keep else
                          f"unrecorded, not punched (the blob is {'pinned' if pinned else 'protected'})")
                bad.append({"blob": blob, "chunk": i, "digest": e.cmap.chunks[i].digest, "pinned": pinned})
            if keep:
                if blob in self.protected and self.on_unrecord is not None:
                    self.on_unrecord(blob, list(wrong))
                self._unrecord(e, wrong)
                await self.flush()
            else:
                await self.drop([(blob, i) for i in wrong])
        return {"checked": checked, "bad": bad}

    def _unrecord(self, e: BlobEntry, idxs: Sequence[int]) -> None:
        """Mark chunks absent and queue the deletion of their records, without punching."""
        for i in idxs:
            if e.present[i] or e.unverified[i]:
                e.present[i] = e.unverified[i] = 0
                self.usage -= self.disk_bytes(e, i)
        self._enqueue([ci.DelChunk(e.blob, i) for i in idxs])

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


def _rehash(entry: BlobEntry, idxs: Sequence[int]) -> list[int]:
    """Worker thread: the chunks whose bytes in the data file do not hash to their digest (a
    read error counts as a mismatch; EBADF once the entry is closed)."""
    wrong = []
    chunks = entry.cmap.chunks
    for i in idxs:
        ref = chunks[i]
        try:
            data = entry.read_sync(ref.offset, ref.end)
        except frames.StoredChunkCorrupt:  # a zstd cache's frame that does not decode to the digest
            wrong.append(i)
            continue
        except OSError as e:
            if e.errno == errno.EBADF:
                raise
            log.error("cache: blob %s chunk %d: cannot read it back: %s", entry.blob, i, e)
            wrong.append(i)
            continue
        h = blake3.blake3(data).hexdigest()
        if len(data) != ref.length or digestmod.PREFIX + h != ref.digest:
            wrong.append(i)
    return wrong
