"""The fanotify front end on the node-cache library (docs/fanotify.md): attachments (a blob's data
file marked, its metadata filled, for the shim to mount EROFS on it directly), the event thread,
and the trio side of an event (fill through `LazyCache`, then answer).

Threads: the event thread only reads events, answers the daemon's own accesses and accesses to
present chunks (presence is read with `BlobEntry.missing`, under `_lock`, which `on_unrecord`
takes too), journals the rest and hands them to the trio thread with `TrioToken.run_sync_soon`
(no wait). Everything else (attachments, marks, readers, the fill) lives on the trio thread.
Every event is answered exactly once: allowed after its chunks are present, denied with EIO on
any error; an event whose task is cancelled (shutdown) is left pending in the journal for the
next daemon.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import resource
import select
import socket
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from fuse_client.nodecache import BlobEntry, LazyCache, Reader
from fuse_client.nodecache.cache import protect_before_open
from layerstore.errors import BadInput, LayerstoreError

from . import abi, handover, kernel
from . import group as group_mod
from .journal import InflightJournal, Pending

log = logging.getLogger("layerstore.fanotify")

ATTACHED_NAME = handover.ATTACHED_NAME
JOURNAL_NAME = group_mod.JOURNAL_NAME
READ_SIZE = 4096  # up to 85 pre-content events per read(2): a short window before they are journalled
# fd numbers a successor reserves beyond the bound the journal header promises (`abi.unknown_fd_bound`,
# refreshed every FD_COUNT_EVERY reads): room for fds other threads open meanwhile. An event whose fd
# is above the promise plus this margin is denied (EIO) at once, never held.
RESERVE_MARGIN = 1024
FD_COUNT_EVERY = 16
STREAM_GAP = 8 << 20  # a miss this close after the last fill, every chunk between present: the same stream
TOUCH_FLUSH = 256  # hits batched before their last-use update is handed to the trio thread
# A restart's attach of a persisted attachment that fails is tried again (its file stays marked,
# events on it wait), backing off from RESTORE_RETRY_MIN to RESTORE_RETRY_MAX seconds; after
# RESTORE_GIVE_UP seconds the waiting events are denied (EIO: their bytes cannot be vouched for).
RESTORE_RETRY_MIN = 0.2
RESTORE_RETRY_MAX = 5.0
RESTORE_GIVE_UP = 300.0
UNMARK_CHECK = 32  # fast-path answers between checks whether an attached blob is complete


@dataclass
class FrontStats:
    """The front end's counters (the library keeps fetched bytes, corrupt chunks, store errors)."""

    events: int = 0
    own_events: int = 0
    fast_allowed: int = 0  # answered in the event thread: every chunk present
    filled: int = 0  # answered after a fill on the trio thread
    denied: int = 0
    leftovers_answered: int = 0  # events a dead daemon had read, answered by this one
    unknown_answered: int = 0  # ... read and not journalled (it died reading them): allowed after a full fill
    fd_bound_denied: int = 0  # events whose fd number was beyond what a successor would reserve: EIO
    attach_failures: int = 0  # attaches that failed (the shim then mounts that blob over FUSE)
    reverified_chunks: int = 0  # recovered chunks of attached blobs re-hashed in the background
    marks: int = 0
    unmarks: int = 0
    extra: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, int]:
        return {"events": self.events, "own_events": self.own_events, "fast_allowed": self.fast_allowed,
                "filled": self.filled, "denied": self.denied, "leftovers_answered": self.leftovers_answered,
                "unknown_answered": self.unknown_answered, "fd_bound_denied": self.fd_bound_denied,
                "attach_failures": self.attach_failures, "reverified_chunks": self.reverified_chunks,
                "marks": self.marks, "unmarks": self.unmarks}


@dataclass
class Attached:
    entry: BlobEntry
    path: Path
    key: tuple[int, int]  # (st_dev, st_ino) of the data file
    holders: set[str]
    reader: Reader
    marked: bool = True
    meta_pinned: bool = False
    fast: int = 0  # events answered in the event thread
    fill_end: int = 0  # where the last fill ended (a sequential reader's next miss continues it)
    verifying: bool = False


def stream_start(a: Attached, lo: int) -> int:
    """Where a fill of a miss at `lo` starts: at the end of the blob's last fill when the reader
    went on from there through present chunks (answered in the event thread, unseen by the
    library's readahead streams), so the library sees one contiguous stream and reads ahead;
    else `lo`."""
    end = a.fill_end
    if not 0 < lo - end <= STREAM_GAP:
        return lo
    cmap = a.entry.cmap
    if a.entry.missing(range(cmap.index_at(end), cmap.index_at(lo - 1) + 1)):
        return lo
    return end


