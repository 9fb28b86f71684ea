"""Durable pins and protected blobs: the node cache's bookkeeping of data files mounted directly.

Two objects the core (`cache.NodeCache`) owns: `Holds`, the state (who pins which blob, which
blobs are protected), read by every part that might touch a blob's file; and `Pins`, the part that
changes it, through the core's journal (`core.Core`: `flush_op`, `queue_protected`). Nothing here
runs on the read path.

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
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

import trio

from layerstore import digest as digestmod
from layerstore.errors import BadInput, LayerstoreError
from layerstore.fileio import fsync_dir

from . import index as ci
from .core import Core
from .entry import BlobEntry
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


class Holds:
    """Which blobs' data files something outside the cache reads directly, so that nothing
    modifies them: durable pins (`pinned`: blob -> {holder: since}) and protected blobs
    (`protected`). Filled by recovery, changed only by `Pins`; read by the other parts."""

    def __init__(self) -> None:
        self.pinned: dict[str, dict[str, float]] = {}
        self.protected: set[str] = set()
        # Called on the trio thread with (blob, chunk indexes) just before chunks of a protected
        # blob become absent without a punch (found bad): the front end makes reads of them raise
        # events again and may fetch them again (docs/fanotify.md).
        self.on_unrecord: Callable[[str, list[int]], None] | None = None

    def held(self, blob: str) -> bool:
        """Pinned or protected: its data file is never punched."""
        return blob in self.pinned or blob in self.protected

    def unrecording(self, blob: str, idxs: list[int]) -> None:
        """Chunks of the blob are about to lose their record without a punch: tell the front end
        if the blob is protected."""
        if blob in self.protected and self.on_unrecord is not None:
            self.on_unrecord(blob, idxs)


class Pins:
    """Pins of direct mounts (`pin_blob`, `unpin_blob`) and protected blobs (`protect`).

    `verify_all` re-hashes a blob's recovered chunks (`Verifier.verify_all_unverified`) before a
    pin; `evict_if_over` wakes eviction when a blob becomes evictable again over the budget."""

    def __init__(self, core: Core, holds: Holds, *, root: Path, direct_image: bool,
                 verify_all: Callable[[BlobEntry], Awaitable[list[int]]],
                 evict_if_over: Callable[[], None]) -> None:
        self.core = core
        self.holds = holds
        self.root = root
        self.direct_image = direct_image
        self.verify_all = verify_all
        self.evict_if_over = evict_if_over

    async def pin_blob(self, blob: str, holder: str) -> Path:
        """Record that `holder` uses the blob's data file as an image, and return the file's
        path. Only a complete blob (every chunk committed) can be pinned: `BlobIncomplete`
        otherwise, and nothing is recorded. When this returns, the pin and every chunk record
        of the blob are committed (the data synced before them), so the file is the image,
        durably; from then on eviction, `verify` and recovery leave the file's bytes alone."""
        check_holder(holder)
        if not self.direct_image:
            raise NoPlainImage(f"blob {blob}: the node cache {self.root} keeps chunks compressed (format zstd): "
                               f"it has no plain image file to mount directly; mount the daemon's file of the blob")
        e = self.core.entries.get(blob)
        if e is None:
            raise BlobIncomplete(f"blob {blob} is not in the node cache", None)
        # The kernel will read the file with no FUSE hop: every recovered chunk is re-hashed
        # first; a bad one is dropped, and the blob is then incomplete.
        await self.verify_all(e)
        missing = e.missing_bytes()
        if missing:
            raise BlobIncomplete(f"blob {blob} is not complete in the node cache: {missing} byte(s) missing",
                                 missing)
        # No await between the check and this: no eviction can start on the blob in between.
        holders = self.holds.pinned.setdefault(blob, {})
        before = holders.get(holder)
        holders[holder] = self.core.clock()
        await self._commit_pin_change(ci.PutPin(blob, holder, holders[holder]),
                                      lambda: self._restore_pin(blob, holder, before))
        return self.core.data_path(blob).absolute()

    async def unpin_blob(self, blob: str, holder: str) -> bool:
        """Drop `holder`'s pin (durably); False if it had none (idempotent). The blob's chunks
        become evictable again once no holder is left."""
        check_holder(holder)
        pinned = self.holds.pinned
        holders = pinned.get(blob)
        if not holders or holder not in holders:
            return False
        before = holders.pop(holder)
        if not holders:
            del pinned[blob]
            e = self.core.entries.get(blob)
            if e is not None:  # its last use is now: a direct mount read it without a FUSE hop
                e.touch(0, len(e.present), self.core.clock())
        await self._commit_pin_change(ci.DelPin(blob, holder), lambda: self._restore_pin(blob, holder, before))
        self.evict_if_over()
        return True

    def _restore_pin(self, blob: str, holder: str, since: float | None) -> None:
        pinned = self.holds.pinned
        if since is None:
            holders = pinned.get(blob, {})
            holders.pop(holder, None)
            if not holders:
                pinned.pop(blob, None)
        else:
            pinned.setdefault(blob, {})[holder] = since

    async def _commit_pin_change(self, op: ci.Op, undo: Callable[[], None]) -> None:
        """Commit a pin op (with every chunk record queued before it); if a journal batch failed
        meanwhile, undo the change in memory and fail."""
        if not await self.core.flush_op(op):
            undo()
            raise CacheIOError(f"cannot record the pin change of blob {op.blob} in the cache index (see the log)")

    def holders(self, blob: str) -> list[str]:
        """Who pins the blob (sorted; [] if nobody)."""
        return sorted(self.holds.pinned.get(blob, ()))

    def pinned_bytes(self) -> int:
        return self.core.held_bytes(self.holds.pinned)

    async def protect(self, blob: str) -> None:
        """From when this returns until `unprotect`, nothing punches the blob's data file (nor
        removes it): no eviction (budget, explicit, disk full), no `verify`, no recovery. An
        eviction of the blob already under way finishes first: its chunks were made absent and
        its punches queued in one step (no await in between), so the flush here, which waits
        for any batch being applied and applies what is queued, returns after its last punch.
        Durable when this returns (a restart's recovery and first eviction leave the file alone)."""
        digestmod.parse(blob)
        protected = self.holds.protected
        if blob not in protected:
            protected.add(blob)
            self.core.queue_protected(sorted(protected))
        with trio.CancelScope(shield=True):
            await self.core.flush()

    def unprotect(self, blob: str) -> None:
        """Trio thread, no await: the blob is evictable again (its mounts are gone); recorded
        with the next journal batch (a crash before: it stays protected until a front end
        settles the set, `settle_protected`)."""
        protected = self.holds.protected
        if blob in protected:
            protected.discard(blob)
            self.core.queue_protected(sorted(protected))
            self.evict_if_over()

    def settle_protected(self, keep: set[str]) -> list[str]:
        """Trio thread: unprotect every protected blob not in `keep` (a front end at start-up, with
        the blobs it mounted: protections a crash left behind go). Returns those unprotected."""
        gone = sorted(self.holds.protected - keep)
        for blob in gone:
            self.unprotect(blob)
        return gone

    def protected_bytes(self) -> int:
        """Disk bytes held by protected blobs (eviction cannot free them while they are protected)."""
        return self.core.held_bytes(self.holds.protected)
