"""The node cache's batched reads against a real store service (`layerctl serve` in front of a
local store): a readahead window of N chunks is ceil(N/16) batched requests and no single GET
(counted on the service's /metrics), and an object that fails verification in a batch fails
only its own chunk."""

from __future__ import annotations

import contextlib
import math
import random
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import trio
from testkit.fuse_helpers import running_lazy_cache
from testkit.store_service import Service, start_service

from fuse_client.nodecache import LazyCache
from fuse_client.nodecache.fetcher import DEFAULT_BATCH
from fuse_client.nodecache.lazy import fetch_batch_from_env
from layerstore.backends.http import HttpBackend
from layerstore.backends.posix import PosixBackend
from layerstore.chunkmap import ChunkMap
from layerstore.errors import CorruptObject
from layerstore.store import Store

from .test_fuse_handlers import CHUNK, put_blob

BATCH_ROUTE = re.compile(r'^layerstore_service_requests_total\{method="(\w+)",route="([^"]+)",status="200"\} (\S+)$')


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Service, Path]]:
    work = tmp_path_factory.mktemp("fetch-batching")
    store_dir = work / "store"
    with Store.open(str(store_dir)) as s:
        s.init()
    svc = start_service(str(store_dir), work, workers=2)
    try:
        yield svc, store_dir
    finally:
        svc.stop()


def requests(svc: Service) -> dict[str, float]:
    """Answered requests per (method route), from the service's /metrics."""
    out: dict[str, float] = {}
    for line in httpx.get(svc.url + "/metrics", timeout=10).text.splitlines():
        m = BATCH_ROUTE.match(line)
        if m:
            out[f"{m[1]} {m[2]}"] = out.get(f"{m[1]} {m[2]}", 0.0) + float(m[3])
    return out


async def requests_since(svc: Service, before: dict[str, float], batches: int) -> dict[str, float]:
    """Requests answered since `before`, once `batches` batched reads are among them (the service
    counts a request once its answer is sent whole; the chunks land as their frames arrive)."""
    with trio.fail_after(10):
        while True:
            after = requests(svc)
            delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
            if delta.get("POST /v1/batch", 0) >= batches:
                return delta
            await trio.sleep(0.05)


@contextlib.asynccontextmanager
async def lazy_over(svc: Service, cache_dir: Path, concurrency: int = 16) -> AsyncIterator[LazyCache]:
    with Store(HttpBackend(svc.url)) as store:
        async with running_lazy_cache(store, cache_dir, deadline=10.0, batch=16, concurrency=concurrency) as lazy:
            yield lazy


def push(store_dir: Path, n: int, seed: int) -> tuple[ChunkMap, bytes]:
    data = random.Random(seed).randbytes(n * CHUNK)
    with Store.open(str(store_dir)) as s:
        return put_blob(s, data), data


@pytest.mark.trio
async def test_a_readahead_window_of_n_chunks_is_ceil_n_over_16_batched_requests(
        service: tuple[Service, Path], tmp_path: Path) -> None:
    svc, store_dir = service
    n = 40
    cmap, data = push(store_dir, n, 1)
    # One slot (a node at its cap): every request carries as many chunks as a batch may.
    async with lazy_over(svc, tmp_path / "cache", concurrency=1) as lazy:
        entry = await lazy.entry(cmap.blob)
        assert lazy.fetcher.store.backend.reads_in_batches  # type: ignore[attr-defined]
        before = requests(svc)
        lazy.fetcher.readahead(entry, 0, n)
        with trio.fail_after(30):
            while not all(entry.present):
                await trio.sleep(0.01)
        delta = await requests_since(svc, before, math.ceil(n / 16))
        assert delta.get("POST /v1/batch") == math.ceil(n / 16)
        assert delta.get("GET /v1/objects/{key:path}", 0) == 0
        assert entry.read_sync(0, len(data)) == data
        assert lazy.stats.blobs[cmap.blob].fetches == n


