"""Bounded work from hostile objects on a node (issue 27), with the node cache in-process
(`running_lazy_cache`, what the daemon runs) and this process's memory from /proc/self/status:

- a chunk map over its blob's bound is refused from its first 1 MiB (a lookup fails with
  CorruptObject, which the FUSE edge answers EIO), and the node's memory is unchanged;
- a chunk object that says it is longer than its chunk map's length is refused before it is
  decompressed (a store that serves 64 MiB zstd bombs under 4 KiB chunks' names);
- chunks of the largest legal size fetched all at once are decompressed within the node's
  decode budget (`decodebudget`, 128 MiB)."""

from __future__ import annotations

import errno
import gc
import os
from pathlib import Path

import pytest
import trio
import zstandard
from testkit.fuse_helpers import DaemonProcess, read_errno, running_lazy_cache
from testkit.hostile_maps import one_byte_map
from testkit.procmem import MiB, peak_rss, reset_peak, rss

from fuse_client.nodecache.decodebudget import DEFAULT_BUDGET
from layerstore import chunkmap, chunkobj, keys
from layerstore import digest as digestmod
from layerstore.chunkmap import ChunkMap, ChunkRef
from layerstore.errors import CorruptObject
from layerstore.store import Store

pytestmark = pytest.mark.hostile


@pytest.fixture
def store(tmp_path: Path) -> Store:
    with Store.open(str(tmp_path / "store")) as s:
        s.init()
        yield s


def _bomb_object(length: int, fill: int) -> tuple[str, bytes]:
    payload = bytes([fill]) * length
    body = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(payload)
    obj = chunkobj.HEADER.pack(chunkobj.MAGIC, chunkobj.VERSION, chunkobj.COMP_ZSTD, 0, length) + body
    return digestmod.of(payload), obj


@pytest.mark.slow  # hundreds of MiB decoded or refused: `make test`, not `make check`
def test_a_map_over_the_bound_fails_the_lookup_and_costs_no_memory(store: Store, tmp_path: Path) -> None:
    """The issue's map (4,194,304 entries of a 1-byte chunk, 192 MiB). Old code read and decoded
    it: 37 s and the daemon at 1.2 GB, never given back."""
    blob, data = one_byte_map(chunkmap.MAX_ENTRIES)
    store.backend.store_once(keys.object_key("blobs", blob), data)
    del data
    gc.collect()

    async def main() -> None:
        async with running_lazy_cache(store, tmp_path / "cache", deadline=5.0) as lazy:
            before = rss(os.getpid())
            for _ in range(3):  # and again: every lookup is refused, none keeps anything
                with pytest.raises(CorruptObject, match="more than 4096") as info:
                    await lazy.entry(blob)
                assert info.value.errno == errno.EIO  # what the FUSE edge answers
            gc.collect()
            grew = rss(os.getpid()) - before
            assert grew < 16 * MiB, f"RSS grew by {grew / MiB:.1f} MiB"
            assert lazy.cache.get(blob) is None and lazy.blobs() == []

    trio.run(main)


@pytest.mark.root
def test_the_daemon_answers_eio_for_the_map_and_keeps_no_memory(store: Store, tmp_path: Path) -> None:
    """`layerctl daemon` asked for the issue's blob: EIO, every time, its RSS unchanged. Old
    code: the lookup gave up after its deadline (EIO too) while a worker thread decoded the
    map into 1.2 GB that the daemon kept."""
    blob, data = one_byte_map(chunkmap.MAX_ENTRIES)
    store.backend.store_once(keys.object_key("blobs", blob), data)
    del data
    with DaemonProcess(store.url, tmp_path / "cache", tmp_path / "mnt") as d:
        before = rss(d.pid)
        for _ in range(3):
            assert read_errno(d.blob(blob)) == errno.EIO
        assert d.stats()  # still answering
        grew = rss(d.pid) - before
        assert grew < 16 * MiB, f"daemon RSS grew by {grew / MiB:.1f} MiB"
        assert "more than 4096" in d.log_text()


