"""Fairness of the node's store requests under a burst (pure units, no kernel): urgent requests
(chunk maps, metadata, a reader's miss) before background ones (readahead, prefetch), the node's
cap on requests in flight, a reader joining a running prefetch (fetched once, re-classed), and
cancelled readers and prefetches leaving no slot or token behind."""

from __future__ import annotations

import contextlib
import random
import threading
from pathlib import Path

import pytest
import trio
import trio.testing
from testkit.fuse_helpers import running_lazy_cache
from testkit.slow_store import SlowBackend

from fuse_client.nodecache import LazyCache
from fuse_client.nodecache.limiter import DEMAND, PREFETCH, PriorityLimiter
from layerstore.backends.posix import PosixBackend
from layerstore.chunkmap import ChunkMap
from layerstore.store import Store

from .test_fuse_handlers import CHUNK, put_blob


class Owner:
    def __init__(self, priority: int) -> None:
        self.priority = priority


@pytest.fixture
def slow(tmp_path: Path) -> SlowBackend:
    inner = PosixBackend(tmp_path / "store", fsync=False)
    inner.create()
    return SlowBackend(inner)


@pytest.fixture
def sstore(slow: SlowBackend) -> Store:
    s = Store(slow)
    s.init()
    return s


def blob(store: Store, n: int, seed: int) -> tuple[ChunkMap, bytes]:
    data = random.Random(seed).randbytes(n * CHUNK)
    return put_blob(store, data), data


def lazy_cache(store: Store, cache_dir: Path, **kw: int) -> contextlib.AbstractAsyncContextManager[LazyCache]:
    return running_lazy_cache(store, cache_dir, deadline=20.0, **kw)


def key_of(store: Store, cmap: ChunkMap, i: int) -> str:
    return store.chunk_key(cmap.chunks[i].digest)


# -- the limiter alone -------------------------------------------------------------------------------
@pytest.mark.trio
async def test_background_waits_while_urgent_work_runs_and_never_passes_a_waiting_urgent() -> None:
    lim = PriorityLimiter(8)  # background 6, 1 while urgent work waits or runs
    assert (lim.background, lim.background_busy) == (6, 1)
    bg = [Owner(PREFETCH) for _ in range(9)]
    for o in bg[:6]:
        await lim.acquire(o)
    urgent = Owner(DEMAND)
    await lim.acquire(urgent)  # a slot was left for it
    granted: list[Owner] = []

    async def take(o: Owner) -> None:
        await lim.acquire(o)
        granted.append(o)

    async with trio.open_nursery() as nursery:
        for o in bg[6:]:
            nursery.start_soon(take, o)
            await trio.testing.wait_all_tasks_blocked()  # queued in this order
        assert lim.waiting == 3 and lim.in_use == 7  # a slot is free, but urgent work runs
        for o in bg[:5]:
            lim.release(o)  # the running background ends one by one: none starts meanwhile
            await trio.testing.wait_all_tasks_blocked()
            assert granted == []
        lim.release(bg[5])  # no background running: one may go beside the urgent request
        await trio.testing.wait_all_tasks_blocked()
        assert granted == [bg[6]]
        lim.release(urgent)  # no urgent work: background up to its share again
        await trio.testing.wait_all_tasks_blocked()
    assert granted[0] is bg[6] and {id(o) for o in granted} == {id(o) for o in bg[6:]}  # woken in any order
    assert lim.background_passed == 0
    for o in bg[6:]:
        lim.release(o)
    assert lim.in_use == 0 and lim.pressure == 0


@pytest.mark.trio
async def test_background_stays_throttled_through_the_pauses_of_a_burst(autojump_clock: trio.abc.Clock) -> None:
    lim = PriorityLimiter(8, burst=4, linger=1.0)
    for _ in range(4):  # four readers' misses, each done before the next: never two at once
        o = Owner(DEMAND)
        await lim.acquire(o)
        lim.release(o)
    assert lim.pressure == 0 and lim.in_burst()
    bg = [Owner(PREFETCH) for _ in range(3)]
    await lim.acquire(bg[0])
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lim.acquire, bg[1])
        await trio.testing.wait_all_tasks_blocked()
        assert lim.waiting == 1  # in the pause between misses, background does not refill
        await trio.sleep(1.5)  # the burst is over
        assert not lim.in_burst()
        lim.release(bg[0])  # the next event lets background take its share again
        await lim.acquire(bg[2])
    assert lim.background_in_use == 2
    for o in bg[1:]:
        lim.release(o)


