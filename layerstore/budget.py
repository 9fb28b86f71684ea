"""A byte budget shared by the async code that decodes untrusted objects (issue 27): the store
service checking PUT bodies (asyncio) and the node daemon's fetcher verifying and decompressing
chunks (trio). A chunk's payload can be 64 MiB from an object of a few KiB, a chunk map ~320 bytes
an entry, so each decode holds its cost while it runs; one that costs more than the whole budget
holds all of it (it runs alone). Waiters are served in arrival order, so a large decode is not
starved by small ones. One budget per event loop, used from the loop's thread only (no locks);
anyio's Event works on either loop.

`size_from_env` reads the budgets' sizes: bytes, or with a K/M/G suffix."""

from __future__ import annotations

import contextlib
import os
from collections import deque
from collections.abc import AsyncIterator

import anyio

from .errors import ConfigError

_SCALE = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def size_from_env(name: str, default: int, *, zero_ok: bool = False) -> int:
    """$name as a size in bytes (`123`, `64K`, `256M`, `2G`), else `default`. Zero only where it
    means something (`zero_ok`: no limit); a bad value is a `ConfigError` naming the variable."""
    raw = (os.environ.get(name) or "").strip()
    if not raw:
        return default
    scale = _SCALE.get(raw[-1].upper(), 1)
    try:
        n = int(raw[:-1] if scale > 1 else raw) * scale
    except ValueError:
        raise ConfigError(f"{name}={raw!r}: expected a size in bytes (K/M/G suffixes)") from None
    if n < 0 or (n == 0 and not zero_ok):
        raise ConfigError(f"{name}={raw!r}: expected a positive size")
    return n


class ByteBudget:
    def __init__(self, total: int) -> None:
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