def test_chunks_longer_than_their_map_says_are_refused_before_decompressing(store: Store, tmp_path: Path) -> None:
    """A store serving a 64 MiB zstd bomb under each of 32 4-KiB chunks' names: refused from the
    object's header (it says 64 MiB, the map 4 KiB). Old code decompressed each (16 at a time)
    before the digest told it apart: about 1 GiB at once."""
    refs = [ChunkRef(i * 4096, 4096, digestmod.of(os.urandom(4096))) for i in range(32)]
    cm = ChunkMap.build(refs)
    store.backend.store_once(keys.object_key("blobs", cm.blob), cm.encode())
    _digest, bomb = _bomb_object(chunkobj.MAX_CHUNK, 1)
    for r in refs:
        store.backend.store_once(store.chunk_key(r.digest), bomb)
    if not reset_peak(os.getpid()):
        pytest.skip("cannot reset VmHWM")

    async def main() -> None:
        async with running_lazy_cache(store, tmp_path / "cache", deadline=2.0, batch=1) as lazy:
            entry = await lazy.entry(cm.blob)
            before = rss(os.getpid())
            reset_peak(os.getpid())
            with pytest.raises(CorruptObject, match="more than 4096"):
                await lazy.ensure(entry, list(range(len(refs))))
            grew = peak_rss(os.getpid()) - before
            assert grew < 32 * MiB, f"peak RSS grew by {grew / MiB:.0f} MiB"

    trio.run(main)


@pytest.mark.slow  # hundreds of MiB decoded or refused: `make test`, not `make check`
def test_largest_chunks_all_at_once_stay_within_the_decode_budget(store: Store, tmp_path: Path) -> None:
    """Six legal 64 MiB chunks (a few KiB each as stored), all wanted at once: old code
    decompressed all six together (+384 MiB and more); now at most the budget is held."""
    refs, n = [], 6
    for i in range(n):
        digest, obj = _bomb_object(chunkobj.MAX_CHUNK, 10 + i)
        store.backend.store_once(store.chunk_key(digest), obj)
        refs.append(ChunkRef(i * chunkobj.MAX_CHUNK, chunkobj.MAX_CHUNK, digest))
    cm = ChunkMap.build(refs)
    store.backend.store_once(keys.object_key("blobs", cm.blob), cm.encode())
    if not reset_peak(os.getpid()):
        pytest.skip("cannot reset VmHWM")

    async def main() -> None:
        async with running_lazy_cache(store, tmp_path / "cache", deadline=60.0, batch=1) as lazy:
            entry = await lazy.entry(cm.blob)
            gc.collect()
            before = rss(os.getpid())
            reset_peak(os.getpid())
            await lazy.ensure(entry, list(range(n)))
            grew = peak_rss(os.getpid()) - before
            print(f"peak RSS +{grew / MiB:.0f} MiB fetching {n} x 64 MiB chunks at once")
            assert entry.missing(list(range(n))) == []
            assert lazy.fetcher.decoding.peak <= DEFAULT_BUDGET
            assert grew <= DEFAULT_BUDGET + 64 * MiB, f"peak RSS grew by {grew / MiB:.0f} MiB"

    trio.run(main)


def _small_blob(store: Store, n: int, seed: int) -> ChunkMap:
    refs = []
    for i in range(n):
        payload = bytes([seed]) * 16 + i.to_bytes(4, "little") * 1020
        refs.append(ChunkRef(i * len(payload), len(payload), store.put_chunk(payload)[0]))
    cm = ChunkMap.build(refs)
    store.put_chunk_map(cm)
    return cm


def test_the_node_forgets_idle_maps_past_its_map_budget(store: Store, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Past LAYERSTORE_MAP_BUDGET, adding a map forgets the least recently used blobs nothing
    uses (an open one stays), and a forgotten blob is fetched again when asked for. Old code
    kept every map it ever loaded."""
    monkeypatch.setenv("LAYERSTORE_MAP_BUDGET", str(100 * chunkmap.DECODED_ENTRY))  # 100 entries
    a, b, c, d = (_small_blob(store, 40, k) for k in range(4))

    async def main() -> None:
        async with running_lazy_cache(store, tmp_path / "cache", deadline=5.0) as lazy:
            cache = lazy.cache
            ea = await lazy.entry(a.blob)
            await lazy.ensure(ea, [0])
            ea.open_count += 1  # a file open on it (what the FUSE front end counts)
            await lazy.entry(b.blob)
            await lazy.entry(c.blob)  # 120 entries: b (idle, least recent) goes, a is open
            assert cache.get(b.blob) is None and cache.get(a.blob) is ea and cache.get(c.blob) is not None
            assert cache.forgetting.map_entries() == 80
            ea.open_count -= 1
            await lazy.entry(d.blob)  # a and c idle now: the least recently used of them goes
            assert cache.forgetting.map_entries() <= 100 and cache.get(d.blob) is not None
            assert cache.forgetting.maps_forgotten == 2
            eb = await lazy.entry(b.blob)  # fetched again
            await lazy.ensure(eb, list(range(40)))
            assert cache.gauges()["cache_map_entries"] <= 100

    trio.run(main)
