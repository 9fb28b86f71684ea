"""One thread that expires in-memory deadlines (the layers held ahead of their Prepare): it sleeps
until the earliest deadline, or until it is poked about a new one, and hands each key whose
deadline has passed to `expire`. The deadlines stay their owner's (`read` returns a copy); what
expiring means, and whether a key is still due when its turn comes, is the owner's to decide.

`due` is the pure part: which keys are due at `now`, and when the next one is."""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Mapping

log = logging.getLogger("layerstore.snapshotter")
RETRY = 1.0  # seconds before a key `expire` left due is handed to it again


def due(deadlines: Mapping[str, float], now: float) -> tuple[list[str], float | None]:
    """The keys whose deadline is at or before `now` (sorted), and the earliest deadline still to
    come (None if none: an infinite deadline, a hold still being taken, never comes)."""
    passed = sorted(k for k, d in deadlines.items() if d <= now)
    later = [d for d in deadlines.values() if now < d < math.inf]
    return passed, min(later, default=None)


class Sweeper:
    """`expire(key)` for each key of `read()` whose deadline has passed (monotonic clock), in
    one daemon thread started on the first `poke`. `expire` should remove the key or move its
    deadline (a key left due is handed over again after RETRY); it may take locks whose holders
    call `poke` (the sweeper holds none of its own while it expires)."""

    def __init__(self, read: Callable[[], Mapping[str, float]], expire: Callable[[str], None],
                 clock: Callable[[], float], name: str = "sweeper") -> None:
        self._read, self._expire, self._clock, self._name = read, expire, clock, name
        self._cv = threading.Condition()
        self._poked = False
        self._closed = False
        self._thread: threading.Thread | None = None

    def poke(self) -> None:
        """A deadline was added or moved: look again (and start the thread if not yet)."""
        with self._cv:
            if self._closed:
                return
            self._poked = True
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cv.notify()

    def close(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self) -> None:
        retry_at: dict[str, float] = {}  # keys handed to `expire` and still due: not again before then
        while True:
            now = self._clock()
            passed, wake = due(self._read(), now)
            retry_at = {k: t for k, t in retry_at.items() if k in passed}
            fresh = [k for k in passed if retry_at.get(k, 0.0) <= now]
            for key in fresh:
                try:
                    self._expire(key)
                except Exception:  # (expire must not raise: never let one key stop the sweeps)
                    log.exception("expiring %s", key)
                retry_at[key] = now + RETRY
            with self._cv:
                if self._closed:
                    return
                if not fresh and not self._poked:
                    wake = min([w for w in (wake, *retry_at.values()) if w is not None], default=None)
                    self._cv.wait(None if wake is None else max(0.0, wake - self._clock()))
                self._poked = False
                if self._closed:
                    return
