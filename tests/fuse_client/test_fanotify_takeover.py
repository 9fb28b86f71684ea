"""A daemon taking the fanotify group over (docs/fanotify.md, "Restart and upgrade"): what it
must know of the last daemon's attachments, and reads that arrive while it takes them back.
No kernel group: a pipe stands in for it (the answers the front end writes are read back), the
node-cache library is a stand-in whose attach steps can be failed or held.

Found by the CI (`test_run_cli.py::test_the_opt_in_fanotify_data_path_end_to_end` under load:
`exec /bin/wc: input/output error` after a kill -9 of the daemon): the shim attaches a sandbox's
layers concurrently, and each attach persisted the attachments through one shared temporary
file; one attach failed (ENOENT on the rename) or an older snapshot landed last, so a mounted
blob was missing from CACHE/fanotify-attached.json, the next daemon did not take it back, and
its events were denied with EIO as "not attached"."""

from __future__ import annotations

import errno
import json
import os
import threading
from pathlib import Path

import pytest
import trio
from testkit.fanotify_helpers import front_on_a_pipe, pipe_answers

from fuse_client.fanotify import abi, handover, kernel
from layerstore.errors import StoreUnavailable

SIZE = 1 << 20


class Entry:
    def __init__(self, blob: str) -> None:
        self.blob = blob
        self.metadata: list[int] = []
        self.size = SIZE

    def unverified_idxs(self) -> list[int]:
        return []

    def complete(self) -> bool:
        return False


class Reader:
    def __init__(self, fills: list[tuple[str, int, int]], blob: str) -> None:
        self.fills, self.blob = fills, blob

    async def fill(self, off: int, n: int) -> None:
        self.fills.append((self.blob, off, n))

    def close(self) -> None:
        pass


class Holds:
    on_unrecord = None

    def __init__(self) -> None:
        self.protected: set[str] = set()


class Pins:
    def __init__(self, holds: Holds) -> None:
        self.holds = holds

    async def protect(self, blob: str) -> None:
        self.holds.protected.add(blob)

    def unprotect(self, blob: str) -> None:
        self.holds.protected.discard(blob)

    def settle_protected(self, keep: set[str]) -> list[str]:
        gone = sorted(self.holds.protected - keep)
        self.holds.protected &= keep
        return gone

    def protected_bytes(self) -> int:
        return 0


class Cache:
    budget = None
    usage = 0

    def __init__(self) -> None:
        self.holds = Holds()
        self.pins = Pins(self.holds)

    def pin(self, entry: Entry, idxs: list[int]) -> None:
        pass

    def unpin(self, entry: Entry, idxs: list[int]) -> None:
        pass

    async def flush(self) -> None:
        pass


class Lazy:
    """The library's surface an attach and a fill use; `failing[blob]`: that many more attaches
    of the blob fail as a store outage would."""

    def __init__(self) -> None:
        self.cache = Cache()
        self.failing: dict[str, int] = {}
        self.fills: list[tuple[str, int, int]] = []

    async def entry(self, blob: str) -> Entry:
        await trio.sleep(0)
        if self.failing.get(blob, 0) > 0:
            self.failing[blob] -= 1
            raise StoreUnavailable(f"blob {blob}: chunk map not fetched (a stand-in outage)")
        return Entry(blob)

    def open_reader(self, entry: Entry) -> Reader:
        return Reader(self.fills, entry.blob)

    async def ensure_metadata(self, entry: Entry) -> None:
        await trio.sleep(0)


