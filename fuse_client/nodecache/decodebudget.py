"""The node's budget for the memory that fetched chunks take while they are verified and
decompressed (issue 27): a chunk's payload can be 64 MiB from an object of a few KiB, and the
fetcher has up to `concurrency` store requests in flight. Each decode holds its cost (`cost`)
while its worker thread runs; one that costs more than the whole budget holds all of it (it runs
alone). Waiters are served in arrival order. Trio thread only (no locks).

A decode abandoned by a cancelled flight (`abandon_on_cancel`) gives its share back when the
flight ends, while its thread may still finish in the background: such threads are bounded by
the fetcher's thread limiter, not by this budget."""

from __future__ import annotations

import contextlib
import os
from collections import deque
from collections.abc import AsyncIterator, Iterable

import trio

BUDGET_ENV = "LAYERSTORE_DECODE_BUDGET"
DEFAULT_BUDGET = 128 << 20


def budget_from_env() -> int:
    """`LAYERSTORE_DECODE_BUDGET` in bytes (or with a K/M/G suffix), else 128 MiB."""
    raw = (os.environ.get(BUDGET_ENV) or "").strip()
    if not raw:
        return DEFAULT_BUDGET
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(raw[-1].upper(), 1)
    n = int(raw[:-1] if scale > 1 else raw) * scale
    if n <= 0:
        raise ValueError(f"{BUDGET_ENV}={raw!r}: want a positive size")
    return n


def cost(lengths: Iterable[int]) -> int:
    """What decoding chunks of these lengths (from their verified chunk map) holds at once, one
    request's worth: one chunk's payload and its object (a raw object is as long as its payload;
    a payload is copied or decompressed out of it), plus the objects of the others (a batched
    read may have them all in before they are decoded one by one)."""
    ls = list(lengths)
    return sum(ls) + max(ls, default=0)


class DecodeBudget:
    def __init__(self, total: int = DEFAULT_BUDGET) -> None:
        self.total = total
        self.free = total
        self.peak = 0
        self._waiters: deque[tuple[int, trio.Event]] = deque()

    @property
    def held(self) -> int:
        return self.total - self.free

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @contextlib.asynccontextmanager
    async def hold(self, n: int) -> AsyncIterator[None]:
        n = min(max(n, 0), self.total)
        if not self._waiters and self.free >= n:
            self._take(n)
        else:
            item = (n, trio.Event())
            self._waiters.append(item)
            try:
                await item[1].wait()
            except BaseException:
                if item[1].is_set():
                    self._give(n)
                else:
                    self._waiters.remove(item)
                    self._wake()
                raise
        try:
            yield
        finally:
            self._give(n)

    def _take(self, n: int) -> None:
        self.free -= n
        self.peak = max(self.peak, self.total - self.free)

    def _give(self, n: int) -> None:
        self.free += n
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self._waiters[0][0] <= self.free:
            n, ev = self._waiters.popleft()
            self._take(n)
            ev.set()
