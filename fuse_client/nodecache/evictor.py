"""Eviction: the watermark loop, explicit eviction (`cache evict`) and a full disk.

A part the core (`cache.NodeCache`) owns, built with the core's narrow seam (`core.Core`), the
blobs' holds (`pins.Holds`) and the budget; the policy (watermarks, which chunks) is pure, in
`eviction`. It owns the episode state, its wake-up event and the eviction and write-failure
counters; the core wakes it after commits (`kick`) and runs its loop (`run`).

Eviction marks chunks absent (no new reader starts on them), queues their records' deletion and
punches the holes only after that deletion committed (`drop`). Pinned and protected
blobs, busy chunks and chunks held by readers are never victims.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Sequence

import trio

from layerstore import digest as digestmod
from layerstore.errors import ConfigError

from . import index as ci
from .core import Core
from .entry import Flight
from .errors import BlobPinned
from .eviction import Budget, Candidate, choose_victims
from .limiter import DEMAND
from .pins import Holds

log = logging.getLogger("layerstore.fuse.cache")

SETTLE = 0.5  # seconds without commits that end an eviction episode
PIN_LOG_INTERVAL = 60.0  # at most one "budget not met because of pins" warning per this many seconds
DISK_FULL_INTERVAL = 1.0  # at most one disk-full eviction per this many seconds

class Evictor:
    """Evicting chunks to a target, in the background (`run`) or on request (`evict`)."""

    def __init__(self, core: Core, holds: Holds, budget: Budget | None) -> None:
        self.core = core
        self.holds = holds
        self.budget = budget
        self.episode = False  # an episode runs: every commit and unpin wakes the loop
        self._kick = trio.Event()
        self.evicted_chunks = 0
        self.evicted_bytes = 0
        self.write_failures = 0  # chunk writes into the data files that failed
        self.disk_full = 0  # ... of them with ENOSPC (each kicks an eviction)
        self._disk_full = False
        self._disk_full_at = float("-inf")
        self._pin_log_at = float("-inf")
        self._protected_logged = False  # "usage stays above the target because of protected blobs", once

    def kick(self) -> None:
        """Wake the loop (trio thread, no await)."""
        self._kick.set()

    def kick_if_over(self) -> None:
        """Wake the loop if usage is over the high watermark (something became evictable)."""
        if self.budget is not None and self.core.usage > self.budget.high:
            self._kick.set()

    async def _next_kick(self) -> None:
        await self._kick.wait()
        self._kick = trio.Event()

    async def run(self) -> None:
        """Watermark eviction. Crossing the high watermark starts an episode: evict to the low
        watermark now, again whenever commits push usage half-way back up to the high watermark,
        and once more when the cache has been quiet for `SETTLE` seconds, so that usage ends
        under the low watermark."""
        assert self.budget is not None
        core = self.core
        while True:
            await self._next_kick()
            if self._disk_full:
                self._disk_full = False
                # The disk filled before the budget did (other files share it, or the budget is
                # larger than the disk): give back a quarter of what the cache holds, at once.
                await self.evict_to(min(self.budget.low, int(core.usage * self.budget.low_fraction
                                                              / self.budget.high_fraction)))
            if core.usage <= self.budget.high:
                continue
            self.episode = True
            # While fetches keep coming, evict in batches (each pass sorts every cached chunk).
            midpoint = (self.budget.low + self.budget.high) // 2
            try:
                await self.evict_to(self.budget.low)
                while True:
                    if core.usage > midpoint:
                        await self.evict_to(self.budget.low)
                    quiet = True
                    with trio.move_on_after(SETTLE):
                        await self._next_kick()
                        quiet = False
                    if quiet:
                        n, _ = await self.evict_to(self.budget.low)
                        if core.usage <= self.budget.low or n == 0:
                            break
            finally:
                self.episode = False
            if core.usage > self.budget.high:
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
            self._kick.set()

    def _candidates(self, only: str | None = None) -> list[Candidate]:
        out = []
        core, held = self.core, self.holds.held
        busy, entries, disk_bytes = core.busy, core.entries, core.disk_bytes
        for blob, e in entries.items() if only is None else [(only, entries[only])]:
            if held(blob):
                continue  # a holder or a front end mounted its data file: never punched
            meta = set(e.metadata) if e.open_count else ()
            pins = e.pins
            unverified = e.unverified
            for i, p in enumerate(e.present):
                if (p or unverified[i]) and i not in pins and (blob, i) not in busy:
                    out.append(Candidate(blob, i, disk_bytes(e, i), e.last_use[i], i in meta))
        return out

    async def evict_to(self, target: int) -> tuple[int, int]:
        """Drop least recently used chunks until usage <= target (as far as unpinned chunks
        allow). Returns (chunks, bytes) dropped."""
        core, pins = self.core, self.holds.pinned
        victims = choose_victims(self._candidates(), core.usage, target)
        res = await self.drop([(v.blob, v.index) for v in victims])
        self._note_protected(target)
        if core.usage > target and pins:
            pinned = core.held_bytes(pins)
            now = time.monotonic()
            if pinned and now - self._pin_log_at >= PIN_LOG_INTERVAL:
                self._pin_log_at = now
                log.warning("cache: usage %d stays above the target %d: %d byte(s) of %d pinned blob(s) cannot "
                            "be evicted (their files are mounted directly)", core.usage, target, pinned,
                            len(pins))
        return res

    def _note_protected(self, target: int) -> None:
        """Say once (not per eviction pass) that usage stays above a target because protected
        blobs hold the rest; said again only after a pass met its target."""
        usage, protected = self.core.usage, self.holds.protected
        if usage <= target:
            self._protected_logged = False
            return
        if self._protected_logged or not protected:
            return
        held = self.core.held_bytes(protected)
        if held:
            self._protected_logged = True
            log.warning("cache: usage %d stays above the target %d: %d byte(s) of %d blob(s) mounted directly "
                        "(fanotify) are not evicted while mounted (evictable once detached; "
                        "`layerctl cache ls`: protected_bytes)", usage, target, held, len(protected))

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
        core, holds = self.core, self.holds
        out: dict[str, object] = {"evicted_chunks": n, "evicted_bytes": b, "used_bytes": core.usage,
                                  "pinned_bytes": core.held_bytes(holds.pinned),
                                  "protected_bytes": core.held_bytes(holds.protected)}
        if blob and digestmod.parse(blob) in holds.protected:
            out["skipped"] = ("protected: its data file is mounted directly (fanotify data path); "
                              "evictable once it is detached")
        return out

    async def drop_blob(self, blob: str) -> tuple[int, int]:
        holders = self.holds.pinned.get(blob)
        if holders:
            raise BlobPinned(f"blob {blob} is pinned by {', '.join(sorted(holders))} (its cache file is "
                             f"mounted directly): unpin it first")
        if blob not in self.core.entries or blob in self.holds.protected:
            return 0, 0
        return await self.drop([(c.blob, c.index) for c in self._candidates(blob)])

    async def drop(self, victims: Sequence[tuple[str, int]]) -> tuple[int, int]:
        """Evict specific chunks (skipping any that are pinned, protected, busy or absent). The
        chunks are made absent and their records' deletion and punches queued in one step, with
        no await in between (`protect` relies on it), then flushed."""
        core, held = self.core, self.holds.held
        busy = core.busy
        flight = Flight(DEMAND, "evict")
        per_blob: dict[str, list[tuple[int, int]]] = {}
        ops: list[ci.Op] = []
        taken: list[tuple[str, int]] = []
        nbytes = 0
        for blob, i in victims:
            e = core.entries.get(blob)
            if (e is None or not (e.present[i] or e.unverified[i]) or i in e.pins or (blob, i) in busy
                    or held(blob)):
                continue
            ref = e.cmap.chunks[i]
            n = core.release(e, (i,))  # from here on no reader starts on it
            busy[(blob, i)] = flight
            taken.append((blob, i))
            nbytes += n
            ops.append(ci.DelChunk(blob, i))
            per_blob.setdefault(blob, []).append((ref.offset, ref.length))
        if not taken:
            return 0, 0
        core.enqueue(ops, list(per_blob.items()))
        try:
            with trio.CancelScope(shield=True):
                await core.flush()
        finally:
            for key in taken:
                del busy[key]
            flight.done.set()
        self.evicted_chunks += len(taken)
        self.evicted_bytes += nbytes
        log.info("cache: evicted %d chunk(s), %d bytes; usage now %d", len(taken), nbytes, core.usage)
        return len(taken), nbytes