@pytest.mark.trio
async def test_a_corrupt_object_in_a_batch_fails_only_its_chunk(service: tuple[Service, Path],
                                                                tmp_path: Path) -> None:
    svc, store_dir = service
    cmap, data = push(store_dir, 8, 2)
    with Store.open(str(store_dir)) as s:
        path = store_dir / s.chunk_key(cmap.chunks[3].digest)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF  # the store's own bytes go bad
    path.write_bytes(bytes(raw))
    async with lazy_over(svc, tmp_path / "cache", concurrency=1) as lazy:
        entry = await lazy.entry(cmap.blob)
        before = requests(svc)
        with pytest.raises(CorruptObject):
            await lazy.ensure(entry, list(range(8)))  # one batch: the reader of chunk 3 fails
        assert list(entry.present) == [1, 1, 1, 0, 1, 1, 1, 1]
        delta = await requests_since(svc, before, 1)
        assert delta.get("POST /v1/batch") == 1 and delta.get("GET /v1/objects/{key:path}", 0) == 0
        assert lazy.stats.corrupt_chunks == 1
        reader = lazy.open_reader(entry)
        assert bytes(await reader.read_missing(5 * CHUNK, 100)) == data[5 * CHUNK:5 * CHUNK + 100]
        with pytest.raises(CorruptObject):
            await reader.read_missing(3 * CHUNK, 100)  # fetched again, still refused, never served
        reader.close()
        assert lazy.stats.corrupt_chunks == 2
        assert entry.read_sync(0, 3 * CHUNK) == data[:3 * CHUNK]


def test_which_backends_read_in_batches(tmp_path: Path) -> None:
    http = HttpBackend("http://127.0.0.1:9")
    assert http.reads_in_batches
    http.batched = False  # the service turned out to have no batched read
    assert not http.reads_in_batches
    assert not PosixBackend(tmp_path / "s").reads_in_batches  # a `load` each: not batched


@pytest.mark.parametrize(("raw", "want"), [(None, DEFAULT_BATCH), ("", DEFAULT_BATCH), ("4", 4), ("1", 1),
                                           ("0", 1), ("-3", 1), ("many", DEFAULT_BATCH)])
def test_the_batch_size_from_the_environment(monkeypatch: pytest.MonkeyPatch, raw: str | None, want: int) -> None:
    if raw is None:
        monkeypatch.delenv("LAYERSTORE_FETCH_BATCH", raising=False)
    else:
        monkeypatch.setenv("LAYERSTORE_FETCH_BATCH", raw)
    assert fetch_batch_from_env() == want


class Counting:
    """A `ChunkSource` that is not a `Store` (no `backend`): it reads in batches through the
    store it wraps and counts its batched reads and single gets."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.batches = 0
        self.singles = 0
        self.reads_in_batches = True

    def get_chunk_map(self, blob: str) -> ChunkMap:
        return self.store.get_chunk_map(blob)

    def get_chunk(self, chunk: str, max_length: int = 1 << 26) -> bytes:
        self.singles += 1
        return self.store.get_chunk(chunk, max_length)

    def get_chunk_frame(self, chunk: str, max_length: int = 1 << 26) -> tuple[bytes, memoryview | None]:
        self.singles += 1
        return self.store.get_chunk_frame(chunk, max_length)

    def chunk_key(self, chunk: str) -> str:
        return self.store.chunk_key(chunk)

    def load_many(self, keys: list[str], *, max_size: int | None = None) -> Iterator[tuple[str, object]]:
        self.batches += 1
        return self.store.load_many(keys, max_size=max_size)


@pytest.mark.trio
async def test_the_fetcher_batches_through_what_its_source_declares(service: tuple[Service, Path],
                                                                    tmp_path: Path) -> None:
    """The fetcher asks its source (`ChunkSource.reads_in_batches`, `load_many`), not a `backend`
    it reaches past the source for: a wrapper that reads in batches gets batched reads."""
    from fuse_client.nodecache.source import ChunkSource

    svc, store_dir = service
    n = 20
    cmap, data = push(store_dir, n, 3)
    with Store(HttpBackend(svc.url)) as store:
        assert isinstance(store, ChunkSource) and store.reads_in_batches
        source = Counting(store)
        async with running_lazy_cache(source, tmp_path / "cache", deadline=10.0, batch=16,  # type: ignore[arg-type]
                                      concurrency=1) as lazy:
            entry = await lazy.entry(cmap.blob)
            lazy.fetcher.readahead(entry, 0, n)
            with trio.fail_after(30):
                while not all(entry.present):
                    await trio.sleep(0.01)
            assert entry.read_sync(0, len(data)) == data
    assert (source.batches, source.singles) == (math.ceil(n / 16), 0)
