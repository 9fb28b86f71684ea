"""Verification: recovered chunks re-hashed before they are served, and `cache verify`.

A part the core (`cache.NodeCache`) owns, built with the core's narrow seam (`core.Core`), the
blobs' holds (`pins.Holds`: pinned and protected files are unrecorded, never punched) and the
evictor's `drop`. It keeps one counter of its own (`verified_chunks`). A record says the bytes were verified once, not
that they still are: after a restart recovery keeps recorded chunks as `unverified`, and nothing
serves them until they are re-hashed against the chunk map here: by the fetcher on first demand
(`check_unverified`), by `pin_blob` before a direct mount (`verify_all_unverified`), by `verify`.
Hashing runs in worker threads; the chunks are held busy (a `Flight`) or pinned meanwhile.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Awaitable, Callable, Sequence

import blake3
import trio

from layerstore import digest as digestmod

from . import frames
from . import index as ci
from .core import Core
from .entry import BlobEntry, Flight
from .limiter import DEMAND
from .pins import Holds

log = logging.getLogger("layerstore.fuse.cache")

VERIFY_BATCH_BYTES = 32 << 20  # recovered chunks re-hashed per worker-thread call (held busy meanwhile)

class Verifier:
    """Re-hashing cached chunks against their chunk map."""

    def __init__(self, core: Core, holds: Holds,
                 drop: Callable[[Sequence[tuple[str, int]]], Awaitable[tuple[int, int]]]) -> None:
        self.core = core
        self.holds = holds
        self.drop = drop
        self.verified_chunks = 0  # recovered chunks whose bytes matched their digest again

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
        pinned = entry.blob in self.holds.pinned
        self.core.release(entry, idxs)
        for i in idxs:
            log.error("cache: blob %s chunk %d (%s): the cached bytes do not match the digest (changed since they "
                      "were verified); %s", entry.blob, i, chunks[i].digest,
                      "record dropped, not punched (the blob is pinned: its direct mounts read these bytes "
                      "until the chunk is fetched again)" if pinned else "dropped")
        self.core.count_corrupt(len(idxs))
        ops: list[ci.Op] = [ci.DelChunk(entry.blob, i) for i in idxs]
        # (a protected blob's bytes stay too: a fetch writes the verified bytes over them)
        keep = self.holds.held(entry.blob)
        self.core.enqueue(ops, () if keep else [(entry.blob, [(chunks[i].offset, chunks[i].length) for i in idxs])])
        with trio.CancelScope(shield=True):
            await self.core.flush()  # punched before the caller writes anything there

    async def verify_unverified(self, entry: BlobEntry) -> tuple[list[int], list[int]]:
        """Re-hash the blob's recovered chunks that no flight holds, in batches of about
        `VERIFY_BATCH_BYTES` (each batch held busy, so readers of it wait for it only).
        Returns (good, bad) over all batches."""
        good: list[int] = []
        bad: list[int] = []
        busy, blob, chunks = self.core.busy, entry.blob, entry.cmap.chunks
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
            busy = self.core.busy
            held = [busy[(entry.blob, i)] for i in entry.unverified_idxs() if (entry.blob, i) in busy]
            if not held:
                return bad
            await held[0].done.wait()

    async def verify(self) -> dict[str, object]:
        """Re-hash every committed chunk, verified or recovered; drop the bad ones. Chunks are
        pinned while checked (recovered ones held busy). A bad chunk of a pinned blob is
        reported and loses its record (the FUSE path never serves it; a read there fetches it
        again and rewrites the verified bytes in place), but its bytes are not punched: a holder
        mounted the file."""
        core, holds = self.core, self.holds
        checked = 0
        bad: list[dict[str, object]] = []
        for blob, e in list(core.entries.items()):
            idxs = [i for i, p in enumerate(e.present) if p]
            good_r, bad_r = await self.verify_unverified(e)
            checked += len(good_r) + len(bad_r)
            bad += [{"blob": blob, "chunk": i, "digest": e.cmap.chunks[i].digest, "pinned": blob in holds.pinned}
                    for i in bad_r]
            if not idxs:
                continue
            core.pin(e, idxs)
            try:
                wrong = await trio.to_thread.run_sync(_rehash, e, idxs)
            finally:
                core.unpin(e, idxs)
            checked += len(idxs)
            if not wrong:
                continue
            core.count_corrupt(len(wrong))
            pinned = blob in holds.pinned
            keep = holds.held(blob)
            for i in wrong:
                log.error("cache verify: blob %s chunk %d (%s) does not match its digest; %s", blob, i,
                          e.cmap.chunks[i].digest, "dropped" if not keep else
                          f"unrecorded, not punched (the blob is {'pinned' if pinned else 'protected'})")
                bad.append({"blob": blob, "chunk": i, "digest": e.cmap.chunks[i].digest, "pinned": pinned})
            if keep:
                holds.unrecording(blob, list(wrong))
                self._unrecord(e, wrong)
                await core.flush()
            else:
                await self.drop([(blob, i) for i in wrong])
        return {"checked": checked, "bad": bad}

    def _unrecord(self, e: BlobEntry, idxs: Sequence[int]) -> None:
        """Mark chunks absent and queue the deletion of their records, without punching."""
        self.core.release(e, idxs)
        self.core.enqueue([ci.DelChunk(e.blob, i) for i in idxs])


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
