"""Durable pins and protected blobs: the node cache's bookkeeping of data files mounted directly.

A part of `NodeCache` (`cache`), mixed into it: it reads and writes the core's `pins`,
`protected`, `entries` and journal (`_enqueue`, `flush`); nothing here runs on the read path.

Pins (LMDB "pins", blob -> {holder: since}): a holder mounted a complete blob's data file as an
image; nothing modifies the file while it is pinned (no eviction, no punch, recovery leaves it).

Protected blobs (`protect`): a front end that mounts a blob's data file directly and sees only the
start of each read (fanotify: after its answer the kernel's read goes on without it) cannot know
when a read of a chunk has finished; a punch under such a read would hand it a hole (zeros). So
nothing punches a protected blob's file: eviction skips its chunks and picks other blobs, and a
chunk found bad loses its record without a punch (`on_unrecord` tells the front end). The set is
durable (PROTECTED_NAME, written by the journal), so recovery and the first eviction of a
restarted daemon leave the files alone before the front end takes them back.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import trio

from layerstore import digest as digestmod
from layerstore.errors import BadInput, LayerstoreError
from layerstore.fileio import fsync_dir

from . import index as ci
from .errors import BlobIncomplete, CacheIOError, NoPlainImage

log = logging.getLogger("layerstore.fuse.cache")

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


class Pins:
    """Pins of direct mounts (`pin_blob`, `unpin_blob`) and protected blobs (`protect`)."""

    async def pin_blob(self, blob: str, holder: str) -> Path:
        """Record that `holder` uses the blob's data file as an image, and return the file's
        path. Only a complete blob (every chunk committed) can be pinned: `BlobIncomplete`
        otherwise, and nothing is recorded. When this returns, the pin and every chunk record
        of the blob are committed (the data synced before them), so the file is the image,
        durably; from then on eviction, `verify` and recovery leave the file's bytes alone."""
        check_holder(holder)
        if not self.chunk_format.direct_image:
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
