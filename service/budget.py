"""A byte budget for the memory that checking PUT bodies takes (issue 27): decompressing a chunk
(up to 64 MiB from a body of a few KiB) and decoding a chunk map (~320 bytes an entry). Each check
holds its cost (`checks.decode_cost`) while it runs; one that costs more than the whole budget
holds all of it (it runs alone). Waiters are served in arrival order, so a large check is not
starved by small ones. One budget per worker process, on its event loop (no locks: every call
is on the loop's thread)."""

from __future__ import annotations

import contextlib
import os
from collections import deque
from collections.abc import AsyncIterator

import anyio

BUDGET_ENV = "LAYERSTORE_SERVE_DECODE_BUDGET"
DEFAULT_BUDGET = 256 << 20


def budget_from_env() -> int:
    """The budget in bytes: `LAYERSTORE_SERVE_DECODE_BUDGET` (bytes, or with a K/M/G suffix)."""
    raw = (os.environ.get(BUDGET_ENV) or "").strip()
    if not raw:
        return DEFAULT_BUDGET
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(raw[-1].upper(), 1)
    n = int(raw[:-1] if scale > 1 else raw) * scale
    if n <= 0:
        raise ValueError(f"{BUDGET_ENV}={raw!r}: want a positive size")
    return n


class ByteBudget:
    def __init__(self, total: int = DEFAULT_BUDGET) -> None:
        self.total = total
        self.free = total
        self.peak = 0  # the most held at once (for the metrics and the tests)
        self._waiters: deque[tuple[int, anyio.Event]] = deque()

    @property
    def held(self) -> int:
        return self.total - self.free

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @contextlib.asynccontextmanager
    async def hold(self, cost: int) -> AsyncIterator[None]:
        """Hold `cost` bytes (at most the whole budget) for the body of the `async with`."""
        n = min(max(cost, 0), self.total)
        if not self._waiters and self.free >= n:
            self._take(n)
        else:
            item = (n, anyio.Event())
            self._waiters.append(item)
            try:
                await item[1].wait()
            except BaseException:
                if item[1].is_set():  # granted as it was cancelled: give it back
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