load_attachments = handover.load_attachments


class FanotifyFrontEnd:
    """Made before the cache is opened (`premark`, `start`: the daemon's own accesses during
    recovery are answered from then on; other events wait), then `bind` to the library, `restore`
    the attachments, `answer_leftovers`, `release`: events are served from then on."""

    def __init__(self, cache_dir: Path, *, data_file: Callable[[str], Path],
                 acquire: Callable[[], tuple[int, str, bool]]) -> None:
        self.cache_dir = Path(cache_dir)
        self.data_file = data_file  # blob -> its data file's path (`BlobFiles.path`)
        self.acquire = acquire  # -> (group fd, group id, created): `group.acquire`, blocking
        # The group is taken at start when a holder keeps one (a restart), else made on the
        # first attach: a daemon that never attaches starts no holder.
        self.group: int | None = None
        self.group_id = ""
        self._group_lock = trio.Lock()
        self.lazy: LazyCache | None = None
        self.nursery: trio.Nursery | None = None
        self.journal = InflightJournal(self.cache_dir / JOURNAL_NAME)
        self.stats = FrontStats()
        self.attached: dict[str, Attached] = {}
        self._by_key: dict[tuple[int, int], Attached] = {}  # read by the event thread (dict get: atomic)
        self._lock = threading.Lock()  # presence check + answer in the event thread vs on_unrecord
        self._pid = os.getpid()
        self._token: trio.lowlevel.TrioToken | None = None
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._stopping = False
        self._tasks = 0
        self._idle = trio.Event()
        self._touches: list[tuple[BlobEntry, int, int]] = []
        # Until `release`: events of others are journalled and held here, not dispatched.
        self._held: list[tuple[int, int, int, int, int]] | None = []
        self._leftovers: list[Pending] = []
        self._reserved: list[int] = []
        self._unknown_batch = False  # the predecessor died while reading a batch of events
        self._unknown_range = range(0)  # the fd numbers its unknown events may have
        self._high = 0  # the fd bound promised in the journal header (`abi.unknown_fd_bound`)
        self.attach_failed: dict[str, str] = {}  # blob -> why its last attach failed (served over FUSE)
        self._claim: tuple[socket.socket, int] | None = None  # this daemon's claim on the holder
        # Attachments are persisted one snapshot at a time, each taken under the lock: concurrent
        # attaches once shared one temporary file, and an older snapshot could land last (a mounted
        # blob missing from the file: after a restart its reads were denied as "not attached").
        self._persist_lock = trio.Lock()
        self._premarked: dict[str, tuple[int, int]] = {}  # blob -> (st_dev, st_ino) marked by `premark`
        # Persisted attachments whose restore failed so far (blob -> holders): still marked, still
        # persisted, tried again; events on their files wait on `_restoring` (key -> set when settled).
        self._unrestored: dict[str, list[str]] = {}
        self._restoring: dict[tuple[int, int], trio.Event] = {}

    @property
    def generation(self) -> str:
        return f"fanotify:{self.group_id}" if self.group_id else ""

    def open_group(self, fd: int, group_id: str, created: bool) -> None:
        """Use this group from now on: a new one (the journal is void: its events were on a group
        that is gone), or one taken over from the holder (what the journal holds is pending)."""
        self.group, self.group_id = fd, group_id
        if created:
            self.journal.reset()
            return
        self._leftovers = self.journal.pending()
        self._unknown_batch, high = self.journal.header()
        high = max([high, *(p.fd for p in self._leftovers)])
        if self._unknown_batch:
            # (capped: this daemon never holds an event fd beyond the journal, nor beyond its fd limit)
            nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            cap = min(high + RESERVE_MARGIN, self.journal.slots - 1, nofile - 256)
            self._unknown_range = range(3, cap + 1)
            self._reserve_numbers(self._unknown_range)
        else:
            self._reserve_numbers([p.fd for p in self._leftovers])
        self._high = high

    def _reserve_numbers(self, numbers: Iterable[int]) -> None:
        """Occupy the free fd numbers among `numbers` until the predecessor's unanswered events
        (journalled, or unknown: then a range) are answered: an answer is matched by number, so
        no event of ours may get one of theirs meanwhile. The /dev/null fd copied onto them takes
        the lowest free number itself, which is in the range: it stays open as that number's
        reservation. (Before, it was closed at the end: that number, the very one the dead
        daemon's first event of a read got when both had the same fds open, came free, the
        successor's next event got it, and the kernel matched the successor's answer to the
        older pending event: the successor's reader waited forever (CI hang, docs/fanotify.md).)"""
        null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        keep = False  # (the copied fd's own number is one of them: it stays, reserved)
        try:
            for n in numbers:
                if n == null:
                    keep = True
                    self._reserved.append(n)
                    continue
                try:
                    os.fstat(n)
                except OSError:
                    os.dup2(null, n, inheritable=False)
                    self._reserved.append(n)
        finally:
            if not keep:
                os.close(null)
        if self._reserved:
            log.info("reserved %d fd number(s) of the previous daemon's events", len(self._reserved))

    def _free_reserved(self) -> None:
        for n in self._reserved:
            with contextlib.suppress(OSError):
                os.close(n)
        self._reserved = []

    def bind(self, lazy: LazyCache, nursery: trio.Nursery) -> None:
        self.lazy = lazy
        self.nursery = nursery
        lazy.cache.holds.on_unrecord = self.on_unrecord

    async def release(self) -> None:
        """Answer the leftovers, serve the held events; from now on events go straight to the
        trio thread. The reserved fd numbers are freed once nothing of the predecessor's can be
        pending under them (they stay reserved if unknown events could not be answered)."""
        if await self.answer_leftovers():
            self._free_reserved()
        held, self._held = self._held, None
        if held:
            self._dispatch(held)

    def attach_unmarked(self, entry: BlobEntry, path: Path, key: tuple[int, int]) -> None:
        """Serve events on the file `key` (st_dev, st_ino) from `entry` with no mark, no holder
        and no persistence: for measuring the event path without a kernel group
        (bench/fanotify_event_cost.py). Never called by the daemon."""
        with self._lock:
            self._by_key[key] = Attached(entry, path, key, set(), None, marked=False)  # type: ignore[arg-type]

    def stats_json(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.stats.to_json())
        out["generation"] = self.generation
        out["attached"] = {b: {"holders": sorted(a.holders), "marked": a.marked}
                           for b, a in sorted(self.attached.items())}
        # Blobs whose attach failed: the shim mounts those over FUSE (docs/fanotify.md, "Marks and eviction").
        out["attach_failed"] = dict(sorted(self.attach_failed.items()))
        out["unrestored"] = sorted(self._unrestored)  # persisted attachments not taken back yet (retried)
        if self.lazy is not None:
            # Attached blobs are never evicted (window 7): what they hold, and whether the budget is
            # exceeded because of them (docs/fanotify.md, "Eviction of attached blobs").
            cache = self.lazy.cache
            out["unevictable_attached_bytes"] = cache.pins.protected_bytes()
            out["over_budget"] = cache.budget is not None and cache.usage > cache.budget.size
        return out

    def keep_holder(self) -> None:
        """Blocking (a worker thread, every few seconds): a holder keeps this group (a new one is
        started with this daemon's copy if it died) and holds this daemon's claim (an open
        connection: a holder with no claim, no mark and no attachment exits on its own)."""
        if self.group is None:
            return
        group_mod.ensure_holder(self.cache_dir, self.group, self.group_id)
        group_mod.keep_copy(self.cache_dir, self.group, self.group_id)
        ident = handover.read_identity(self.cache_dir)
        if ident is None or (self._claim is not None and self._claim[1] == ident[0]):
            return
        if self._claim is not None:
            self._claim[0].close()
        self._claim = handover.claim(self.cache_dir)

    # -- marks ---------------------------------------------------------------------------------
    def premark(self, blobs: list[str]) -> None:
        """Before the cache is opened (recovery may punch): mark the data files of the blobs the
        last daemon had attached (a file that is gone is skipped), and record them as protected
        from punches (window 7), so that recovery and the first evictions leave them alone even if
        the last daemon did not record that (an upgrade from a version without protections)."""
        assert self.group is not None
        try:
            protect_before_open(self.cache_dir, blobs)
        except (OSError, LayerstoreError) as e:
            log.error("cannot record the attached blobs as protected before recovery: %s", e)
        for blob in blobs:
            path = self.data_file(blob)
            try:
                st = os.stat(path)
                kernel.mark(self.group, path)
                self.stats.marks += 1
                self._premarked[blob] = (st.st_dev, st.st_ino)
            except OSError as e:
                log.warning("blob %s: cannot mark %s again: %s", blob, path, e.strerror)

    def on_unrecord(self, blob: str, idxs: list[int]) -> None:
        """`Holds.on_unrecord` (trio thread): chunks of an attached blob found bad are about to
        become absent (never punched: the blob is protected while attached). Its file is marked
        again first, so reads of them raise events and are filled with verified bytes written over
        the bad ones; metadata chunks, which EROFS reads without events, are fetched again now.
        Taking `_lock` waits for a presence check of the event thread in progress."""
        with self._lock:
            a = self.attached.get(blob)
            if a is None:
                return
            if not a.marked and self.group is not None:
                try:
                    kernel.mark(self.group, a.path)
                    a.marked = True
                    self.stats.marks += 1
                except OSError as e:
                    log.error("blob %s: cannot mark %s again: %s", blob, a.path, e.strerror)
        meta = [i for i in idxs if a.entry.is_meta[i]]
        if meta and self.lazy is not None and self.nursery is not None:
            self.nursery.start_soon(self._refill, a, meta)

    async def _refill(self, a: Attached, idxs: list[int]) -> None:
        assert self.lazy is not None
        try:
            await self.lazy.ensure(a.entry, idxs)
        except LayerstoreError as e:
            log.error("attached blob %s: fetching %d bad metadata chunk(s) again: %s", a.entry.blob, len(idxs), e)

    def _unmark_if_complete(self, a: Attached) -> None:
        if a.marked and self.group is not None and a.entry.complete():
            with self._lock:
                try:
                    kernel.unmark(self.group, a.path)
                except OSError as e:
                    log.warning("blob %s: cannot drop the mark of a complete file: %s", a.entry.blob, e.strerror)
                    return
                a.marked = False
                self.stats.unmarks += 1
            log.info("blob %s complete: mark dropped", a.entry.blob)

    # -- attachments (the shim's seam) -----------------------------------------------------------
    async def attach(self, blob: str, holder: str) -> dict[str, Any]:
        """Mark the blob's data file, fill its metadata, persist the attachment; the shim then
        mounts EROFS on `path`. Idempotent per holder. A failure is loud: an ERROR line, counted,
        and the blob listed with the reason under `attach_failed` in the stats until an attach of
        it succeeds (the shim mounts it over FUSE meanwhile)."""
        if not holder or len(holder) > 256:
            raise BadInput("a holder is a non-empty string of at most 256 characters")
        try:
            if blob in self._unrestored and await self._restore_one(blob, self._unrestored[blob]):
                self._settle_restore(blob)
            got = await self._attach(blob, holder, restoring=blob in self._unrestored)
        except Exception as e:
            self.stats.attach_failures += 1
            self.attach_failed[blob] = f"{type(e).__name__}: {e}"[:500]
            log.error("blob %s: attach for %s failed (%s): its layer is served over FUSE", blob, holder, e)
            raise
        self.attach_failed.pop(blob, None)
        return got

    async def _attach(self, blob: str, holder: str, *, restoring: bool = False) -> dict[str, Any]:
        assert self.lazy is not None
        if self.group is None:
            async with self._group_lock:
                if self.group is None:
                    fd, group_id, created = await trio.to_thread.run_sync(self.acquire)
                    self.open_group(fd, group_id, created)
                    self.start()
                    if self._leftovers or self._unknown_batch:  # (a holder appeared meanwhile)
                        await self.release()
        assert self.group is not None
        a = self.attached.get(blob)
        if a is None:
            entry = await self.lazy.entry(blob)
            path = Path(self.data_file(blob))
            st = os.stat(path)
            kernel.mark(self.group, path)
            self.stats.marks += 1
            a = self.attached.get(blob)  # (another attach of the same blob may have won meanwhile)
            if a is None:
                a = Attached(entry, path, (st.st_dev, st.st_ino), set(), self.lazy.open_reader(entry))
                self.attached[blob] = a
                self._by_key[a.key] = a
        try:
            # Window 7 (docs/fanotify.md): after FAN_ALLOW the kernel's read goes on without us, so
            # nothing may punch the file while it can be mounted. An eviction of it under way
            # finishes before this returns; none starts after (durably: recovery keeps it too).
            await self.lazy.cache.pins.protect(blob)
            await self.lazy.ensure_metadata(a.entry)
            # EROFS reads its metadata through the backing file's page cache (read_mapping_folio),
            # which raises no pre-content event: those chunks must be on disk for as long as the
            # blob is mounted. Pinned (eviction skips them) and committed (a restart's recovery
            # keeps them) before the shim may mount.
            if not a.meta_pinned:
                self.lazy.cache.pin(a.entry, a.entry.metadata)
                a.meta_pinned = True
            # (again: a concurrent attach of the blob that failed meanwhile dropped it; this also
            # commits the metadata chunks' records)
            await self.lazy.cache.pins.protect(blob)
        except BaseException:
            if not a.holders:
                # (a restore keeps the mark: the layer is still mounted on the file)
                self._forget(a, unmark=not restoring)
            raise
        if a.entry.unverified_idxs() and not a.verifying and self.nursery is not None:
            # Recovered chunks (a restart) are not served until re-hashed: an event on one waits for
            # its hash. Hash them all now, in the background, so reads soon take the fast path.
            a.verifying = True
            self.nursery.start_soon(self._reverify, a)
        if holder not in a.holders:
            a.holders.add(holder)
            await self._persist()
        return {"blob": blob, "holder": holder, "path": str(a.path), "generation": self.generation,
                "data_path": "fanotify"}

    async def _reverify(self, a: Attached) -> None:
        """Re-hash the recovered chunks of an attached blob (as `LazyCache.verify_pinned` does for
        pinned ones); a chunk that fails loses its record (its range raises events again: the
        mark is back before any punch) and is fetched again."""
        assert self.lazy is not None
        try:
            before = len(a.entry.unverified_idxs())
            bad = await self.lazy.cache.verifier.verify_all_unverified(a.entry)
            self.stats.reverified_chunks += before
            if bad:
                log.error("attached blob %s: %d recovered chunk(s) changed on disk since they were verified; "
                          "fetching them again", a.entry.blob, len(bad))
                with contextlib.suppress(LayerstoreError):
                    await self.lazy.ensure(a.entry, bad)
        except LayerstoreError as e:
            log.error("attached blob %s: re-hashing its recovered chunks: %s (events verify them one by one)",
                      a.entry.blob, e)
        finally:
            a.verifying = False

    async def detach(self, blob: str, holder: str) -> dict[str, Any]:
        a = self.attached.get(blob)
        if a is None and holder in self._unrestored.get(blob, ()):
            # (its mount is gone: nothing to take back for this holder any more)
            self._unrestored[blob].remove(holder)
            if not self._unrestored[blob]:
                self._settle_restore(blob)
                if self.group is not None:
                    with contextlib.suppress(OSError):
                        kernel.unmark(self.group, self.data_file(blob))
                if self.lazy is not None:
                    self.lazy.cache.pins.unprotect(blob)
            await self._persist()
            return {"blob": blob, "holder": holder, "removed": True}
        removed = a is not None and holder in a.holders
        if a is not None and removed:
            a.holders.discard(holder)
            if not a.holders:
                self._forget(a)
            await self._persist()
        return {"blob": blob, "holder": holder, "removed": removed}

    def _forget(self, a: Attached, *, unmark: bool = True) -> None:
        self.attached.pop(a.entry.blob, None)
        self._by_key.pop(a.key, None)
        a.reader.close()
        if a.meta_pinned and self.lazy is not None:
            self.lazy.cache.unpin(a.entry, a.entry.metadata)
            a.meta_pinned = False
        if unmark and a.marked and self.group is not None:
            with contextlib.suppress(OSError):
                kernel.unmark(self.group, a.path)
        if unmark and self.lazy is not None:  # (a failed restore keeps both: the layer is still mounted)
            self.lazy.cache.pins.unprotect(a.entry.blob)

    async def _persist(self) -> None:
        """Write the attachments (and those not restored yet) to CACHE/fanotify-attached.json: one
        writer at a time, each with a snapshot taken once it may write, so the last file written
        is the current state."""
        async with self._persist_lock:
            blobs = {b: set(a.holders) for b, a in self.attached.items()}
            for b, hs in self._unrestored.items():  # (a blob partly taken back keeps every holder)
                blobs[b] = blobs.get(b, set()) | set(hs)
            data = json.dumps({"blobs": {b: sorted(hs) for b, hs in sorted(blobs.items())}})
            await trio.to_thread.run_sync(self._write_attachments, data)

    def _write_attachments(self, data: str) -> None:
        path = self.cache_dir / ATTACHED_NAME
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    async def restore(self, previous: dict[str, list[str]]) -> None:
        """Take the attachments of the last daemon back (their files were marked by `premark`).
        One that fails stays marked and persisted and is tried again in the background; events
        on its file wait for it (`_handle`), they are not denied as "not attached"."""
        # Protections a crash left behind (detached, not yet recorded as unprotected) go; the
        # persisted attachments stay protected (they were since before recovery: `Pins.protect`).
        assert self.lazy is not None
        dropped = self.lazy.cache.pins.settle_protected(set(previous))
        if dropped:
            log.info("%d blob(s) no longer attached are evictable again", len(dropped))
        # Every one counts as not taken back until it is: a persist meanwhile (another blob's
        # restore) keeps them all in the list, and events on their files wait.
        for blob, holders in previous.items():
            self._unrestored[blob] = list(holders)
            key = self._premarked.get(blob)
            if key is not None:
                self._restoring[key] = trio.Event()
        for blob, holders in previous.items():
            if await self._restore_one(blob, holders):
                self._settle_restore(blob)
        if self._unrestored:
            assert self.nursery is not None
            self.nursery.start_soon(self._retry_restores)

    async def _restore_one(self, blob: str, holders: list[str]) -> bool:
        try:
            for h in holders:
                await self._attach(blob, h, restoring=True)
        except Exception as e:  # (whatever it is: the mark stays, the reads wait, it is tried again)
            log.error("blob %s: cannot attach again after a restart (%s: %s): its file stays marked, reads of "
                      "it wait; trying again", blob, type(e).__name__, e)
            return False
        return True

    async def _retry_restores(self) -> None:
        delay, waited = RESTORE_RETRY_MIN, 0.0
        while self._unrestored:
            await trio.sleep(delay)
            waited += delay
            delay = min(delay * 2, RESTORE_RETRY_MAX)
            for blob, holders in list(self._unrestored.items()):
                if await self._restore_one(blob, holders):
                    log.warning("blob %s: attached again after a restart (on a retry)", blob)
                    self._settle_restore(blob)
            if self._unrestored and waited >= RESTORE_GIVE_UP:
                for blob in list(self._unrestored):
                    log.error("blob %s: not attached again within %.0f s: reads of its unfilled ranges are "
                              "denied (EIO) until a daemon can attach it", blob, RESTORE_GIVE_UP)
                    key = self._premarked.get(blob)
                    if key is not None and key in self._restoring:
                        self._restoring.pop(key).set()
                return

    def _settle_restore(self, blob: str) -> None:
        self._unrestored.pop(blob, None)
        key = self._premarked.get(blob)
        if key is not None and key in self._restoring:
            self._restoring.pop(key).set()

    # -- events ----------------------------------------------------------------------------------
    def start(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._thread = threading.Thread(target=self._event_loop, name="fanotify-events", daemon=True)
        self._thread.start()

    async def stop(self, grace: float = 10.0) -> None:
        """Stop serving others' events (new ones are journalled and left for the next daemon);
        give the events in progress `grace` seconds to be answered (the rest stay pending in the
        journal). The event thread keeps answering the daemon's own accesses until `close`."""
        self._held = []
        if self._tasks:
            self._idle = trio.Event()
            with trio.move_on_after(grace):
                await self._idle.wait()
        self._flush_touches()

    def close(self) -> None:
        self._stopping = True
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(10)
        self._free_reserved()  # (numbers a takeover reserved and `release` did not get to free)
        for a in list(self.attached.values()):
            a.reader.close()
        self.journal.close()
        if self._claim is not None:
            self._claim[0].close()
            self._claim = None
        if self.group is not None:
            os.close(self.group)
            self.group = None
        os.close(self._wake_r)
        os.close(self._wake_w)

    @property
    def fd_bound(self) -> int:
        """The bound of event fd numbers the journal header promises a successor."""
        return self._high

    def fd_limit(self) -> int:
        """The highest event fd number this daemon holds on to (above it: denied at once)."""
        return min(self._high + RESERVE_MARGIN, self.journal.slots - 1)

    def promise_bound(self) -> None:
        """The fd bound the journal header promises a successor (`abi.unknown_fd_bound` over the
        fds open now; never below the predecessor's while its numbers are reserved)."""
        floor = self._high if self._reserved else 0
        self._high = abi.unknown_fd_bound(floor, kernel.open_fds(), READ_SIZE)

    def _event_loop(self) -> None:
        assert self.group is not None
        poller = select.poll()
        poller.register(self.group, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        reads = 0
        while not self._stopping:
            try:
                ready = poller.poll()
            except InterruptedError:
                continue
            if self._stopping:
                return
            if not any(fd == self.group for fd, _ in ready):
                continue
            if reads % FD_COUNT_EVERY == 0:
                self.promise_bound()
            reads += 1
            self.journal.begin_batch(self._high)
            try:
                buf = os.read(self.group, READ_SIZE)
            except (BlockingIOError, InterruptedError):
                self.journal.end_batch(self._high)
                continue
            except OSError as e:
                log.error("reading fanotify events: %s", e)
                return
            slow = self.process_batch(buf)
            if slow:
                assert self._token is not None
                try:
                    self._token.run_sync_soon(self.take_events, slow)
                except trio.RunFinishedError:
                    return  # (journalled: the next daemon answers them)
            if len(self._touches) >= TOUCH_FLUSH:
                with contextlib.suppress(trio.RunFinishedError):
                    assert self._token is not None
                    self._token.run_sync_soon(self._flush_touches)

    def process_batch(self, buf: bytes) -> list[tuple[int, int, int, int, int]]:
        """One `read(2)` of events (the journal's batch flag is set): each answered at once or
        journalled; returns the journalled ones (fd, dev, ino, offset, count) for the trio thread.
        Clears the batch flag once every event is answered or journalled."""
        slow: list[tuple[int, int, int, int, int]] = []
        try:
            events = abi.parse_events(buf)
        except abi.ParseError as e:  # cannot answer what cannot be parsed: say so loudly
            log.critical("unparseable fanotify events (%s): their readers wait for a restart", e)
            return slow  # (the batch flag stays: a successor treats its events as unknown)
        limit = self.fd_limit()
        for ev in events:
            if ev.fd > limit:
                self._deny_beyond_bound(ev, limit)
            else:
                self._one_event(ev, slow)
        self.journal.end_batch(self._high)
        return slow

    def _deny_beyond_bound(self, ev: abi.Event, limit: int) -> None:
        """An event fd above what a successor would reserve (or beyond the journal): holding it
        could let a successor's own event get its number (an answer is matched by number), so it
        is answered now: EIO for a permission event (never zeros), and its fd closed."""
        self.stats.events += 1
        if ev.is_permission:
            self.stats.fd_bound_denied += 1
            self._answer(ev.fd, allow=False, err=errno.EIO)
            log.error("fanotify event fd %d above the bound %d (too many open fds): denied with EIO", ev.fd, limit)
        with contextlib.suppress(OSError):
            os.close(ev.fd)
        self.promise_bound()

    def _one_event(self, ev: abi.Event, slow: list[tuple[int, int, int, int, int]]) -> None:
        st = self.stats
        st.events += 1
        if ev.fd < 0 or not ev.is_permission:
            if ev.fd >= 0:
                os.close(ev.fd)
            if ev.mask & abi.FAN_Q_OVERFLOW:
                log.error("fanotify queue overflow")
            return
        if ev.pid == self._pid:  # the daemon's own access (fetch writes, punches, the hit path)
            st.own_events += 1
            self._answer(ev.fd, allow=True)
            os.close(ev.fd)
            return
        try:
            fst = os.fstat(ev.fd)
            key = (fst.st_dev, fst.st_ino)
        except OSError:
            key = (0, 0)
        off, count = ev.offset or 0, ev.count or 0
        with self._lock:
            a = self._by_key.get(key)
            if a is not None:
                e = a.entry
                span = abi.page_span(off, count, e.size)
                if span is None:
                    self._answer(ev.fd, allow=True)  # past the end: nothing to fill
                    os.close(ev.fd)
                    st.fast_allowed += 1
                    return
                first, last = e.cmap.index_at(span[0]), e.cmap.index_at(span[1] - 1) + 1
                if not e.missing(range(first, last)):
                    self._answer(ev.fd, allow=True)
                    os.close(ev.fd)
                    st.fast_allowed += 1
                    self._touches.append((e, first, last))
                    a.fast += 1
                    if a.marked and a.fast % UNMARK_CHECK == 0 and self._token is not None:
                        # (a blob attached complete never fills: see whether its mark can go)
                        with contextlib.suppress(trio.RunFinishedError):
                            self._token.run_sync_soon(self._unmark_if_complete, a)
                    return
        self.journal.record(ev.fd, key[0], key[1], off, count)
        slow.append((ev.fd, key[0], key[1], off, count))

    def _answer(self, fd: int, *, allow: bool, err: int = 0) -> None:
        assert self.group is not None
        try:
            kernel.respond(self.group, fd, allow=allow, errno=err)
        except OSError as e:
            log.error("answering fanotify event fd %d: %s", fd, e)

    def _flush_touches(self) -> None:
        touches, self._touches = self._touches, []
        now = self.lazy.cache.clock() if self.lazy is not None else 0.0
        for e, first, last in touches:
            e.touch(first, last, now)

    def take_events(self, slow: list[tuple[int, int, int, int, int]]) -> None:
        """Trio thread: the journalled events of one read, from the event thread; held until
        `release` (a takeover in progress), else each filled and answered by its own task."""
        if self._held is not None:
            self._held.extend(slow)
        else:
            self._dispatch(slow)

    def _dispatch(self, slow: list[tuple[int, int, int, int, int]]) -> None:
        assert self.nursery is not None
        for fd, dev, ino, off, count in slow:
            self._tasks += 1
            self.nursery.start_soon(self._handle, fd, (dev, ino), off, count, False)

    async def _handle(self, fd: int, key: tuple[int, int], off: int, count: int, leftover: bool) -> None:
        """Fill, then answer. Cancelled (shutdown): not answered, left in the journal."""
        allow, err = False, errno.EIO
        try:
            a = self._by_key.get(key)
            settled = self._restoring.get(key) if a is None else None
            if settled is not None:  # a persisted attachment not taken back yet: wait for its retries
                await settled.wait()
                a = self._by_key.get(key)
            if a is None:
                log.error("fanotify event on a file that is not attached (inode %d:%d): denied", *key)
            else:
                span = abi.page_span(off, count, a.entry.size)
                if span is not None:
                    lo = stream_start(a, span[0])
                    a.fill_end = span[1]
                    await a.reader.fill(lo, span[1] - lo)
                allow = True
        except trio.Cancelled:
            if not leftover:
                self._done_task()
            raise
        except LayerstoreError as e:
            log.error("fanotify fill of %d+%d failed: %s (denied: EIO)", off, count, e)
        except Exception:
            log.exception("fanotify fill of %d+%d (denied: EIO)", off, count)
        if allow:
            self.stats.filled += 1
        else:
            self.stats.denied += 1
        self._answer(fd, allow=allow, err=err)
        self.journal.clear(fd)
        if not leftover:
            os.close(fd)
            self._done_task()
        if allow:
            a = self._by_key.get(key)
            if a is not None:
                self._unmark_if_complete(a)

    def _done_task(self) -> None:
        self._tasks -= 1
        if self._tasks == 0:
            self._idle.set()

    async def answer_leftovers(self) -> bool:
        """The events a dead daemon read and did not answer: fill each and answer it by its fd
        number, before any new event is answered (docs/fanotify.md). If it died while reading a
        batch, events may be pending that nobody knows of: every attached blob is filled
        completely, then every reserved number is allowed (ENOENT where nothing is pending).
        False if such unknown events could not be answered (a fill failed)."""
        pending, self._leftovers = self._leftovers, []
        if pending:
            log.warning("answering %d fanotify event(s) left by the previous daemon", len(pending))
            async with trio.open_nursery() as n:
                for p in pending:
                    n.start_soon(self._handle, p.fd, (p.dev, p.ino), p.offset, p.count, True)
            self.stats.leftovers_answered += len(pending)
        if self._unknown_batch:
            self._unknown_batch = False
            return await self._answer_unknown({p.fd for p in pending})
        return True

    def _answer_unreserved(self, known: set[int]) -> int:
        """The numbers of the predecessor's range that were open here when the group was taken
        over, so not reserved (this daemon's fd layout differs from the dead one's): an unknown
        event of its may be pending under any of them, and nobody else would ever answer it (its
        reader would wait forever; seen under bench/daemon_restart.py --kill-all --fd-store).
        Each is allowed by number (every attached blob is complete by now) unless it may be an
        event of ours: a free number is held while it is answered, so no event of ours can get
        it; an open one is answered only if it is not a marked data file (an event's fd is)."""
        assert self.group is not None
        reserved = set(self._reserved)
        answered = 0
        null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        try:
            for n in self._unknown_range:
                if n in known or n in reserved:
                    continue
                held = fcntl.fcntl(null, fcntl.F_DUPFD_CLOEXEC, n)
                try:
                    if held != n:
                        try:
                            st = os.fstat(n)
                        except OSError:  # (closed just now: it could become an event of ours)
                            continue
                        key = (st.st_dev, st.st_ino)  # (looked up now: an attach may have come meanwhile)
                        if key in self._by_key or key in self._premarked.values():
                            continue
                    if kernel.respond(self.group, n, allow=True):
                        answered += 1
                finally:
                    os.close(held)
        finally:
            os.close(null)
        return answered

    async def _answer_unknown(self, known: set[int]) -> bool:
        assert self.lazy is not None and self.group is not None
        log.warning("the previous daemon died reading events: filling %d attached blob(s) completely, then "
                    "allowing its unknown events", len(self.attached))
        for blob in list(self.attached):
            try:
                res = await self.lazy.prefetch(blob, all_chunks=True, wait=True)
            except LayerstoreError as e:
                log.error("blob %s: cannot fill it (%s): unknown events of the previous daemon stay pending", blob, e)
                return False
            if res.get("failed"):
                log.error("blob %s: %s chunk(s) failed: unknown events of the previous daemon stay pending",
                          blob, res["failed"])
                return False
        answered = 0
        for n in self._reserved:
            if n not in known and kernel.respond(self.group, n, allow=True):
                answered += 1
        answered += self._answer_unreserved(known)
        self.stats.unknown_answered += answered
        log.warning("allowed %d unknown event(s) of the previous daemon", answered)
        return True
