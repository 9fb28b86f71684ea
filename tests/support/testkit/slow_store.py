"""A store that answers slowly, for the node cache's fairness tests and bench/fetch_fairness.py: a
backend wrapper adding a latency to every request and sending every object over one shared link
of a given rate (concurrent transfers share it, piece by piece, as flows share a link), counting
requests in flight (and their peak) and, optionally, reading several objects a request
(`load_many` as the http backend does: one latency, then the objects one after the other).
`gate` (a `threading.Event`, set by default) holds every request until it is set; `holds` (key ->
`threading.Event`) holds a request for that key until its event is set."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence

from layerstore.backends.base import Backend
from layerstore.errors import LayerstoreError

from .fuse_helpers import CountingBackend

PIECE = 64 << 10  # bytes a transfer sends before the next transfer gets the link


class Link:
    """One link of `rate` bytes/s shared by every transfer (None: no limit)."""

    def __init__(self, rate: float | None) -> None:
        self.rate = rate
        self._lock = threading.Lock()
        self._free_at = 0.0

    def send(self, nbytes: int) -> None:
        if not self.rate:
            return
        left = nbytes
        while left > 0:
            piece = min(PIECE, left)
            left -= piece
            with self._lock:
                now = time.monotonic()
                start = max(now, self._free_at)
                self._free_at = start + piece / self.rate
                until = self._free_at
            time.sleep(max(0.0, until - time.monotonic()))


class SlowBackend(CountingBackend):
    """`CountingBackend`'s counts (`loads`, `chunk_loads`, `fail`) and pass-through writes, with
    slow reads."""

    def __init__(self, inner: Backend, *, latency: float = 0.0, rate: float | None = None,
                 batching: bool = False) -> None:
        super().__init__(inner)
        self.latency = latency
        self.link = Link(rate)
        self.batching = batching
        self.gate = threading.Event()
        self.gate.set()
        self.holds: dict[str, threading.Event] = {}
        self.requests = 0  # store requests (a batch is one)
        self.batches: list[int] = []  # keys per batched request
        self.in_flight = 0
        self.peak = 0
        self.corrupt: set[str] = set()  # keys answered with flipped bytes

    @property
    def reads_in_batches(self) -> bool:
        return self.batching

    def _begin(self, keys: Sequence[str]) -> None:
        with self._lock:
            self.requests += 1
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
            for k in keys:
                self.loads[k] += 1
            fail = self.fail
        if fail is not None:
            self._end()
            raise fail
        self.gate.wait(30)
        for k in keys:
            if k in self.holds:
                self.holds[k].wait(30)
        if self.latency:
            time.sleep(self.latency)

    def _end(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def _object(self, key: str, max_size: int | None) -> bytes:
        data = self.inner.load(key, max_size=max_size)
        if key in self.corrupt:
            data = data[:-1] + bytes([data[-1] ^ 0xFF])
        self.link.send(len(data))
        return data

    def load(self, key: str, offset: int = 0, size: int | None = None, *, max_size: int | None = None) -> bytes:
        self._begin([key])
        try:
            if offset or size is not None:
                return self.inner.load(key, offset, size, max_size=max_size)
            return self._object(key, max_size)
        finally:
            self._end()

    def load_many(self, keys: Sequence[str], *, max_size: int | None = None
                  ) -> Iterator[tuple[str, bytes | LayerstoreError]]:
        if not self.batching:
            yield from super().load_many(keys, max_size=max_size)
            return
        with self._lock:
            self.batches.append(len(keys))
        self._begin(keys)
        try:
            for key in keys:
                try:
                    value: bytes | LayerstoreError = self._object(key, max_size)
                except LayerstoreError as e:
                    value = e
                yield key, value
        finally:
            self._end()
