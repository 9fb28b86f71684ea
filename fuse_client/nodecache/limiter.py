"""The node's cap on store requests in flight, shared by two classes (pure ordering and counting:
no I/O, nothing about chunks).

- **Urgent** (priority `DEMAND`): chunk maps, metadata before a mount, a reader waiting on a
  miss. **Background** (`PREFETCH`): readahead windows and prefetch.
- At most `slots` requests hold a slot at once (one store request each: a GET, a batched read).
- A freed slot goes to the waiter with the lowest (priority, arrival): a queued urgent request
  is always served before any queued background one.
- Background holds at most `background` slots (default three quarters), so an urgent request
  finds a slot free at once unless urgent work itself fills the rest; and while urgent requests
  wait or are in flight (*pressure*), or while a burst of them goes on (`burst` urgent requests
  granted within the last `linger` seconds: sandboxes reading between short pauses), a new
  background request starts only while fewer than `background_busy` background ones are in
  flight. (Without the burst rule, background refilled its slots in every pause between
  readers' misses, and the next misses shared the store with all of them again.) A lone
  sequential reader's first misses are no burst, and a queued background request raised to
  urgent by a reader joining it counts toward none (`owner.burst` False): a reader catching up
  with its own readahead does not hold that readahead back.
- So an urgent request shares the store with at most `background` background requests that were
  already running when it came, and that number falls to `background_busy` as they end: on a
  slow store it is the link they share that the urgent request waits on, not a slot.
- A priority may rise while its owner waits or holds a slot (a reader joins a queued or running
  prefetch): `reprioritized(owner)`. A waiter is then ordered as urgent and counts as pressure; a
  holder stops counting as background (it is what a reader waits for), without adding pressure
  (a reader joining its own readahead must not throttle that readahead).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Protocol

import trio

DEMAND = 0
PREFETCH = 1

URGENT, BACKGROUND, JOINED = 0, 1, 2  # a holder's class for the counts
BURST = 4  # urgent requests granted within LINGER seconds: a burst of readers
LINGER = 1.0


class HasPriority(Protocol):
    priority: int


class _Waiter:
    __slots__ = ("seq", "owner", "cls", "event", "granted")

    def __init__(self, seq: int, owner: HasPriority, cls: int) -> None:
        self.seq = seq
        self.owner = owner
        self.cls = cls  # its class when last counted in `_urgent_waiting` (`reprioritized` recounts)
        # Made only when it has to wait: most requests find a slot free at once (one request per
        # chunk fetched, so it counts: docs/benchmarks-fetch.md, "CPU of the fetch path").
        self.event: trio.Event | None = None
        self.granted = False


def default_background(slots: int) -> int:
    return max(1, slots * 3 // 4)


def default_background_busy(slots: int) -> int:
    return max(1, slots // 8)


class PriorityLimiter:
    def __init__(self, slots: int, *, background: int | None = None, background_busy: int | None = None,
                 fifo: bool = False, burst: int = BURST, linger: float = LINGER) -> None:
        """`fifo`: no classes at all (arrival order, background may take every slot): the
        baseline of bench/fetch_fairness.py, never the daemon's."""
        if slots < 1:
            raise ValueError("a limiter needs at least one slot")
        self.slots = slots
        self.fifo = fifo
        self.background = slots if fifo else min(slots, background or default_background(slots))
        self.background_busy = self.background if fifo else min(
            self.background, background_busy or default_background_busy(slots))
        self._free = slots
        self._waiters: list[_Waiter] = []
        self._held: dict[int, int] = {}  # id(owner) -> URGENT | BACKGROUND | JOINED
        self._counts = [0, 0, 0]  # holders per class
        self._urgent_waiting = 0
        self._seq = itertools.count()
        self.burst = burst
        self.linger = linger
        self._urgent_grants: deque[float] = deque(maxlen=max(1, burst))  # when the last `burst` were granted
        self.peak = 0  # most slots ever held at once
        self.background_passed = 0  # background grants made while an urgent request waited (0 unless fifo)

    @property
    def in_use(self) -> int:
        return self.slots - self._free

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @property
    def background_in_use(self) -> int:
        return self._counts[BACKGROUND]

    @property
    def pressure(self) -> int:
        """Urgent requests waiting for a slot or holding one."""
        return self._urgent_waiting + self._counts[URGENT]

    def share(self, priority: int) -> int:
        """How many requests of this priority may be in flight now: every slot for urgent
        ones (less those background holds), background's limit for background ones."""
        if self.fifo or priority <= DEMAND:
            return self.slots - (0 if self.fifo else self._counts[BACKGROUND])
        return self.background_busy if self.in_burst() else self.background

    def in_burst(self) -> bool:
        """Urgent work now, or `burst` urgent requests granted within the last `linger` s."""
        if self.pressure:
            return True
        g = self._urgent_grants
        return self.burst > 0 and len(g) >= self.burst and trio.current_time() - g[0] <= self.linger

    def _cls(self, owner: HasPriority) -> int:
        return URGENT if owner.priority <= DEMAND else BACKGROUND

    @asynccontextmanager
    async def hold(self, owner: HasPriority) -> AsyncIterator[None]:
        await self.acquire(owner)
        try:
            yield
        finally:
            self.release(owner)

    async def acquire(self, owner: HasPriority) -> None:
        w = _Waiter(next(self._seq), owner, self._cls(owner))
        self._waiters.append(w)
        if w.cls == URGENT:
            self._urgent_waiting += 1
        self._grant()
        if w.granted:
            return
        w.event = trio.Event()
        try:
            await w.event.wait()
        except BaseException:
            if w.granted:
                self.release(owner)  # handed a slot while being cancelled: pass it on
            else:
                self._drop(w)
                self._grant()  # a background waiter may have been held back by this one's pressure
            raise

    def release(self, owner: HasPriority) -> None:
        cls = self._held.pop(id(owner))
        self._counts[cls] -= 1
        self._free += 1
        self._grant()

    def reprioritized(self, owner: HasPriority) -> None:
        """`owner.priority` changed (rose: a reader joined): re-class it, waiting or holding."""
        key = id(owner)
        if key in self._held:
            if self._held[key] == BACKGROUND and self._cls(owner) == URGENT:
                self._counts[BACKGROUND] -= 1
                self._counts[JOINED] += 1
                self._held[key] = JOINED
                self._grant()  # one background fewer in flight
            return
        for w in self._waiters:
            if w.owner is owner:
                # Waiters are re-classed by their priority; recount the urgent ones.
                w.cls = self._cls(owner)
                self._urgent_waiting = sum(1 for x in self._waiters if x.cls == URGENT)
                self._grant()
                return

    def _drop(self, w: _Waiter) -> None:
        self._waiters.remove(w)
        if w.cls == URGENT:
            self._urgent_waiting -= 1

    def _grant(self) -> None:
        while self._free > 0 and self._waiters:
            # Queues are short (bounded by the prefetch tokens and the readers), so a scan beats
            # keeping a heap consistent under priority changes.
            if self.fifo or len(self._waiters) == 1:
                best = self._waiters[0]
            else:
                best = min(self._waiters, key=lambda w: (self._cls(w.owner), w.owner.priority, w.seq))
            cls = self._cls(best.owner)
            if cls == BACKGROUND and not self.fifo:
                limit = self.background_busy if self.in_burst() else self.background
                if self._counts[BACKGROUND] >= limit:
                    return
            if cls == BACKGROUND and self._urgent_waiting:
                self.background_passed += 1
            elif cls == URGENT and getattr(best.owner, "burst", True):
                self._urgent_grants.append(trio.current_time())
            self._drop(best)
            self._free -= 1
            self._held[id(best.owner)] = cls
            self._counts[cls] += 1
            self.peak = max(self.peak, self.in_use)
            best.granted = True
            if best.event is not None:
                best.event.set()
