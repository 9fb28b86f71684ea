"""A successor answering the unknown events of a daemon that died reading a batch
(docs/benchmarks-fanotify.md, the stuck read). Found by bench/daemon_restart.py --kill-all
--fd-store: the dead daemon's pending event had fd number 12, which the successor had open when
it took the group over, so it was not reserved and never answered: its reader waited forever.
Every number of the dead daemon's range must be answered after the complete fill, except one
that may be an event of the successor's own (a marked data file). No kernel group: a pipe stands
in for it and the answers written to it are read back."""

from __future__ import annotations

import os
import resource
from pathlib import Path

import pytest
import trio
from testkit.fanotify_helpers import front_on_a_pipe, pipe_answers

from fuse_client.fanotify import kernel
from fuse_client.fanotify.frontend import RESERVE_MARGIN


class Holds:
    on_unrecord = None


class Cache:
    holds = Holds()


class Lazy:
    """What `answer_leftovers` uses of the library (nothing is attached: no fill)."""

    def __init__(self) -> None:
        self.cache = Cache()

    async def prefetch(self, blob: str, **kw: object) -> dict[str, object]:
        raise AssertionError("nothing attached: no fill expected")


def test_unknown_events_under_numbers_open_at_the_takeover_are_answered(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel, "mark", lambda g, p: None)
    (tmp_path / "a").write_bytes(b"\0" * 4096)
    with front_on_a_pipe(tmp_path) as (fe, r):
        w = fe.group
        fe.premark(["a"])  # (a's file is marked: an fd of it may be an event of ours)
        other = os.open(tmp_path / "other", os.O_RDWR | os.O_CREAT, 0o600)  # (open at the takeover)
        data = os.open(tmp_path / "a", os.O_RDONLY)
        closed = os.open(os.devnull, os.O_RDONLY)  # (open at the takeover, closed before the answers)
        try:
            fe.journal.begin_batch(40)  # the last daemon died reading a batch: unknown events
            fe.open_group(w, "g", False)
            os.close(closed)
            pipe_answers(r)  # (nothing yet)

            async def main() -> None:
                async with trio.open_nursery() as n:
                    fe.bind(Lazy(), n)  # type: ignore[arg-type]
                    assert await fe.answer_leftovers()

            trio.run(main)
            allowed = {fd for fd, allow, _err in pipe_answers(r) if allow}
        finally:
            os.close(other)
            os.close(data)
    assert other in allowed  # the stuck read: open here at the takeover, never answered before
    assert closed in allowed  # free again by the answers: held while answered
    assert w in allowed  # (the group's own number can be no event of ours either)
    assert data not in allowed  # may be an event of ours on a marked file: left to its handler
    assert set(range(3, 41)) - {data} <= allowed


def test_no_number_of_the_unknown_range_is_left_free_for_an_event_of_ours(tmp_path: Path) -> None:
    """The CI hang (test_kill9_of_the_daemon_while_16_readers_read, 1 run in 3 under load): the
    dead daemon's unknown event had fd number 11, the number the successor's reservation gave
    its own /dev/null fd and freed again; the successor's first event got 11 and its answer went
    to the older pending event with that number (the kernel answers the first match): its own
    reader waited forever. Every number of the range must stay taken until the answers."""
    with front_on_a_pipe(tmp_path) as (fe, _r):
        cap = min(40 + RESERVE_MARGIN, fe.journal.slots - 1, resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 256)
        lowest = os.open(os.devnull, os.O_RDONLY)  # the number the next fd opened here gets
        os.close(lowest)
        fe.journal.begin_batch(40)  # the last daemon died reading a batch: unknown events
        fe.open_group(fe.group, "g", False)
        try:
            nxt = os.open(os.devnull, os.O_RDONLY)  # what the kernel would give an event of ours
            os.close(nxt)
            free = []
            for n in range(3, cap + 1):
                try:
                    os.fstat(n)
                except OSError:
                    free.append(n)
        finally:
            fe._free_reserved()
    assert lowest <= cap
    assert not free, free[:5]
    assert nxt > cap
