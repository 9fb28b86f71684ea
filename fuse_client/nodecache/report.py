"""The node's figures for the store's status page (docs/status-page.md, "Nodes").

Every `interval` seconds the daemon writes one small JSON record beside its node lease, at
`leases/<lease id>/r<seq>`: what the node caches and has fetched, its read hits and misses, and
the last `MAX_SAMPLES` samples of those counters (so the page can draw a fetch rate over the last
minutes without having watched the node itself). The record lives under the lease's own prefix
because the service lets only the lease's owner write there (`service.leaseowner`); such keys
are create-once, so each record is a new key and the previous one is deleted after it. A
collector reads only a lease's head and its shards (`s<seq>`): a record holds nothing, and its
deletion never races the collector's reading of the lease.

State (the daemon's trio thread only): `samples` (the ring), `seq` and `current` (the key of the
last record written, and the lease it belongs to). Nothing here is needed by the data path: a
failed write is logged once and tried again at the next tick.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from layerstore import leases
from layerstore.errors import LayerstoreError
from layerstore.keys import validate

if TYPE_CHECKING:
    from .cache import NodeCache
    from .stats import Stats

log = logging.getLogger("layerstore.fuse.report")

FORMAT = 1
DEFAULT_INTERVAL = 10.0  # seconds between two records
INTERVAL_ENV = "LAYERSTORE_NODE_REPORT_INTERVAL"
MAX_SAMPLES = 60  # ten minutes at the default interval
LEAF = "r"


@dataclass(frozen=True)
class Figures:
    """The node's counters at one moment (totals since the daemon started, but `cached_bytes`)."""

    cached_bytes: int
    fetched_bytes: int
    hits: int
    misses: int
    blobs: int


def node_figures(cache: NodeCache, stats: Stats) -> Figures:
    """Trio thread: the cache's size and the read path's counters summed over blobs."""
    fetched = hits = misses = 0
    for st in stats.blobs.values():
        fetched += st.fetched_bytes
        hits += st.hits
        misses += st.misses
    return Figures(cache.usage, fetched, hits, misses, len(cache.entries))


def report_key(lease_id: str, seq: int) -> str:
    return validate(f"{leases.LEASES}{lease_id}/{LEAF}{seq:08d}")


def interval_from_env(default: float = DEFAULT_INTERVAL) -> float:
    raw = os.environ.get(INTERVAL_ENV, "").strip()
    try:
        value = float(raw) if raw else default
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        log.warning("%s=%r is not a positive number of seconds; using %g", INTERVAL_ENV, raw, default)
        return default
    return value


class NodeReport:
    def __init__(self, lease: Callable[[], leases.Lease | None], figures: Callable[[], Figures], *, name: str,
                 interval: float = DEFAULT_INTERVAL, clock: Callable[[], float] = time.time) -> None:
        """`lease`: the node lease now (None: not opened yet, or released); `figures`: the
        node's counters now; `name`: the node's name (the lease's)."""
        self.lease = lease
        self.figures = figures
        self.name = name
        self.interval = interval
        self.clock = clock
        self.samples: deque[tuple[float, int, int, int]] = deque(maxlen=MAX_SAMPLES)
        self.seq = 0
        self.current: tuple[leases.Lease, str] | None = None
        self.stopped = False  # released: nothing more is written
        self._last_error = ""

    def record(self) -> dict[str, object]:
        """Take a sample and return the record to write."""
        now, f = self.clock(), self.figures()
        self.samples.append((round(now, 3), f.fetched_bytes, f.hits, f.misses))
        return {"format": FORMAT, "name": self.name, "time": round(now, 3), "interval": self.interval,
                "cached_bytes": f.cached_bytes, "fetched_bytes": f.fetched_bytes, "hits": f.hits,
                "misses": f.misses, "blobs": f.blobs, "samples": [list(s) for s in self.samples]}

    async def publish(self) -> None:
        body = json.dumps(self.record(), separators=(",", ":")).encode()
        lease = self.lease()
        if lease is None or self.stopped:
            return  # no lease yet: the node has used nothing (its sample is kept for the plot)
        key = report_key(lease.id, self.seq)
        self.seq += 1
        await trio.to_thread.run_sync(lease.backend.store_once, key, body)
        if self.stopped:  # released while this one was written: it goes too
            await trio.to_thread.run_sync(lease.backend.delete, key)
            return
        previous, self.current = self.current, (lease, key)
        if previous is not None and previous[0] is lease:
            await trio.to_thread.run_sync(lease.backend.delete, previous[1])
        # (a previous lease's record went with that lease: released, or left to the collector)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            try:
                await self.publish()
            except LayerstoreError as e:
                if str(e) != self._last_error:
                    log.warning("node report: not written (%s); tried again in %g s", e, self.interval)
                    self._last_error = str(e)
            await trio.sleep(self.interval)

    async def release(self) -> None:
        """At a clean shutdown, before the lease's release: delete the last record."""
        self.stopped = True
        current, self.current = self.current, None
        if current is not None:
            try:
                await trio.to_thread.run_sync(current[0].backend.delete, current[1])
            except LayerstoreError as e:  # the collector removes it with the lease
                log.warning("node report: last record not deleted (%s)", e)
