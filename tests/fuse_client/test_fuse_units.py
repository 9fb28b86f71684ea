"""Pure units of the FUSE client: the priority limiter, eviction policy, traces, prefetch
ordering, size parsing, the LMDB index, the sparse data files and the readahead streams."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from fuse_client.nodecache.eviction import Budget, Candidate, choose_victims
from fuse_client.nodecache.files import BlobFiles, punch_hole
from fuse_client.nodecache.index import CacheIndex, DelBlob, DelChunk, PutChunk, PutMap, Touch
from fuse_client.nodecache.lazy import prefetch_order
from fuse_client.nodecache.limiter import DEMAND, PREFETCH, PriorityLimiter
from fuse_client.nodecache.readahead import MAX_STREAMS, Streams
from fuse_client.nodecache.trace import TraceRecorder, parse_trace, write_trace
from layerctl.cmd_daemon import parse_size
from layerstore import digest as digestmod
from layerstore.chunkmap import METADATA, ChunkMap, ChunkRef
from layerstore.errors import BadInput, ConfigError
from layerstore.linux import data_extents

BLOB = digestmod.of(b"blob")
OTHER = digestmod.of(b"other")


class Owner:
    def __init__(self, priority: int) -> None:
        self.priority = priority


# -- limiter -----------------------------------------------------------------------------------------
@pytest.mark.trio
async def test_limiter_serves_by_priority_then_arrival_and_boosts() -> None:
    lim = PriorityLimiter(1)
    order: list[str] = []
    holder = Owner(DEMAND)
    await lim.acquire(holder)
    owners = {"p1": Owner(PREFETCH), "p2": Owner(PREFETCH), "d1": Owner(DEMAND), "p3": Owner(PREFETCH)}

    async def waiter(name: str) -> None:
        async with lim.hold(owners[name]):
            order.append(name)

    async with trio.open_nursery() as nursery:
        for name in owners:
            nursery.start_soon(waiter, name)
            await trio.testing.wait_all_tasks_blocked()
        owners["p3"].priority = DEMAND  # a demand reader joined p3's flight
        lim.reprioritized(owners["p3"])
        assert lim.waiting == 4 and lim.in_use == 1
        lim.release(holder)
    assert order == ["d1", "p3", "p1", "p2"]
    assert lim.in_use == 0


@pytest.mark.trio
async def test_limiter_cancelled_waiter_gives_its_slot_back() -> None:
    lim = PriorityLimiter(1)
    first = Owner(0)
    await lim.acquire(first)
    with trio.move_on_after(0.01):
        await lim.acquire(Owner(0))
    assert lim.waiting == 0
    lim.release(first)
    assert lim.in_use == 0
    with pytest.raises(ValueError):
        PriorityLimiter(0)


# -- eviction policy ---------------------------------------------------------------------------------
def test_budget_watermarks() -> None:
    b = Budget(1000, 0.9, 0.5)
    assert (b.high, b.low) == (900, 500)
    for bad in ((0, 0.9, 0.5), (10, 0.5, 0.9), (10, 1.5, 0.5), (10, 0.9, 0.0)):
        with pytest.raises(ConfigError):
            Budget(*bad)


def test_choose_victims_lru_and_protected_last() -> None:
    cands = [Candidate(BLOB, 0, 10, 5.0, protected=True), Candidate(BLOB, 1, 10, 1.0),
             Candidate(BLOB, 2, 10, 3.0), Candidate(OTHER, 0, 10, 2.0)]
    assert choose_victims(cands, 40, 45) == []
    assert [(c.blob, c.index) for c in choose_victims(cands, 40, 20)] == [(BLOB, 1), (OTHER, 0)]
    assert [(c.blob, c.index) for c in choose_victims(cands, 40, 0)][-1] == (BLOB, 0)


@given(st.lists(st.tuples(st.integers(1, 100), st.floats(0, 1e6), st.booleans()), max_size=50),
       st.integers(0, 3000))
def test_choose_victims_properties(items: list[tuple[int, float, bool]], target: int) -> None:
    cands = [Candidate(BLOB, i, n, t, p) for i, (n, t, p) in enumerate(items)]
    usage = sum(c.length for c in cands)
    victims = choose_victims(cands, usage, target)
    left = usage - sum(v.length for v in victims)
    assert left <= target or len(victims) == len(cands)
    if victims:  # minimal: without the last victim we would still be above target
        assert left + victims[-1].length > target
        worst = max((v.protected, v.last_use) for v in victims)
        kept = [c for c in cands if c not in victims]
        assert all((c.protected, c.last_use) >= worst for c in kept)


# -- traces ------------------------------------------------------------------------------------------
def test_trace_format_round_trip(tmp_path: Path) -> None:
    rec = TraceRecorder()
    rec.record(BLOB, 10, 3, 5)
    rec.record(BLOB, 10, 4, 6)
    rec.record(OTHER, 2, 1, 2)
    rec.record(BLOB, 10, 0, 1)
    doc = rec.to_json()
    assert doc == {"version": 1, "blobs": {BLOB: [3, 4, 5, 0], OTHER: [1]}}
    path = tmp_path / "t.json"
    write_trace(path, doc)
    import json

    assert parse_trace(json.loads(path.read_text())) == {BLOB: [3, 4, 5, 0], OTHER: [1]}
    for bad in ({}, {"version": 2, "blobs": {}}, {"version": 1, "blobs": {BLOB: [-1]}},
                {"version": 1, "blobs": {BLOB: "x"}}):
        with pytest.raises(BadInput):
            parse_trace(bad)


def test_prefetch_order() -> None:
    refs = [ChunkRef(i * 100, 100, digestmod.of(bytes([i])), METADATA if i in (0, 4) else 0) for i in range(6)]
    cm = ChunkMap(BLOB, 600, tuple(refs))  # prefetch_order reads the chunk list only
    assert prefetch_order(cm, [0, 4], all_chunks=True) == [0, 4, 1, 2, 3, 5]
    assert prefetch_order(cm, [0, 4]) == [0, 4]
    assert prefetch_order(cm, [0, 4], chunks=[3, 1, 3]) == [3, 1]
    assert prefetch_order(cm, [0, 4], ranges=[[150, 100], [0, 1], [590, 100]]) == [1, 2, 0, 5]
    with pytest.raises(BadInput):
        prefetch_order(cm, [], chunks=[6])
    with pytest.raises(BadInput):
        prefetch_order(cm, [], ranges=[[1]])


def test_parse_size() -> None:
    assert parse_size("1048576") == 1 << 20
    assert parse_size("512M") == 512 << 20
    assert parse_size("2GiB") == 2 << 30
    assert parse_size("1.5k") == 1536
    for bad in ("", "lots", "-1", "1X"):
        with pytest.raises(ConfigError):
            parse_size(bad)


# -- the index -----------------------------------------------------------------------------------------
def test_cache_index_ops_in_order(tmp_path: Path) -> None:
    idx = CacheIndex(tmp_path / "index")
    try:
        idx.apply([PutMap(BLOB, b"map"), PutChunk(BLOB, 0, 1.0), PutChunk(BLOB, 7, 2.0), PutChunk(OTHER, 1, 3.0),
                   DelChunk(BLOB, 0), Touch(BLOB, 7, 9.0), Touch(BLOB, 0, 9.0)])
        assert idx.committed() == {BLOB: {7: 9.0}, OTHER: {1: 3.0}}
        assert idx.committed_of(BLOB) == {7: 9.0}
        assert idx.get_map(BLOB) == b"map" and idx.get_map(OTHER) is None
        idx.apply([DelBlob(BLOB)])
        assert idx.committed() == {OTHER: {1: 3.0}}
        assert list(idx.maps()) == []
    finally:
        idx.close()
    idx = CacheIndex(tmp_path / "index")  # persistent
    try:
        assert idx.committed_of(OTHER) == {1: 3.0}
    finally:
        idx.close()


# -- data files ------------------------------------------------------------------------------------------
def test_sparse_files_punch_and_extents(tmp_path: Path) -> None:
    files = BlobFiles(tmp_path)
    size = 10 << 20
    fd = files.open(BLOB, size)
    try:
        assert os.fstat(fd).st_size == size and list(data_extents(fd, size)) == []
        os.pwrite(fd, b"a" * (1 << 20), 2 << 20)
        os.pwrite(fd, b"b" * 5000, 6 << 20)
        ext = list(data_extents(fd, size))
        assert ext[0][0] <= 2 << 20 and ext[0][1] >= 3 << 20 and len(ext) == 2
        # Punching an unaligned range zeroes exactly that range.
        punch_hole(fd, (2 << 20) + 100, 5000)
        got = os.pread(fd, 6000, 2 << 20)
        assert got == b"a" * 100 + b"\0" * 5000 + b"a" * 900
        punch_hole(fd, 2 << 20, 1 << 20)
        assert os.pread(fd, 1 << 20, 2 << 20) == b"\0" * (1 << 20)
        assert os.fstat(fd).st_size == size
        assert files.allocated_bytes(BLOB) <= 8192
    finally:
        os.close(fd)
    assert list(files.blobs()) == [BLOB]
    files.remove(BLOB)
    assert list(files.blobs()) == []


# -- readahead streams ---------------------------------------------------------------------------------
RA_CHUNK = 1 << 20
RA_MAX = 16


def _run_streams(requests: list[tuple[int, int]], nchunks: int) -> tuple[set[int], set[int], list[tuple[int, int]]]:
    """Feed (offset, length) data reads to one blob's streams: (chunks read, chunks read ahead,
    windows)."""
    streams = Streams()
    read: set[int] = set()
    ahead: set[int] = set()
    windows = []
    for off, length in requests:
        end = off + length
        first, last = off // RA_CHUNK, (end - 1) // RA_CHUNK + 1
        read.update(range(first, last))
        w = streams.on_read(off, end, last, nchunks, RA_MAX, 0.0, RA_CHUNK)
        if w is not None:
            windows.append(w)
            ahead.update(range(*w))
        assert len(streams) <= MAX_STREAMS
    return read, ahead, windows


def test_a_sequential_reader_ramps_its_window_up_to_the_maximum() -> None:
    n = 200
    read, ahead, windows = _run_streams([(off, 128 << 10) for off in range(0, n * RA_CHUNK, 128 << 10)], n)
    sizes = [b - a for a, b in windows]
    assert sizes[:6] == [1, 2, 4, 8, 16, 16]
    assert ahead == set(range(1, n))  # everything after the first chunk was read ahead, once
    assert sum(sizes) == n - 1


def test_near_but_not_contiguous_reads_never_read_ahead() -> None:
    reqs = [(k * (RA_CHUNK + 4096), 64 << 10) for k in range(50)]  # each a little after the last
    reqs += [(k * RA_CHUNK + (128 << 10) + 4096, 4096) for k in range(50)]
    assert _run_streams(reqs, 100)[1] == set()


def test_a_stream_is_forgotten_when_stale() -> None:
    s = Streams()
    assert s.on_read(0, 4096, 1, 10, RA_MAX, 0.0, RA_CHUNK) is None
    assert s.on_read(4096, 8192, 1, 10, RA_MAX, 100.0, RA_CHUNK) is None  # too late: a new stream
    assert s.on_read(8192, 12288, 1, 10, RA_MAX, 100.5, RA_CHUNK) == (1, 2)


def test_run_to_counts_what_a_stream_has_read_contiguously() -> None:
    s = Streams()
    assert s.run_to(0) == 0
    s.on_read(0, 4096, 1, 10, RA_MAX, 0.0, RA_CHUNK)
    assert s.run_to(4096) == 4096 and s.run_to(0) == 0
    s.on_read(4096, 3 * 4096, 1, 10, RA_MAX, 0.0, RA_CHUNK)
    assert s.run_to(3 * 4096) == 3 * 4096 and s.run_to(4096) == 0  # re-keyed where it ended
    s.on_read(5 * 4096, 6 * 4096, 1, 10, RA_MAX, 0.0, RA_CHUNK)  # a gap: a stream of its own
    assert s.run_to(6 * 4096) == 4096 and s.run_to(3 * 4096) == 3 * 4096


@st.composite
def interleaved_readers(draw: st.DrawFn, max_readers: int) -> tuple[list[tuple[int, int]], list[int], int]:
    """Readers of distinct files (with gaps between them, so no reader continues another's
    stream), each reading its file front to back in requests of random sizes, interleaved at
    random. Returns the requests, the reader of each, and the blob's chunk count."""
    nreaders = draw(st.integers(1, max_readers))
    pos = 0
    files = []
    for _ in range(nreaders):
        pos += draw(st.integers(1, 3 * RA_CHUNK // 4096)) * 4096  # a gap
        length = draw(st.integers(1, 24 * RA_CHUNK // 4096)) * 4096
        files.append((pos, length))
        pos += length
    queues = []
    for start, length in files:
        reqs, off = [], start
        while off < start + length:
            n = min(draw(st.sampled_from([4096, 16384, 128 << 10, 1 << 20])), start + length - off)
            reqs.append((off, n))
            off += n
        queues.append(reqs)
    order = draw(st.permutations([r for r, q in enumerate(queues) for _ in q]))
    requests, owners = [], []
    for r in order:
        requests.append(queues[r].pop(0))
        owners.append(r)
    return requests, owners, pos // RA_CHUNK + 2


def _wasted_bound(requests: list[tuple[int, int]], owners: list[int], per_stream_cap: bool) -> tuple[int, int]:
    touched: dict[int, set[int]] = {}
    for (off, length), r in zip(requests, owners, strict=True):
        touched.setdefault(r, set()).update(range(off // RA_CHUNK, (off + length - 1) // RA_CHUNK + 1))
    total = sum(3 * len(t) for t in touched.values())
    capped = sum(min(3 * len(t), 2 * RA_MAX) for t in touched.values())
    return total, capped if per_stream_cap else total


@given(interleaved_readers(MAX_STREAMS))
def test_interleaved_readers_read_ahead_at_most_a_bound_they_never_read(case: tuple) -> None:
    """At most MAX_STREAMS readers: each one's stream is tracked, and what it was given ahead
    and never read is at most its last two windows: min(3 x what it read, 2 x the maximum)."""
    requests, owners, n = case
    read, ahead, _ = _run_streams(requests, n)
    _, capped = _wasted_bound(requests, owners, True)
    assert len(ahead - read) <= capped


@pytest.mark.slow  # about 3-5 s: kept out of `make check`'s 2 minutes
@given(interleaved_readers(4 * MAX_STREAMS))
def test_many_interleaved_readers_read_ahead_at_most_three_times_what_they_read(case: tuple) -> None:
    requests, owners, n = case
    read, ahead, _ = _run_streams(requests, n)
    total, _ = _wasted_bound(requests, owners, False)
    assert len(ahead - read) <= total


@given(st.lists(st.tuples(st.integers(0, 4000), st.integers(1, 64)), max_size=200))
def test_random_reads_that_never_continue_one_another_never_read_ahead(reqs: list[tuple[int, int]]) -> None:
    ends: set[int] = set()
    kept = []
    for page, pages in reqs:
        off, end = page * 4096, (page + pages) * 4096
        if off not in ends:
            kept.append((off, end - off))
            ends.add(end)
    assert _run_streams(kept, 4000 * 4096 // RA_CHUNK + 2)[1] == set()