@pytest.mark.trio
async def test_a_holder_joined_by_a_reader_stops_counting_as_background() -> None:
    lim = PriorityLimiter(4, background=1)
    running = Owner(PREFETCH)
    await lim.acquire(running)
    queued = Owner(PREFETCH)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lim.acquire, queued)
        await trio.testing.wait_all_tasks_blocked()
        assert lim.waiting == 1  # background's one slot is taken
        running.priority = DEMAND  # a reader joined the running prefetch
        lim.reprioritized(running)
        await trio.testing.wait_all_tasks_blocked()
    assert lim.waiting == 0 and lim.background_in_use == 1 and lim.pressure == 0
    lim.release(running)
    lim.release(queued)
    assert lim.in_use == 0


@pytest.mark.trio
async def test_fifo_baseline_lets_background_take_every_slot() -> None:
    lim = PriorityLimiter(2, fifo=True)
    a, b = Owner(PREFETCH), Owner(PREFETCH)
    await lim.acquire(a)
    await lim.acquire(b)
    assert lim.background_in_use == 2
    lim.release(a)
    lim.release(b)


# -- the fetcher on a slow store ---------------------------------------------------------------------
async def wait_in_flight(slow: SlowBackend, n: int) -> None:
    """Until `n` requests reached the store (worker threads start a moment after their slot)."""
    with trio.fail_after(10):
        while slow.in_flight < n:
            await trio.sleep(0.005)


@pytest.mark.trio
async def test_a_reader_goes_before_queued_readahead_and_prefetch(sstore: Store, slow: SlowBackend,
                                                                   tmp_path: Path) -> None:
    cmap, _ = blob(sstore, 24, 1)
    other, _ = blob(sstore, 4, 2)
    async with lazy_cache(sstore, tmp_path / "cache", concurrency=4, batch=1) as lazy:
        entry = await lazy.entry(cmap.blob)
        entry2 = await lazy.entry(other.blob)
        slots = lazy.fetcher.slots
        readers = [key_of(sstore, other, i) for i in range(4)]
        background = {key_of(sstore, cmap, i) for i in range(24)}
        slow.holds = {k: threading.Event() for k in [*readers, *background]}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lazy.ensure, entry2, [0])  # urgent, running
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(lazy.fetcher.prefetch, entry, list(range(24)))  # 3 requests, 1 may run
            await trio.testing.wait_all_tasks_blocked()
            assert slots.background_in_use == 1 and slots.waiting == 2
            for i in (1, 2, 3):  # more readers: two run at once, the third waits for a slot
                nursery.start_soon(lazy.ensure, entry2, [i])
                await trio.testing.wait_all_tasks_blocked()
            assert slots.in_use == 4 and slots.waiting == 3
            await wait_in_flight(slow, 4)
            before = set(slow.loads)
            slow.holds[readers[0]].set()  # one request ends: its slot goes to the waiting reader
            with trio.fail_after(10):
                while not set(slow.loads) - before:
                    await trio.sleep(0.005)
            await wait_in_flight(slow, 4)
            assert set(slow.loads) - before == {readers[3]}
            assert slots.waiting == 2 and slots.background_passed == 0
            for ev in slow.holds.values():
                ev.set()
        assert all(entry.present) and all(entry2.present)


@pytest.mark.parametrize("batching", [False, True])
@pytest.mark.trio
async def test_the_cap_on_store_requests_in_flight_holds(sstore: Store, slow: SlowBackend, tmp_path: Path,
                                                         batching: bool) -> None:
    """A burst: a prefetch of a whole blob, readers of another, chunk maps of new blobs, all at
    once on a slow store; never more than 4 requests in flight (a batch is one)."""
    slow.latency, slow.batching = 0.005, batching
    big, big_data = blob(sstore, 40, 3)
    small, small_data = blob(sstore, 12, 4)
    news = [blob(sstore, 2, 10 + k)[0] for k in range(6)]
    async with lazy_cache(sstore, tmp_path / "cache", concurrency=4, batch=4) as lazy:
        e_big = await lazy.entry(big.blob)
        e_small = await lazy.entry(small.blob)
        got: dict[int, bytes] = {}

        async def read(i: int) -> None:
            reader = lazy.open_reader(e_small)
            got[i] = bytes(await reader.read_missing(i * CHUNK, CHUNK))
            reader.close()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(lazy.fetcher.prefetch, e_big, list(range(40)))
            for i in range(12):
                nursery.start_soon(read, i)
            for cm in news:
                nursery.start_soon(lazy.entry, cm.blob)
        assert slow.peak <= 4 and lazy.fetcher.slots.peak <= 4
        assert slow.peak >= 2  # the burst did overlap
        assert all(got[i] == small_data[i * CHUNK:(i + 1) * CHUNK] for i in range(12))
        assert all(e_big.present)
        assert max(slow.chunk_loads().values()) == 1  # every chunk fetched once
        if batching:
            assert slow.batches and max(slow.batches) <= 4
        assert e_big.read_sync(0, len(big_data)) == big_data