@pytest.fixture
def front(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    marks: list[tuple[str, Path]] = []
    monkeypatch.setattr(kernel, "mark", lambda g, p: marks.append(("mark", Path(p))))
    monkeypatch.setattr(kernel, "unmark", lambda g, p: marks.append(("unmark", Path(p))))
    for b in ("a", "b", "c"):
        (tmp_path / b).write_bytes(b"\0" * SIZE)
    with front_on_a_pipe(tmp_path) as (fe, r):
        yield fe, r, marks


def test_concurrent_attaches_all_persisted(front, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """Three layers attached at once (the shim mounts a sandbox's layers concurrently), the
    first writer of the attachments file slowed in its fsync: every attach succeeds and the file
    the next daemon reads lists every blob with its holder."""
    fe, _r, _marks = front
    slow_once = threading.Event()
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if not slow_once.is_set():
            slow_once.set()
            threading.Event().wait(0.3)  # (the others' writes overtake this one meanwhile)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    errors: list[BaseException] = []

    async def main() -> None:
        async with trio.open_nursery() as n:
            fe.bind(Lazy(), n)  # type: ignore[arg-type]

            async def one(blob: str) -> None:
                try:
                    await fe.attach(blob, f"shim:{blob}")
                except Exception as e:  # (collected: the assertion below names them)
                    errors.append(e)

            for b in ("a", "b", "c"):
                n.start_soon(one, b)

    trio.run(main)
    assert errors == []
    assert fe.stats.attach_failures == 0
    assert handover.load_attachments(fe.cache_dir) == {"a": ["shim:a"], "b": ["shim:b"], "c": ["shim:c"]}
    assert not list(fe.cache_dir.glob("*.tmp"))


def test_a_read_during_a_failed_restore_waits_then_completes(front) -> None:  # type: ignore[no-untyped-def]
    """After a restart, the attach of a persisted blob fails twice (a store outage): its file
    stays marked and protected from punches, an event on it (held until `release`) is neither
    denied nor allowed unfilled; it waits, is filled once a retry takes the blob back, and is
    allowed."""
    fe, r, marks = front
    cache = fe.cache_dir
    (cache / handover.ATTACHED_NAME).write_text(json.dumps({"blobs": {"a": ["h1"], "b": ["h2"]}}))
    previous = handover.load_attachments(cache)
    fe.premark(list(previous))
    lazy = Lazy()
    lazy.failing["b"] = 2
    lazy.cache.holds.protected = {"a", "b", "z"}  # (recovered: z was detached just before the crash)
    fd = os.open(cache / "b", os.O_RDONLY)
    st = os.fstat(fd)
    seen: dict[str, object] = {}

    async def main() -> None:
        async with trio.open_nursery() as n:
            fe.bind(lazy, n)  # type: ignore[arg-type]
            # The event on b's file arrives while the daemon takes over (held until release).
            fe.journal.begin_batch(fe.fd_bound)
            slow = fe.process_batch(abi.encode_event(abi.Event(abi.FAN_PRE_ACCESS, fd, 4242, 0, 4096)))
            assert [x[0] for x in slow] == [fd]
            fe.take_events(slow)  # (what the event thread does with them: held until release)
            await fe.restore(previous)
            seen["unrestored"] = fe.stats_json()["unrestored"]
            seen["protected"] = set(lazy.cache.holds.protected)
            seen["persisted"] = handover.load_attachments(cache)  # (a's restore wrote the list: b kept)
            await fe.release()
            await trio.sleep(0.05)
            seen["answers_before"] = pipe_answers(r)
            with trio.fail_after(10):
                while fe.stats.filled < 1:
                    await trio.sleep(0.02)
            n.cancel_scope.cancel()

    trio.run(main)
    assert seen["unrestored"] == ["b"]
    # b, still mounted and not taken back, stays protected from punches; z (detached) is evictable
    assert seen["protected"] == {"a", "b"}
    assert lazy.cache.holds.protected == {"a", "b"}
    assert seen["persisted"] == {"a": ["h1"], "b": ["h2"]}
    assert seen["answers_before"] == []  # neither denied nor allowed while b was not taken back
    assert pipe_answers(r) == [(fd, True, 0)]
    assert lazy.fills == [("b", 0, 4096)]
    assert ("unmark", cache / "b") not in marks  # its mount still reads it: the mark never went
    assert fe.stats.denied == 0
    assert handover.load_attachments(cache) == {"a": ["h1"], "b": ["h2"]}
    assert st.st_ino == (cache / "b").stat().st_ino
    with pytest.raises(OSError) as e:
        os.fstat(fd)  # (the event's fd is the front end's: closed once answered)
    assert e.value.errno == errno.EBADF
