"""What the fetch path's CPU cuts must not change (docs/benchmarks-fetch.md, "CPU of the fetch path"):
the limiter's count of waiting urgent requests (now kept per waiter, not recounted per grant)
stays exact through grants, re-prioritising and cancellation; a request granted at once makes
no wake-up event; a prefetch of one chunk a request (a store that does not read in batches,
no nursery per request) still verifies every chunk and fails only the corrupt one."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import trio
import trio.testing
from testkit.fuse_helpers import running_lazy_cache

from fuse_client.nodecache.limiter import DEMAND, PREFETCH, URGENT, PriorityLimiter
from layerstore.errors import CorruptObject
from layerstore.store import Store

from .test_fuse_handlers import CHUNK, put_blob


class Owner:
    def __init__(self, priority: int) -> None:
        self.priority = priority


def recount(lim: PriorityLimiter) -> int:
    """The urgent waiters counted from scratch (what the limiter used to do on every drop)."""
    return sum(1 for w in lim._waiters if w.owner.priority <= DEMAND)  # noqa: SLF001 - the invariant under test


@pytest.mark.trio
async def test_urgent_waiting_stays_exact_through_grants_raises_and_cancellation() -> None:
    lim = PriorityLimiter(2, background=2)
    held = [Owner(DEMAND), Owner(PREFETCH)]
    for o in held:
        await lim.acquire(o)
    assert lim.pressure == 1
    urgent = [Owner(DEMAND) for _ in range(3)]
    background = [Owner(PREFETCH) for _ in range(3)]
    scopes: dict[int, trio.CancelScope] = {}
    granted: list[Owner] = []

    async def take(o: Owner) -> None:
        with trio.CancelScope() as cs:
            scopes[id(o)] = cs
            await lim.acquire(o)
            granted.append(o)

    async with trio.open_nursery() as nursery:
        for o in urgent + background:
            nursery.start_soon(take, o)
            await trio.testing.wait_all_tasks_blocked()  # queued in this order
        assert lim.waiting == 6 and lim._urgent_waiting == recount(lim) == 3  # noqa: SLF001
        background[0].priority = DEMAND  # a reader joined a queued prefetch
        lim.reprioritized(background[0])
        assert lim._urgent_waiting == recount(lim) == 4  # noqa: SLF001
        scopes[id(urgent[1])].cancel()  # a reader gives up while queued
        await trio.testing.wait_all_tasks_blocked()
        assert lim._urgent_waiting == recount(lim) == 3  # noqa: SLF001
        for o in held:  # one at a time: woken tasks run in any order
            lim.release(o)
            await trio.testing.wait_all_tasks_blocked()
        assert lim._urgent_waiting == recount(lim) == 1  # noqa: SLF001
        assert granted == [urgent[0], urgent[2]]  # urgent first, in arrival order
        released = 0
        while len(granted) < 5:  # one slot freed at a time, oldest holder first
            lim.release(granted[released])
            released += 1
            await trio.testing.wait_all_tasks_blocked()
            assert lim._urgent_waiting == recount(lim)  # noqa: SLF001
    assert granted == [urgent[0], urgent[2], background[0], background[1], background[2]]
    for o in granted[released:]:
        lim.release(o)
    assert lim.in_use == 0 and lim.waiting == 0 and lim.pressure == 0


@pytest.mark.trio
async def test_a_request_granted_at_once_makes_no_event_and_a_queued_one_is_woken() -> None:
    lim = PriorityLimiter(1)
    first, second = Owner(DEMAND), Owner(PREFETCH)
    await lim.acquire(first)  # no waiter left behind, nothing to wake
    assert lim.waiting == 0 and lim._held[id(first)] == URGENT  # noqa: SLF001
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lim.acquire, second)
        await trio.testing.wait_all_tasks_blocked()
        (w,) = lim._waiters  # noqa: SLF001
        assert w.event is not None and not w.granted
        lim.release(first)
    assert w.granted and lim.background_in_use == 1
    lim.release(second)


@pytest.mark.trio
async def test_a_prefetch_of_single_chunk_requests_verifies_each_and_fails_only_the_corrupt_one(
        tmp_path: Path) -> None:
    with Store.open(str(tmp_path / "store")) as store:
        store.init()
        data = random.Random(7).randbytes(12 * CHUNK)
        cmap = put_blob(store, data)
        path = tmp_path / "store" / store.chunk_key(cmap.chunks[5].digest)
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0xFF  # the store's own bytes of chunk 5 go bad
        path.write_bytes(bytes(raw))
        async with running_lazy_cache(store, tmp_path / "cache") as lazy:
            assert not lazy.fetcher._batching()  # noqa: SLF001 - one chunk a request: the path under test
            entry = await lazy.entry(cmap.blob)
            done, failed = await lazy.fetcher.prefetch(entry, list(range(12)))
            assert (done, failed) == (11, 1)
            assert list(entry.present) == [1] * 5 + [0] + [1] * 6
            assert lazy.stats.corrupt_chunks == 1 and lazy.stats.blobs[cmap.blob].fetches == 11
            assert entry.read_sync(0, 5 * CHUNK) == data[:5 * CHUNK]
            assert entry.read_sync(6 * CHUNK, 12 * CHUNK) == data[6 * CHUNK:]
            reader = lazy.open_reader(entry)
            with pytest.raises(CorruptObject):
                await reader.read_missing(5 * CHUNK, 100)  # fetched again, refused again, never served
            reader.close()
            assert not entry.present[5]