@pytest.mark.parametrize("batching", [False, True])
@pytest.mark.trio
async def test_a_reader_joins_a_running_prefetch_which_then_counts_as_urgent(
        sstore: Store, slow: SlowBackend, tmp_path: Path, batching: bool) -> None:
    slow.batching = batching
    cmap, data = blob(sstore, 8, 5)
    # One slot: more chunks wanted than slots free, so the three go as one batch when batching.
    async with lazy_cache(sstore, tmp_path / "cache", concurrency=1 if batching else 8, batch=16) as lazy:
        entry = await lazy.entry(cmap.blob)
        slots = lazy.fetcher.slots
        slow.gate.clear()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lazy.fetcher.prefetch, entry, [4, 5, 6])
            await trio.testing.wait_all_tasks_blocked()
            assert slots.background_in_use == (1 if batching else 3)
            reader = lazy.open_reader(entry)
            got: list[bytes] = []

            async def read() -> None:
                got.append(bytes(await reader.read_missing(5 * CHUNK + 10, 100)))

            nursery.start_soon(read)
            await trio.testing.wait_all_tasks_blocked()
            # Joined, not fetched again; the request it is in no longer counts as background,
            # and a joined prefetch adds no pressure (it would throttle its own readahead).
            assert slots.background_in_use == (0 if batching else 2)
            assert slots.pressure == 0 and slots.waiting == 0
            slow.gate.set()
        reader.close()
        assert got == [data[5 * CHUNK + 10:5 * CHUNK + 110]]
        loads = slow.chunk_loads()
        assert [loads[key_of(sstore, cmap, i)] for i in (4, 5, 6)] == [1, 1, 1]
        assert slow.batches == ([3] if batching else [])


@pytest.mark.trio
async def test_chunks_are_batched_only_where_they_outnumber_the_free_slots(sstore: Store, slow: SlowBackend,
                                                                           tmp_path: Path) -> None:
    slow.batching = True
    cmap, data = blob(sstore, 48, 7)
    async with lazy_cache(sstore, tmp_path / "cache", concurrency=16, batch=16) as lazy:
        entry = await lazy.entry(cmap.blob)
        await lazy.fetcher.prefetch(entry, list(range(8)))  # 8 chunks, 12 background slots free
        assert slow.batches == []  # parallel single GETs: a batch is answered as one stream
        await lazy.ensure(entry, list(range(8, 48)))  # 40 urgent chunks, 16 slots: batches of 3
        assert slow.batches and max(slow.batches) == 3 and sum(slow.batches) <= 40
        assert max(slow.chunk_loads().values()) == 1
        assert entry.read_sync(0, len(data)) == data


@pytest.mark.parametrize("batching", [False, True])
@pytest.mark.trio
async def test_cancelled_readers_and_prefetches_leave_no_slot_or_token(sstore: Store, slow: SlowBackend,
                                                                        tmp_path: Path, batching: bool) -> None:
    slow.batching = batching
    cmap, data = blob(sstore, 30, 6)
    async with lazy_cache(sstore, tmp_path / "cache", concurrency=4, batch=4) as lazy:
        entry = await lazy.entry(cmap.blob)
        fetcher = lazy.fetcher
        slow.gate.clear()
        with trio.move_on_after(0.3):  # readers and a prefetch give up while the store hangs
            async with trio.open_nursery() as nursery:
                nursery.start_soon(fetcher.prefetch, entry, list(range(10, 30)))
                for i in range(8):
                    reader = lazy.open_reader(entry)
                    nursery.start_soon(reader.read_missing, i * CHUNK, 10)
        assert fetcher.prefetch_tokens.borrowed_tokens == 0
        assert sum(entry.pins.values()) == 0  # the readers' pins went with them
        slow.gate.set()
        with trio.fail_after(20):  # the flights they started still land (others may wait on them)
            while lazy.cache.busy or fetcher.slots.in_use:
                await trio.sleep(0.01)
        assert fetcher.slots.in_use == 0 and fetcher.slots.waiting == 0 and fetcher.slots.pressure == 0
        assert bool(slow.batches) == batching
        await lazy.ensure(entry, list(range(30)))
        assert entry.read_sync(0, len(data)) == data
