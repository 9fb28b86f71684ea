"""A successor answering the unknown events of a daemon that died reading a batch
(docs/benchmarks-fanotify.md, the stuck read). Found by bench/daemon_restart.py --kill-all
--fd-store: the dead daemon's pending event had fd number 12, which the successor had open when
it took the group over, so it was not reserved and never answered: its reader waited forever.
Every number of the dead daemon's range must be answered after the complete fill, except one
that may be an event of the successor's own (a marked data file). No kernel group: a pipe stands
in for it and the answers written to it are read back."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio
from testkit.fanotify_helpers import front_on_a_pipe, pipe_answers

from fuse_client.fanotify import kernel


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
