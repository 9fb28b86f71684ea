"""The node cache's parts, each through its narrow seam (`core.Core`) with a fake core: pins and
protections (`pins`), verification (`verify`), eviction (`evictor`), forgetting (`forgetting`).

The fake core has only the members `core.Core` declares (anything else a part reached for would
raise AttributeError), keeps its journal as a list (what was queued, what a flush took) and holds
real entries over a real data file, so re-hashing reads real bytes."""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections.abc import Container, Iterator, Sequence
from pathlib import Path

import pytest
import trio

from fuse_client.nodecache import index as ci
from fuse_client.nodecache.cachedir import open_cache
from fuse_client.nodecache.core import Core, Punch
from fuse_client.nodecache.entry import BlobEntry, Flight
from fuse_client.nodecache.errors import BlobIncomplete, BlobPinned, CacheIOError, NoPlainImage
from fuse_client.nodecache.eviction import Budget
from fuse_client.nodecache.evictor import Evictor
from fuse_client.nodecache.forgetting import Forgetting
from fuse_client.nodecache.pins import Holds, Pins
from fuse_client.nodecache.verify import Verifier
from layerstore import digest as digestmod
from layerstore.chunkmap import ChunkMap, ChunkRef

CHUNK = 4096
N = 4


class FakeCore:
    """Exactly `core.Core`: entries over real files, usage, and a journal kept as lists."""

    __slots__ = ("entries", "busy", "clock", "usage", "root", "queued", "punches", "flushed", "protected_sets",
                 "corrupt", "fail_next_flush", "now")

    def __init__(self, root: Path) -> None:
        self.entries: dict[str, BlobEntry] = {}
        self.busy: dict[tuple[str, int], Flight] = {}
        self.now = 1000.0
        self.clock = lambda: self.now
        self.usage = 0
        self.root = root
        self.queued: list[ci.Op] = []
        self.punches: list[Punch] = []
        self.flushed: list[ci.Op] = []  # ops a flush took (committed), in order
        self.protected_sets: list[list[str]] = []
        self.corrupt = 0
        self.fail_next_flush = False

    def disk_bytes(self, entry: BlobEntry, i: int) -> int:
        return entry.cmap.chunks[i].length

    def held_disk_bytes(self, entry: BlobEntry) -> int:
        return entry.held_bytes()

    def held_bytes(self, blobs: Container[str]) -> int:
        return sum(e.held_bytes() for b, e in self.entries.items() if b in blobs)

    def data_path(self, blob: str) -> Path:
        return self.root / blob.replace(":", "_")

    def release(self, entry: BlobEntry, idxs: Sequence[int]) -> int:
        n = 0
        for i in idxs:
            if entry.present[i] or entry.unverified[i]:
                entry.present[i] = entry.unverified[i] = 0
                n += self.disk_bytes(entry, i)
        self.usage -= n
        return n

    def remove_blob(self, blob: str) -> int:
        e = self.entries.pop(blob)
        held = e.held_bytes()
        e.close()
        self.usage -= held
        self.enqueue([ci.DelBlob(blob)])
        return held

    def count_corrupt(self, n: int) -> None:
        self.corrupt += n

    def pin(self, entry: BlobEntry, idxs: Sequence[int]) -> None:
        for i in idxs:
            entry.pins[i] = entry.pins.get(i, 0) + 1

    def unpin(self, entry: BlobEntry, idxs: Sequence[int]) -> None:
        for i in idxs:
            entry.pins[i] -= 1
            if not entry.pins[i]:
                del entry.pins[i]

    def enqueue(self, ops: list[ci.Op], punches: Sequence[Punch] = ()) -> None:
        self.queued.extend(ops)
        self.punches.extend(punches)

    def queue_protected(self, blobs: list[str]) -> None:
        self.protected_sets.append(blobs)

    async def flush(self) -> None:
        await trio.sleep(0)
        self.flushed.extend(self.queued)
        self.queued.clear()

    async def flush_op(self, op: ci.Op) -> bool:
        if self.fail_next_flush:
            self.fail_next_flush = False
            return False
        self.enqueue([op])
        await self.flush()
        return True

    # (test helpers, not part of the seam)
    def add(self, seed: int, *, present: bool = True, unverified: bool = False) -> BlobEntry:
        chunks = [bytes([seed, i]) * (CHUNK // 2) for i in range(N)]
        refs = [ChunkRef(i * CHUNK, CHUNK, digestmod.of(c)) for i, c in enumerate(chunks)]
        cmap = ChunkMap.build(refs)
        path = self.data_path(cmap.blob)
        path.write_bytes(b"".join(chunks))
        e = BlobEntry(cmap, os.open(path, os.O_RDWR))
        for i in range(N):
            if present or unverified:
                e.present[i], e.unverified[i] = (0, 1) if unverified else (1, 0)
                self.usage += CHUNK
            e.last_use[i] = float(seed * 10 + i)
        self.entries[cmap.blob] = e
        return e


@pytest.fixture
def core(tmp_path: Path) -> Iterator[FakeCore]:
    c = FakeCore(tmp_path)
    assert isinstance(c, Core)  # every member of the seam (and, by its slots, little else)
    yield c
    for e in c.entries.values():
        e.close()


def _corrupt(core: FakeCore, e: BlobEntry, i: int) -> None:
    os.pwrite(e.fd, b"\xff" * 16, e.cmap.chunks[i].offset)


# -- pins ----------------------------------------------------------------------------------------
def _pins(core: FakeCore, holds: Holds, *, direct_image: bool = True) -> tuple[Pins, list[str], list[str]]:
    verified: list[str] = []
    kicks: list[str] = []

    async def verify_all(e: BlobEntry) -> list[int]:
        verified.append(e.blob)
        return []

    return (Pins(core, holds, root=core.root, direct_image=direct_image, verify_all=verify_all,
                 evict_if_over=lambda: kicks.append("kick")), verified, kicks)


@pytest.mark.trio
async def test_pins_record_through_the_journal_and_undo_a_failed_batch(core: FakeCore) -> None:
    holds = Holds()
    pins, verified, kicks = _pins(core, holds)
    full, part = core.add(1), core.add(2)
    part.present[3] = 0
    with pytest.raises(BlobIncomplete):
        await pins.pin_blob(part.blob, "h")
    assert holds.pinned == {} and core.flushed == [] and verified == [part.blob]
    path = await pins.pin_blob(full.blob, "h")
    assert path == core.data_path(full.blob).absolute()
    assert holds.pinned == {full.blob: {"h": 1000.0}} and core.flushed == [ci.PutPin(full.blob, "h", 1000.0)]
    assert pins.holders(full.blob) == ["h"] and pins.pinned_bytes() == N * CHUNK
    core.fail_next_flush = True
    with pytest.raises(CacheIOError):
        await pins.pin_blob(full.blob, "other")
    assert holds.pinned == {full.blob: {"h": 1000.0}}  # undone in memory
    assert not await pins.unpin_blob(full.blob, "nobody")
    assert kicks == []
    assert await pins.unpin_blob(full.blob, "h")
    assert holds.pinned == {} and core.flushed[-1] == ci.DelPin(full.blob, "h") and kicks == ["kick"]
    with pytest.raises(NoPlainImage):
        await _pins(core, Holds(), direct_image=False)[0].pin_blob(full.blob, "h")


@pytest.mark.trio
async def test_protections_queue_the_set_and_unprotect_wakes_eviction(core: FakeCore) -> None:
    holds = Holds()
    pins, _, kicks = _pins(core, holds)
    a, b = core.add(1), core.add(2)
    await pins.protect(a.blob)
    await pins.protect(b.blob)
    await pins.protect(b.blob)  # (no change: not queued again)
    assert core.protected_sets == [[a.blob], sorted([a.blob, b.blob])]
    assert holds.held(a.blob) and pins.protected_bytes() == 2 * N * CHUNK
    assert pins.settle_protected({b.blob}) == [a.blob]
    assert holds.protected == {b.blob} and core.protected_sets[-1] == [b.blob] and kicks == ["kick"]
    pins.unprotect("sha256:" + "0" * 64)  # not protected: nothing
    assert len(core.protected_sets) == 3


# -- verification -----------------------------------------------------------------------------------
def _verifier(core: FakeCore, holds: Holds) -> tuple[Verifier, list[list[tuple[str, int]]]]:
    drops: list[list[tuple[str, int]]] = []

    async def drop(victims: Sequence[tuple[str, int]]) -> tuple[int, int]:
        drops.append(list(victims))
        return len(victims), 0

    return Verifier(core, holds, drop), drops


@pytest.mark.trio
async def test_verifier_serves_good_recovered_chunks_and_drops_bad_ones(core: FakeCore) -> None:
    holds = Holds()
    v, _ = _verifier(core, holds)
    loose, pinned = core.add(1, unverified=True), core.add(2, unverified=True)
    holds.pinned[pinned.blob] = {"h": 1.0}
    _corrupt(core, loose, 1)
    _corrupt(core, pinned, 2)
    assert await v.check_unverified(loose, [0, 1]) == ([0], [1])
    assert list(loose.present) == [1, 0, 0, 0] and list(loose.unverified) == [0, 0, 1, 1]
    assert core.usage == 2 * N * CHUNK - CHUNK and core.corrupt == 1 and v.verified_chunks == 1
    assert core.flushed == [ci.DelChunk(loose.blob, 1)] and core.punches == [(loose.blob, [(CHUNK, CHUNK)])]
    assert await v.verify_all_unverified(pinned) == [2]  # a pinned blob: unrecorded, never punched
    assert core.flushed[-1] == ci.DelChunk(pinned.blob, 2) and len(core.punches) == 1
    core.busy[(loose.blob, 2)] = Flight(0, "fetch")  # a flight holds it: verified by its holder
    assert await v.verify_unverified(loose) == ([3], [])


@pytest.mark.trio
async def test_verify_drops_unheld_bad_chunks_and_unrecords_protected_ones(core: FakeCore) -> None:
    holds = Holds()
    told: list[tuple[str, list[int]]] = []
    holds.on_unrecord = lambda blob, idxs: told.append((blob, idxs))
    v, drops = _verifier(core, holds)
    loose, guarded = core.add(1), core.add(2)
    holds.protected.add(guarded.blob)
    _corrupt(core, loose, 0)
    _corrupt(core, guarded, 3)
    rep = await v.verify()
    assert rep["checked"] == 2 * N and {(b["blob"], b["chunk"]) for b in rep["bad"]} == {(loose.blob, 0),  # type: ignore[index, union-attr]
                                                                                          (guarded.blob, 3)}
    assert drops == [[(loose.blob, 0)]]  # the evictor's drop punches it
    assert told == [(guarded.blob, [3])] and guarded.present[3] == 0 and core.punches == []
    assert ci.DelChunk(guarded.blob, 3) in core.flushed and core.corrupt == 2
    assert all(not e.pins for e in core.entries.values())  # pinned while hashed, then unpinned


# -- eviction ----------------------------------------------------------------------------------------
@pytest.mark.trio
async def test_evictor_takes_least_recent_unheld_chunks_and_punches_after_the_records(core: FakeCore) -> None:
    holds = Holds()
    ev = Evictor(core, holds, Budget(size=8 * CHUNK, high_fraction=0.9, low_fraction=0.5))
    old, held, new = core.add(1), core.add(2), core.add(3)
    holds.protected.add(held.blob)
    new.pins[0] = 1  # a reader holds it
    core.busy[(new.blob, 1)] = Flight(0, "fetch")
    assert await ev.evict_to(2 * N * CHUNK) == (N, N * CHUNK)  # old goes first, whole
    assert list(old.present) == [0] * N and core.usage == 2 * N * CHUNK and not core.busy.keys() - {(new.blob, 1)}
    assert core.flushed == [ci.DelChunk(old.blob, i) for i in range(N)]
    assert core.punches == [(old.blob, [(i * CHUNK, CHUNK) for i in range(N)])]
    assert await ev.evict_to(0) == (2, 2 * CHUNK)  # new's 2 and 3; never held, pinned-by-reader or busy
    assert list(held.present) == [1] * N and list(new.present) == [1, 1, 0, 0]
    assert ev.evicted_chunks == N + 2
    holds.pinned[held.blob] = {"h": 1.0}
    with pytest.raises(BlobPinned):
        await ev.drop_blob(held.blob)
    res = await ev.evict(all_chunks=True)
    assert res["pinned_bytes"] == N * CHUNK and res["protected_bytes"] == N * CHUNK


def test_evictor_wakes_on_a_full_disk_and_over_the_high_watermark(core: FakeCore) -> None:
    ev = Evictor(core, Holds(), Budget(size=2 * N * CHUNK, high_fraction=0.9, low_fraction=0.5))
    core.add(1)
    ev.kick_if_over()
    assert not ev._kick.is_set()
    ev.write_failed(errno.EIO)
    assert (ev.write_failures, ev.disk_full, ev._kick.is_set()) == (1, 0, False)
    ev.write_failed(errno.ENOSPC)
    assert (ev.write_failures, ev.disk_full, ev._kick.is_set()) == (2, 1, True)
    core.add(2)
    ev._kick = trio.Event()
    ev.kick_if_over()
    assert ev._kick.is_set()


# -- forgetting --------------------------------------------------------------------------------------
@pytest.mark.trio
async def test_forgetting_takes_only_blobs_nothing_uses(core: FakeCore) -> None:
    holds = Holds()
    f = Forgetting(core, holds)
    idle, pinned, opened, busy, recent = (core.add(i) for i in range(1, 6))
    core.now = time.time() + 3600  # (the data files were written an hour "ago")
    holds.pinned[pinned.blob] = {"h": 1.0}
    opened.open_count = 1
    core.busy[(busy.blob, 0)] = Flight(0, "fetch")
    f.in_use = lambda: {recent.blob: core.now}
    assert f.forget_blob(pinned.blob) is None and f.forget_blob(opened.blob) is None
    assert f.forget_blob(busy.blob) is None
    dry = await f.gc_unused(60.0, dry_run=True)
    assert [d["blob"] for d in dry["dropped"]] == [idle.blob] and idle.blob in core.entries  # type: ignore[index]
    res = await f.gc_unused(60.0)
    assert [d["blob"] for d in res["dropped"]] == [idle.blob] and idle.blob not in core.entries  # type: ignore[index]
    assert core.flushed == [ci.DelBlob(idle.blob)] and res["used_bytes"] == 4 * N * CHUNK


def test_forgetting_keeps_maps_within_the_budget(core: FakeCore) -> None:
    holds = Holds()
    f = Forgetting(core, holds, map_budget=2 * N)
    a, b, c = core.add(1), core.add(2), core.add(3)
    holds.protected.add(a.blob)  # oldest, but protected
    assert f.map_entries() == 3 * N
    assert f.forget_idle_maps(keep=c.blob) == [b.blob]
    assert f.maps_forgotten == 1 and set(core.entries) == {a.blob, c.blob} and f.forget_idle_maps() == []


# -- the real core ------------------------------------------------------------------------------------
def test_node_cache_is_the_core_its_parts_share(tmp_path: Path) -> None:
    """`NodeCache` satisfies the seam the fakes stand in for, and its parts share one `Holds`."""
    with contextlib.ExitStack() as stack:
        cache = open_cache(tmp_path / "cache", None, stack)
        assert isinstance(cache, Core)
        holds = cache.holds
        assert cache.pins.holds is holds and cache.verifier.holds is holds
        assert cache.evictor.holds is holds and cache.forgetting.holds is holds
        assert all(part.core is cache for part in (cache.pins, cache.verifier, cache.evictor, cache.forgetting))
