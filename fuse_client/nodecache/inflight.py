"""A fetch in flight: the cache's handle for writing one chunk's verified bytes (as stargz's
`BlobCache` writer: write, then commit or abort).

`NodeCache.begin_fetch` registers one `Flight` on every position it covers (positions of one
blob with the same digest) in `NodeCache.busy`: readers of them wait on it, eviction and
verification leave them alone. The fetcher then writes the verified bytes into the data file
(`write` or `copy`, worker thread) and ends the flight on the trio thread: `commit` (the
positions become servable at once and durable at the journal's next batch) or `abort` (nothing
served; the waiters see the error, or none: they try again). Either releases the positions and
wakes the waiters; a process that dies before leaves bytes without a record (recovery punches
them), never a record without bytes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from .entry import BlobEntry, Flight
from .errors import CacheIOError


class FetchWriter:
    """Made by `NodeCache.begin_fetch`: `busy` is the cache's map of operations in progress,
    `on_commit` its `commit` (the positions servable, their records queued)."""

    __slots__ = ("busy", "on_commit", "entry", "positions", "flight")

    def __init__(self, busy: dict[tuple[str, int], Flight], on_commit: Callable[[BlobEntry, Sequence[int]], None],
                 entry: BlobEntry, positions: list[int], flight: Flight) -> None:
        self.busy = busy
        self.on_commit = on_commit
        self.entry = entry
        self.positions = positions
        self.flight = flight

    @property
    def done(self) -> bool:
        return self.flight.done.is_set()

    def write(self, payload: bytes | memoryview, frame: bytes | memoryview | None = None) -> None:
        """Worker thread: the verified payload (in a zstd cache: its store frame, if any) at
        every position. `CacheIOError` if the cache's disk refuses it. Touches no shared state:
        `entry.fd` and the chunk map are immutable while the entry lives."""
        try:
            self.entry.write_sync(self.positions, payload, frame)
        except OSError as e:
            raise CacheIOError(f"writing to the cache: {os.strerror(e.errno or 0)}", e.errno) from None

    def copy(self, src: int, positions: list[int]) -> None:
        """Worker thread: the verified bytes at position `src` (same digest, already verified)
        written at `positions` (some of this flight's)."""
        entry = self.entry
        ref = entry.cmap.chunks[src]
        try:
            payload = entry.read_sync(ref.offset, ref.end)
        except OSError as e:
            raise CacheIOError(f"reading the cache: {os.strerror(e.errno or 0)}", e.errno) from None
        try:
            entry.write_sync(positions, payload, None)
        except OSError as e:
            raise CacheIOError(f"writing to the cache: {os.strerror(e.errno or 0)}", e.errno) from None

    def commit(self) -> None:
        """Trio thread, after the bytes were written: every position becomes servable now (and
        durable at the journal's next batch); the flight ends."""
        self.on_commit(self.entry, self.positions)
        self._end()

    def abort(self, error: BaseException | None = None) -> None:
        """Trio thread: the flight ends without serving anything (idempotent; a flight already
        ended is left as it is). `error` is what its waiters see; None: they simply try again."""
        if self.done:
            return
        self.flight.error = error
        self._end()

    def _end(self) -> None:
        busy, blob, fl = self.busy, self.entry.blob, self.flight
        for i in self.positions:
            if busy.get((blob, i)) is fl:
                del busy[(blob, i)]
        fl.done.set()
