"""The deadline sweeper of layers held ahead (`snapshotter.sweeper`): `due` is pure; the Sweeper's
one thread expires each key at its deadline, wakes for a deadline added later, hands a key its
`expire` left due over again only after RETRY, and ends on close."""

from __future__ import annotations

import math
import threading
import time

import pytest
from testkit.fuse_helpers import wait_until

from snapshotter import sweeper as sweepmod
from snapshotter.sweeper import Sweeper, due


def test_due_names_the_passed_keys_and_the_next_deadline() -> None:
    assert due({}, 5.0) == ([], None)
    assert due({"b": 4.0, "a": 5.0, "c": 7.0, "d": 6.0}, 5.0) == (["a", "b"], 6.0)
    assert due({"held": math.inf, "x": 9.0}, 5.0) == ([], 9.0)  # (a hold still being taken: never due)
    assert due({"held": math.inf}, 5.0) == ([], None)


class Owner:
    """Deadlines as the snapshotter keeps them: a dict under a lock; `expire` removes the key."""

    def __init__(self, keep: set[str] | None = None) -> None:
        self.mu = threading.Lock()
        self.deadlines: dict[str, float] = {}
        self.expired: list[tuple[str, float]] = []
        self.keep = keep or set()  # keys `expire` leaves in place (a broken owner)

    def read(self) -> dict[str, float]:
        with self.mu:
            return dict(self.deadlines)

    def expire(self, key: str) -> None:
        with self.mu:
            self.expired.append((key, time.monotonic()))
            if key not in self.keep:
                del self.deadlines[key]

    def add(self, sw: Sweeper, key: str, after: float) -> float:
        at = time.monotonic() + after
        with self.mu:
            self.deadlines[key] = at
        sw.poke()
        return at


def test_each_key_expires_at_its_deadline_in_one_thread() -> None:
    own = Owner()
    sw = Sweeper(own.read, own.expire, time.monotonic, name="test-sweep")
    try:
        assert not [t for t in threading.enumerate() if t.name == "test-sweep"]  # (started on the first poke)
        late = own.add(sw, "late", 0.4)
        early = own.add(sw, "early", 0.1)  # (added after, due before: the sleeping thread wakes for it)
        own.add(sw, "never", math.inf)
        wait_until(lambda: len(own.expired) == 2, 5, "two keys expired")
        assert [k for k, _ in own.expired] == ["early", "late"]
        assert own.expired[0][1] >= early and own.expired[1][1] >= late  # (never before the deadline)
        assert own.read() == {"never": math.inf}
        assert len([t for t in threading.enumerate() if t.name == "test-sweep"]) == 1
    finally:
        sw.close()
    assert not [t for t in threading.enumerate() if t.name == "test-sweep"]


def test_a_key_left_due_is_handed_over_again_only_after_the_retry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sweepmod, "RETRY", 0.2)
    own = Owner(keep={"stuck"})
    sw = Sweeper(own.read, own.expire, time.monotonic)
    try:
        own.add(sw, "stuck", 0.0)
        wait_until(lambda: len(own.expired) >= 3, 5, "three hand-overs")
        times = [t for _, t in own.expired[:3]]
        assert all(b - a >= 0.19 for a, b in zip(times, times[1:], strict=False)), times  # (not a busy loop)
        with own.mu:
            own.keep.clear()
        wait_until(lambda: own.read() == {}, 5, "the key expired")
    finally:
        sw.close()


def test_an_expire_that_raises_does_not_stop_the_sweeps() -> None:
    own = Owner()
    calls: list[str] = []

    def expire(key: str) -> None:
        calls.append(key)
        if key == "bad":
            with own.mu:
                del own.deadlines[key]
            raise RuntimeError("boom")
        own.expire(key)

    sw = Sweeper(own.read, expire, time.monotonic)
    try:
        own.add(sw, "bad", 0.0)
        own.add(sw, "good", 0.1)
        wait_until(lambda: own.read() == {}, 5, "both keys expired")
        assert calls == ["bad", "good"]
    finally:
        sw.close()


def test_close_stops_a_sleeping_sweeper_and_later_pokes_start_nothing() -> None:
    own = Owner()
    sw = Sweeper(own.read, own.expire, time.monotonic, name="test-sweep-close")
    own.add(sw, "far", 3600.0)
    t = time.monotonic()
    sw.close()
    assert time.monotonic() - t < 2.0  # (woken, not waiting for the deadline)
    sw.poke()
    assert not [th for th in threading.enumerate() if th.name == "test-sweep-close"]
