"""The node's in-use report to the store's garbage collector: one lease of kind "node" that
holds the chunk-map keys of every blob the node uses (docs/gc.md, the node side; the protocol is
`layerstore.leases`, the collector `layergc`).

State (all on the daemon's trio thread, except the lease's own, behind its lock):

- `seen`: blob -> when (wall clock) the daemon last saw it in use (a request about it, an open
  handle, a pin). A blob seen within the last `linger` seconds counts as in use.
- `vouched`: blobs held by the lease *and* checked after the hold (sweeps waited out, the
  object found): relied on without another look. Always a subset of what the lease holds.
- `held`: what the lease holds, as last written by this process.
- `_mu` (a trio lock) orders holds and rotations: a hold never lands in a shard that a rotation
  is deleting.

`guard(blob)` runs before the daemon relies on a blob (LazyCache: lookups, opens, prefetches,
pins); `rotate()` (every `interval`, from `run`) rewrites the lease to exactly the in-use set;
`release()` at a clean shutdown. A store that refuses the lease (`PermissionDenied`: read-only
access) disables all of it after one warning: the node then relies on the collector's grace.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

import trio

from layerstore import keys, leases
from layerstore.backends import Backend
from layerstore.errors import LayerstoreError, NotFound, PermissionDenied, StoreUnavailable

if TYPE_CHECKING:
    from .cache import NodeCache

log = logging.getLogger("layerstore.fuse.inuse")

DEFAULT_INTERVAL = 60.0  # seconds between rotations
INTERVAL_ENV = "LAYERSTORE_NODE_LEASE_INTERVAL"


def interval_from_env(default: float = DEFAULT_INTERVAL) -> float:
    """The rotation interval: $LAYERSTORE_NODE_LEASE_INTERVAL (seconds, > 0) if set, else `default`."""
    raw = os.environ.get(INTERVAL_ENV, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not value > 0 or value == math.inf:
        log.warning("%s=%r is not a positive number of seconds; using %g", INTERVAL_ENV, raw, default)
        return default
    return value


def blob_key(blob: str) -> str:
    return keys.object_key("blobs", blob)


class NodeLease:
    def __init__(self, cache: NodeCache, backend: Backend | None, *, name: str, interval: float = DEFAULT_INTERVAL,
                 linger: float | None = None, ttl: float = leases.DEFAULT_TTL,
                 clock: Callable[[], float] = time.time) -> None:
        """`backend`: the store's (None: no store to report to, nothing is written); `name`: the
        lease's name (host and cache directory); `linger`: how long a blob the daemon was asked
        about stays in use without an open handle or a pin (default: one `interval`)."""
        self.cache = cache
        self.backend = backend
        self.name = name
        self.interval = interval
        self.linger = interval if linger is None else linger
        self.ttl = ttl
        self.clock = clock
        self.lease: leases.Lease | None = None
        self.disabled = backend is None
        self.seen: dict[str, float] = {}
        self.vouched: set[str] = set()
        self.held: frozenset[str] = frozenset()
        self.rotations = 0  # lease rewrites (a rotation that changes nothing writes nothing)
        self.protected = 0  # guards that held and checked a blob
        self._flights: dict[str, trio.Event] = {}
        self._settling: set[str] = set()  # held, being checked: in use whatever `linger` says
        self._mu = trio.Lock()
        self._last_error = ""

    # -- before relying on a blob ----------------------------------------------------------------
    async def guard(self, blob: str) -> None:
        """Return once the daemon may rely on `blob`: held by the lease, no sweep that may delete
        it still running, and (for an entry the node already knows) still in the store.
        `NotFound` if the store lost it; `StoreUnavailable` if the lease cannot be written
        and the node does not know the blob (one it knows is served from the cache meanwhile, as
        without a lease)."""
        if self.disabled or blob in self.vouched:
            self.seen[blob] = self.clock()
            return
        while not (self.disabled or blob in self.vouched):
            fl = self._flights.get(blob)
            if fl is not None:  # someone protects it now: share the outcome, or try again ourselves
                await fl.wait()
                continue
            fl = self._flights[blob] = trio.Event()
            try:
                await self._protect(blob)
            finally:
                del self._flights[blob]
                fl.set()
            return

    async def _protect(self, blob: str) -> None:
        known = self.cache.get(blob) is not None
        try:
            if not known and not await trio.to_thread.run_sync(self.backend_exists, blob):
                # (a filter, not the check: a digest the store never had costs no lease write)
                raise NotFound(f"blob {blob} is not in the store")
            self.seen[blob] = self.clock()
            async with self._mu:
                await trio.to_thread.run_sync(self._hold_sync, [blob])
                self._settling.add(blob)
            try:
                await trio.to_thread.run_sync(self._settle_sync, blob, known)
            finally:
                self._settling.discard(blob)
        except PermissionDenied as e:
            self._disable(e)
            return
        except StoreUnavailable as e:
            if self.cache.get(blob) is None:
                raise  # (its chunk map could not be loaded either)
            # Known to the node: what it caches is served while the store is away, as without a
            # lease. Counted as relied on (not asked again at every request); the next rotation
            # that reaches the store holds it, without waiting out sweeps (docs/gc.md, the node side).
            self._warn(f"cannot protect blob {blob} in the store ({e}); serving what the node cache holds")
            self.vouched.add(blob)
            return
        self.vouched.add(blob)
        self.protected += 1

    def backend_exists(self, blob: str) -> bool:
        assert self.backend is not None
        return self.backend.exists(blob_key(blob))

    def _hold_sync(self, blobs: Collection[str]) -> None:
        """Worker thread, under `_mu`: the keys added to the lease (opened on first use)."""
        assert self.backend is not None
        held = self.held | set(blobs)
        if self.lease is None:
            lease = leases.Lease(self.backend, kind="node", name=self.name, ttl=self.ttl)
            lease.open([blob_key(b) for b in held])
            self.lease = lease
            log.info("node lease %s (%s) opened with %d blob(s)", lease.id, self.name, len(held))
        else:
            self.lease.hold([blob_key(b) for b in blobs])
        self.held = frozenset(held)

    def _settle_sync(self, blob: str, known: bool) -> None:
        """Worker thread: wait out the sweeps that may delete the blob, then check that it is
        there (a new entry's chunk map is loaded next, which checks it)."""
        assert self.backend is not None
        key = blob_key(blob)
        runs = leases.conflicting_sweeps(self.backend, [key])
        if runs:
            log.info("blob %s: waiting for gc run(s) %s to end before using it", blob, [r.id for r in runs])
            leases.wait_out(self.backend, runs)
        if known and not self.backend.exists(key):
            raise NotFound(f"blob {blob} is not in the store any more")

    # -- what the node uses ----------------------------------------------------------------------
    def in_use(self) -> set[str]:
        """Trio thread: the blobs in use now (pinned, open, being protected, or seen lately)."""
        now = self.clock()
        cache = self.cache
        blobs = set(cache.holds.pinned) | {b for b, e in cache.entries.items() if e.open_count} | self._settling
        for b in blobs:
            self.seen[b] = now
        cutoff = now - self.linger
        return blobs | {b for b, t in self.seen.items() if t >= cutoff}

    def last_seen(self) -> dict[str, float]:
        """For `Forgetting.gc_unused`: blob -> when last seen in use, inf for those in use now."""
        now_in_use = self.in_use()
        return {b: (math.inf if b in now_in_use else t) for b, t in self.seen.items()}

    async def rotate(self) -> None:
        """Make the lease hold exactly the in-use set (writes only if it changed)."""
        async with self._mu:
            blobs = frozenset(self.in_use())
            # Forget what nothing uses (bounded by the cache's entries): a later use protects again.
            self.vouched &= blobs
            self.seen = {b: t for b, t in self.seen.items() if b in blobs or b in self.cache.entries}
            if self.disabled or (self.lease is not None and blobs == self.held):
                return
            if self.lease is None and not blobs:
                return  # nothing to report yet: the lease is written on first use
            try:
                await trio.to_thread.run_sync(self._replace_sync, blobs)
            except PermissionDenied as e:
                self._disable(e)

    def _replace_sync(self, blobs: frozenset[str]) -> None:
        assert self.backend is not None
        if self.lease is None:
            self.held = frozenset()
            self._hold_sync(blobs)
            return
        self.lease.replace_keys([blob_key(b) for b in blobs])
        self.held = blobs
        self.rotations += 1

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Rotate now (the pins the node holds since before this start) and every `interval`."""
        task_status.started()
        while True:
            try:
                await self.rotate()
            except LayerstoreError as e:
                self._warn(f"cannot rotate the node lease: {e} (tried again in {self.interval:g} s)")
            await trio.sleep(self.interval)

    async def release(self) -> None:
        """At a clean shutdown: delete the lease (after kill -9 it expires on its own)."""
        async with self._mu:
            lease, self.lease = self.lease, None
            self.disabled = True  # a late request opens no new lease
            self.vouched.clear()
            self.held = frozenset()
            if lease is not None:
                await trio.to_thread.run_sync(lease.release)
                log.info("node lease %s released", lease.id)

    # -- reporting ---------------------------------------------------------------------------------
    def _disable(self, e: PermissionDenied) -> None:
        if not self.disabled:
            log.warning("node lease: the store refuses this node's lease (%s): this node does not report the "
                        "blobs it uses and relies on the collector's grace period (docs/gc.md, the node side)", e)
        self.disabled = True
        self.vouched.clear()

    def _warn(self, message: str) -> None:
        if message != self._last_error:  # once per distinct failure, not once per request
            log.warning("node lease: %s", message)
            self._last_error = message

    def to_json(self) -> dict[str, object]:
        return {"lease": self.lease.id if self.lease is not None else None, "name": self.name,
                "disabled": self.disabled, "held": sorted(self.held), "vouched": len(self.vouched),
                "rotations": self.rotations, "protected": self.protected, "interval": self.interval}
