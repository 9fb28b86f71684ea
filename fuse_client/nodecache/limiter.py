"""A trio capacity limiter whose waiters are served by priority, and whose priority can rise
while they wait (a demand read joining a queued prefetch boosts it).

Lower numbers are served first; ties go in arrival order. The limiter only orders and counts:
it owns no I/O and knows nothing about chunks.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Protocol

import trio

DEMAND = 0
PREFETCH = 1


class HasPriority(Protocol):
    priority: int


class _Waiter:
    __slots__ = ("seq", "owner", "event", "granted")

    def __init__(self, seq: int, owner: HasPriority) -> None:
        self.seq = seq
        self.owner = owner
        self.event = trio.Event()
        self.granted = False


class PriorityLimiter:
    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError("a limiter needs at least one slot")
        self.slots = slots
        self._free = slots
        self._waiters: list[_Waiter] = []
        self._seq = itertools.count()

    @property
    def in_use(self) -> int:
        return self.slots - self._free

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @asynccontextmanager
    async def hold(self, owner: HasPriority) -> AsyncIterator[None]:
        await self.acquire(owner)
        try:
            yield
        finally:
            self.release()

    async def acquire(self, owner: HasPriority) -> None:
        if self._free > 0 and not self._waiters:
            self._free -= 1
            return
        w = _Waiter(next(self._seq), owner)
        self._waiters.append(w)
        try:
            await w.event.wait()
        except BaseException:
            if w.granted:
                self.release()  # handed a slot while being cancelled: pass it on
            else:
                self._waiters.remove(w)
            raise

    def release(self) -> None:
        if self._waiters:
            # Queues are short (bounded by in-flight fetches), so a scan beats keeping a heap
            # consistent under priority changes.
            best = min(self._waiters, key=lambda w: (w.owner.priority, w.seq))
            self._waiters.remove(best)
            best.granted = True
            best.event.set()
        else:
            self._free += 1
