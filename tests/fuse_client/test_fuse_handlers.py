"""The FUSE operations called directly, without a kernel (as S3QL tests its handlers): the read
path, single-flight, metadata-first, failures, priorities, eviction and the trace."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import random
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pyfuse3
import pytest
import trio
from testkit.fuse_helpers import CountingBackend, running_lazy_cache
from testkit.nodecache_formats import compressible

import fuse_client.nodecache.reader as readermod
from fuse_client.daemon import DaemonConfig
from fuse_client.fuse.fs import BLOBS_INODE, ROOT_INODE, BlobFS
from fuse_client.nodecache import (
    INDEX_DIR,
    Budget,
    Fetcher,
    LazyCache,
    NodeCache,
    SingleChunkSource,
    Stats,
    TraceRecorder,
)
from fuse_client.nodecache.cachedir import recorded_format
from fuse_client.nodecache.index import CacheIndex
from fuse_client.nodecache.limiter import PREFETCH
from fuse_client.nodecache.recovery import recover
from layerstore import keys
from layerstore.chunkmap import METADATA, ChunkMap, ChunkRef
from layerstore.errors import StoreUnavailable
from layerstore.store import Store

CHUNK = 64 * 1024


def put_blob(store: Store, data: bytes, chunk: int = CHUNK, meta: tuple[int, ...] = ()) -> ChunkMap:
    """Store `data` as a blob cut every `chunk` bytes; the chunks in `meta` carry METADATA."""
    refs = []
    for n, off in enumerate(range(0, len(data), chunk)):
        piece = data[off:off + chunk]
        digest, _ = store.put_chunk(piece)
        refs.append(ChunkRef(off, len(piece), digest, METADATA if n in meta else 0))
    cmap = ChunkMap.build(refs)  # the blob id is the chunk list's (layerstore.chunkmap.blob_id)
    store.put_chunk_map(cmap)
    return cmap


@pytest.fixture
def data() -> bytes:
    return compressible(7, 20 * CHUNK + 1234)


class Rig:
    def __init__(self, fs: BlobFS, lazy: LazyCache) -> None:
        self.fs, self.lazy = fs, lazy
        self.cache: NodeCache = lazy.cache
        self.fetcher: Fetcher = lazy.fetcher
        self.stats: Stats = lazy.stats

    async def open_blob(self, blob: str) -> int:
        attr = await self.fs.lookup(BLOBS_INODE, blob.encode())
        return (await self.fs.open(attr.st_ino, os.O_RDONLY)).fh

    async def read(self, fh: int, off: int, size: int) -> bytes:
        """A copy of the answer: `BlobFS.read` answers with a view of the mapped cache file, valid
        until the next await (pyfuse3 sends it at once); a test that keeps it must copy it."""
        return bytes(await self.fs.read(fh, off, size))

    async def read_all(self, fh: int, size: int, step: int = 128 * 1024) -> bytes:
        return b"".join([await self.read(fh, off, step) for off in range(0, size, step)])


@contextlib.asynccontextmanager
async def rig(store: Store, cache_dir: Path, *, budget: Budget | None = None, deadline: float = 5.0,
              concurrency: int = 8, trace: TraceRecorder | None = None) -> AsyncIterator[Rig]:
    async with running_lazy_cache(store, cache_dir, budget=budget, stats=Stats(), trace=trace,
                                  concurrency=concurrency, deadline=deadline) as lazy:
        yield Rig(BlobFS(lazy), lazy)


def fuse_errno(exc_info: pytest.ExceptionInfo[pyfuse3.FUSEError]) -> int:
    return exc_info.value.errno


# -- who may read (issue 27) -----------------------------------------------------------------------
@pytest.mark.hostile
@pytest.mark.trio
@pytest.mark.parametrize("group", [None, 4321])
async def test_modes_admit_no_other_user(store: Store, data: bytes, tmp_path: Path, group: int | None) -> None:
    """Blobs may hold an environment's secrets: the mount's files are the daemon's user's (0400,
    dirs 0500), or also a control group's (0440, 0550) when one is configured; and only then
    may other users reach the mount at all (allow_other). `default_permissions` makes the
    kernel check these modes."""
    cmap = put_blob(store, data)
    cfg = DaemonConfig(cache_dir=tmp_path / "cache", mountpoint=tmp_path / "mnt",
                       control_group=None if group is None else str(group))
    opts = cfg.fuse_options()
    assert "default_permissions" in opts and ("allow_other" in opts) == (group is not None)
    async with running_lazy_cache(store, tmp_path / "cache", stats=Stats()) as lazy:
        fs = BlobFS(lazy, uid=7, gid=group or 8, group_read=group is not None)
        blob = await fs.lookup(BLOBS_INODE, cmap.blob.encode())
        want_file, want_dir = (0o100440, 0o040550) if group is not None else (0o100400, 0o040500)
        assert (blob.st_mode, blob.st_uid, blob.st_gid) == (want_file, 7, group or 8)
        assert (await fs.getattr(blob.st_ino)).st_mode == want_file
        for ino in (ROOT_INODE, BLOBS_INODE):
            assert (await fs.getattr(ino)).st_mode == want_dir
        assert all(m & 0o007 == 0 for m in (blob.st_mode, want_dir))  # nothing for "other", ever


# -- namespace ------------------------------------------------------------------------------------
@pytest.mark.trio
async def test_namespace_lookup_getattr_readdir_forget(store: Store, data: bytes, tmp_path: Path) -> None:
    cmap = put_blob(store, data)
    async with rig(store, tmp_path / "cache") as r:
        fs = r.fs
        root = await fs.getattr(ROOT_INODE)
        assert root.st_mode & 0o170000 == 0o040000
        blobs = await fs.lookup(ROOT_INODE, b"blobs")
        assert blobs.st_ino == BLOBS_INODE and blobs.entry_timeout > 0
        with pytest.raises(pyfuse3.FUSEError) as ei:
            await fs.lookup(ROOT_INODE, b"nothing")
        assert fuse_errno(ei) == errno.ENOENT
        with pytest.raises(pyfuse3.FUSEError) as ei:
            await fs.lookup(BLOBS_INODE, b"b3:" + b"0" * 64)
        assert fuse_errno(ei) == errno.ENOENT
        with pytest.raises(pyfuse3.FUSEError) as ei:
            await fs.lookup(BLOBS_INODE, b"not-a-digest")
        assert fuse_errno(ei) == errno.ENOENT

        attr = await fs.lookup(BLOBS_INODE, cmap.blob.encode())
        assert attr.st_size == len(data)
        assert attr.st_mode == 0o100400  # the daemon's user only (test_modes_admit_no_other_user)
        assert attr.entry_timeout >= 3600 and attr.attr_timeout >= 3600
        assert (await fs.getattr(attr.st_ino)).st_size == len(data)
        again = await fs.lookup(BLOBS_INODE, cmap.blob.encode())
        assert again.st_ino == attr.st_ino

        # Two lookups, then forget both: the inode is gone; a new lookup gets a new number.
        await fs.forget([(attr.st_ino, 2)])
        with pytest.raises(pyfuse3.FUSEError) as ei:
            await fs.getattr(attr.st_ino)
        assert fuse_errno(ei) == errno.ENOENT
        fresh = await fs.lookup(BLOBS_INODE, cmap.blob.encode())
        assert fresh.st_ino != attr.st_ino

        # readdir of blobs/ lists the blobs this node has seen (via readdir_reply; stubbed here).
        seen: list[tuple[bytes, int]] = []

        def reply(token: object, name: bytes, a: pyfuse3.EntryAttributes, next_id: int) -> bool:
            seen.append((name, a.st_size))
            return True

        orig = pyfuse3.readdir_reply
        pyfuse3.readdir_reply = reply  # type: ignore[assignment]
        try:
            fh = await fs.opendir(BLOBS_INODE)
            await fs.readdir(fh, 0, None)  # type: ignore[arg-type]
        finally:
            pyfuse3.readdir_reply = orig  # type: ignore[assignment]
        assert seen == [(cmap.blob.encode(), len(data))]


@pytest.mark.trio
async def test_nothing_is_writable(store: Store, data: bytes, tmp_path: Path) -> None:
    cmap = put_blob(store, data)
    async with rig(store, tmp_path / "cache") as r:
        fs = r.fs
        attr = await fs.lookup(BLOBS_INODE, cmap.blob.encode())
        for flags in (os.O_WRONLY, os.O_RDWR, os.O_RDONLY | os.O_APPEND):
            with pytest.raises(pyfuse3.FUSEError) as ei:
                await fs.open(attr.st_ino, flags)
            assert fuse_errno(ei) == errno.EROFS
        fh = (await fs.open(attr.st_ino, os.O_RDONLY)).fh
        attempts = [
            fs.write(fh, 0, b"x"),
            fs.setattr(attr.st_ino, None, None, None, None),
            fs.create(BLOBS_INODE, b"new", 0o644, os.O_WRONLY, None),
            fs.mkdir(BLOBS_INODE, b"d", 0o755, None),
            fs.unlink(BLOBS_INODE, cmap.blob.encode(), None),
            fs.rename(BLOBS_INODE, cmap.blob.encode(), BLOBS_INODE, b"x", 0, None),
            fs.setxattr(attr.st_ino, b"user.x", b"1", None),
        ]
        for coro in attempts:
            with pytest.raises(pyfuse3.FUSEError) as ei:
                await coro
            assert fuse_errno(ei) == errno.EROFS
        await fs.release(fh)


# -- the read path --------------------------------------------------------------------------------
@pytest.mark.trio
@pytest.mark.usefixtures("cache_format")
async def test_read_fetches_then_hits(store: Store, backend: CountingBackend, data: bytes, tmp_path: Path) -> None:
    cmap = put_blob(store, data)
    async with rig(store, tmp_path / "cache") as r:
        fh = await r.open_blob(cmap.blob)
        assert await r.read_all(fh, len(data)) == data
        st = r.stats.blobs[cmap.blob]
        assert st.misses > 0 and st.fetched_bytes == len(data)
        loads = backend.chunk_loads()
        assert set(loads.values()) == {1}
        misses, hits = st.misses, st.hits
        # Unaligned reads across chunk boundaries, and reads past the end.
        assert await r.fs.read(fh, CHUNK - 10, 20) == data[CHUNK - 10:CHUNK + 10]
        assert await r.fs.read(fh, len(data) - 5, 100) == data[-5:]
        assert await r.fs.read(fh, len(data) + 5, 100) == b""
        assert await r.read_all(fh, len(data), 100_000) == data
        assert st.misses == misses and st.hits > hits
        assert backend.chunk_loads() == loads  # nothing fetched twice
        assert st.served_bytes >= 2 * len(data)
        await r.fs.release(fh)


@pytest.mark.trio
async def test_metadata_chunks_fetched_at_open(store: Store, backend: CountingBackend, data: bytes,
                                               tmp_path: Path) -> None:
    meta = (0, 1, 19)
    cmap = put_blob(store, data, meta=meta)
    async with rig(store, tmp_path / "cache") as r:
        fh = await r.open_blob(cmap.blob)
        loads = backend.chunk_loads()
        want = {store.chunk_key(cmap.chunks[i].digest) for i in meta}
        assert set(loads) == want and set(loads.values()) == {1}
        entry = r.cache.get(cmap.blob)
        assert entry is not None and not entry.missing(meta)
        # Reading metadata now is a pure hit.
        assert await r.fs.read(fh, 0, 2 * CHUNK) == data[:2 * CHUNK]
        assert r.stats.blobs[cmap.blob].misses == 0
        assert r.stats.blobs[cmap.blob].fetched_bytes == 3 * CHUNK


@pytest.mark.trio
@pytest.mark.usefixtures("cache_format")
async def test_single_flight_64_readers(store: Store, backend: CountingBackend, data: bytes, tmp_path: Path) -> None:
    # Identical content at several positions: fetched once per blob as well.
    dup = random.Random(3).randbytes(CHUNK)
    blob_data = data[:8 * CHUNK] + dup + data[9 * CHUNK:12 * CHUNK] + dup + data[13 * CHUNK:]
    cmap = put_blob(store, blob_data)
    async with rig(store, tmp_path / "cache", concurrency=4) as r:
        fh = await r.open_blob(cmap.blob)
        results: dict[int, bytes] = {}

        async def reader(k: int) -> None:
            rng = random.Random(k)
            offs = list(range(0, len(blob_data), 128 * 1024))
            rng.shuffle(offs)
            got = {}
            for off in offs:
                got[off] = await r.read(fh, off, 128 * 1024)
            results[k] = b"".join(got[o] for o in sorted(got))

        async with trio.open_nursery() as nursery:
            for k in range(64):
                nursery.start_soon(reader, k)
        assert all(v == blob_data for v in results.values()) and len(results) == 64
        loads = backend.chunk_loads()
        assert len(loads) == len(cmap.unique_digests()) == len(cmap.chunks) - 1
        assert set(loads.values()) == {1}, loads


# -- failures ------------------------------------------------------------------------------------
@pytest.mark.trio
@pytest.mark.usefixtures("cache_format")
async def test_corrupt_chunk_is_eio_counted_logged_and_retried(store: Store, backend: CountingBackend, data: bytes,
                                                               tmp_path: Path, caplog: pytest.LogCaptureFixture
                                                               ) -> None:
    cmap = put_blob(store, data)
    victim = 5
    ref = cmap.chunks[victim]
    path = backend.inner.root / keys.object_key("chunks", ref.digest)  # type: ignore[attr-defined]
    good = path.read_bytes()
    bad = bytearray(good)
    bad[-1] ^= 0xFF
    path.write_bytes(bytes(bad))
    async with rig(store, tmp_path / "cache") as r:
        fh = await r.open_blob(cmap.blob)
        assert await r.fs.read(fh, 0, CHUNK) == data[:CHUNK]
        with caplog.at_level(logging.ERROR), pytest.raises(pyfuse3.FUSEError) as ei:
            await r.fs.read(fh, ref.offset + 10, 100)
        assert fuse_errno(ei) == errno.EIO
        assert r.stats.corrupt_chunks == 1
        assert any(cmap.blob in m and f"chunk {victim}" in m for m in caplog.messages), caplog.messages
        entry = r.cache.get(cmap.blob)
        assert entry is not None and not entry.present[victim]
        # Nothing of the bad payload reached the data file.
        assert os.pread(entry.fd, ref.length, ref.offset) == b"\0" * ref.length
        # Still bad: EIO again (and the store was asked again).
        with pytest.raises(pyfuse3.FUSEError):
            await r.fs.read(fh, ref.offset, 100)
        assert backend.chunk_loads()[store.chunk_key(ref.digest)] == 2
        # Repaired in the store: the next read succeeds.
        path.write_bytes(good)
        assert await r.fs.read(fh, ref.offset, ref.length) == data[ref.offset:ref.end]
        assert r.stats.corrupt_chunks == 2


@pytest.mark.trio
async def test_store_unavailable_cached_reads_work_missing_reads_eio_then_recover(
        store: Store, backend: CountingBackend, data: bytes, tmp_path: Path) -> None:
    cmap = put_blob(store, data)
    async with rig(store, tmp_path / "cache", deadline=0.6) as r:
        fh = await r.open_blob(cmap.blob)
        assert await r.fs.read(fh, 0, 2 * CHUNK) == data[:2 * CHUNK]
        backend.fail = StoreUnavailable("store down (test)")
        assert await r.fs.read(fh, 0, 2 * CHUNK) == data[:2 * CHUNK]
        before = sum(backend.chunk_loads().values())
        with pytest.raises(pyfuse3.FUSEError) as ei:
            await r.fs.read(fh, 10 * CHUNK, 100)
        assert fuse_errno(ei) == errno.EIO
        assert sum(backend.chunk_loads().values()) - before >= 3  # retried with backoff
        assert r.stats.store_errors >= 3
        backend.fail = None
        assert await r.fs.read(fh, 10 * CHUNK, 100) == data[10 * CHUNK:10 * CHUNK + 100]


@pytest.mark.trio
async def test_demand_overtakes_queued_prefetch(store: Store, data: bytes, tmp_path: Path) -> None:
    cmap = put_blob(store, data)
    order: list[str] = []
    gate = threading.Event()
    first = threading.Event()

    class Gated(SingleChunkSource):
        def get_chunk(self, digest: str, max_length: int = 1 << 26) -> bytes:
            order.append(digest)
            if len(order) == 1:
                first.set()
                gate.wait(10)
            return store.get_chunk(digest)

        def get_chunk_map(self, blob: str) -> ChunkMap:
            return store.get_chunk_map(blob)

    async with rig(Gated(), tmp_path / "cache", concurrency=1) as r:  # type: ignore[arg-type]
        fh = await r.open_blob(cmap.blob)
        entry = r.cache.get(cmap.blob)
        assert entry is not None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(r.fetcher.prefetch, entry, [3, 4, 5, 6])
            await trio.to_thread.run_sync(first.wait, 10)
            got: list[bytes] = []

            async def demand() -> None:
                got.append(await r.read(fh, 1 * CHUNK, 100))

            nursery.start_soon(demand)
            await trio.sleep(0.05)  # let the demand read queue up behind the blocked prefetch
            gate.set()
        assert got == [data[CHUNK:CHUNK + 100]]
        digests = [cmap.chunks[i].digest for i in (3, 1, 4, 5, 6)]
        assert order == digests


@pytest.mark.trio
@pytest.mark.usefixtures("cache_format")
async def test_budget_eviction_lru_and_pins(store: Store, data: bytes, tmp_path: Path) -> None:
    cmap = put_blob(store, data, meta=(0,))
    budget = Budget(8 * CHUNK, 0.75, 0.5)
    async with rig(store, tmp_path / "cache", budget=budget) as r:
        fh = await r.open_blob(cmap.blob)
        for _ in range(2):
            assert await r.read_all(fh, len(data), CHUNK) == data
        entry = r.cache.get(cmap.blob)
        assert entry is not None
        with trio.fail_after(10):
            while r.cache.usage > budget.low:
                await trio.sleep(0.05)
        assert r.cache.evictor.evicted_chunks > 0
        # The metadata chunk of this open blob outlived data chunks that were used after it.
        assert entry.present[0]
        # A pinned chunk is never evicted.
        r.cache.pin(entry, [19])
        await r.fs.read(fh, 19 * CHUNK, 10)
        await r.cache.evictor.evict_to(0)
        assert entry.present[19] and r.cache.usage == r.cache.disk_bytes(entry, 19)  # (a zstd cache: its frame)
        r.cache.unpin(entry, [19])
        # Evicted ranges are holes again; the index agrees with memory.
        await r.cache.flush()
        assert os.pread(entry.fd, 100, 5 * CHUNK) == b"\0" * 100
        assert set(r.cache.index.committed_of(cmap.blob)) == {19}


@pytest.mark.trio
async def test_trace_records_first_access_order(store: Store, data: bytes, tmp_path: Path) -> None:
    cmap = put_blob(store, data, meta=(0,))
    trace = TraceRecorder()
    async with rig(store, tmp_path / "cache", trace=trace) as r:
        fh = await r.open_blob(cmap.blob)
        for off in (7 * CHUNK, 2 * CHUNK, 7 * CHUNK + 5, 0, 3 * CHUNK - 1):
            await r.fs.read(fh, off, 2)
    assert trace.to_json() == {"version": 1, "blobs": {cmap.blob: [7, 2, 0, 3]}}


@pytest.mark.trio
@pytest.mark.usefixtures("cache_format")
async def test_restart_keeps_cache_and_serves_without_store(store: Store, backend: CountingBackend, data: bytes,
                                                            tmp_path: Path) -> None:
    cmap = put_blob(store, data)
    async with rig(store, tmp_path / "cache") as r:
        fh = await r.open_blob(cmap.blob)
        assert await r.read_all(fh, len(data)) == data
    backend.fail = StoreUnavailable("down")
    async with rig(store, tmp_path / "cache", deadline=0.3) as r:
        fh = await r.open_blob(cmap.blob)  # the chunk map comes from the cache too
        # The clean close's verified seal vouches for the unchanged data file: every read is a hit,
        # nothing re-hashed, nothing fetched (after a crash the first reads re-hash: test_fuse_integrity).
        assert await r.read_all(fh, len(data)) == data
        assert r.stats.blobs[cmap.blob].fetched_bytes == 0
        assert r.stats.blobs[cmap.blob].misses == 0 and r.cache.verifier.verified_chunks == 0


@pytest.mark.usefixtures("cache_format")
def test_recovery_punches_uncommitted_and_drops_unbacked(store: Store, data: bytes, tmp_path: Path) -> None:
    """What a crash can leave behind: bytes without a record (killed between write and commit)
    and a record whose bytes are gone (e.g. lost on power failure): recovery fixes both."""
    cmap = put_blob(store, data)

    async def fill() -> None:
        async with rig(store, tmp_path / "cache") as r:
            fh = await r.open_blob(cmap.blob)
            await r.fs.read(fh, 0, 4 * CHUNK)  # chunks 0..3 committed

    trio.run(fill)
    from fuse_client.nodecache.files import BlobFiles, punch_hole

    files = BlobFiles(tmp_path / "cache")
    fd = os.open(files.path(cmap.blob), os.O_RDWR)
    try:
        os.pwrite(fd, b"junk" * 1000, 6 * CHUNK)  # uncommitted bytes
        punch_hole(fd, 2 * CHUNK, CHUNK)  # committed chunk 2 lost
    finally:
        os.close(fd)
    with contextlib.ExitStack() as stack:
        index = CacheIndex(tmp_path / "cache" / INDEX_DIR)
        stack.callback(index.close)
        cache = recover(tmp_path / "cache", files, index, cache_format=recorded_format(tmp_path / "cache"))
        stack.callback(cache.close)
        entry = cache.get(cmap.blob)
        assert entry is not None
        # Kept, but not servable until re-hashed (see test_fuse_integrity).
        assert entry.unverified_idxs() == [0, 1, 3] and not any(entry.present)
        assert set(index.committed_of(cmap.blob)) == {0, 1, 3}
        assert os.pread(entry.fd, 4000, 6 * CHUNK) == b"\0" * 4000
        assert cache.usage == sum(cache.disk_bytes(entry, i) for i in (0, 1, 3))  # (a zstd cache: the frames)


def test_prefetch_priority_constant_is_below_demand() -> None:
    from fuse_client.nodecache.limiter import DEMAND

    assert DEMAND < PREFETCH


@pytest.mark.trio
@pytest.mark.usefixtures("cache_format")
async def test_multi_chunk_read_fetches_in_parallel(store: Store, data: bytes, tmp_path: Path) -> None:
    cmap = put_blob(store, data)
    barrier = threading.Barrier(4, timeout=10)

    class AllAtOnce(SingleChunkSource):
        """Each chunk load waits until four loads are in flight: a serial fetcher would time out."""

        def get_chunk(self, digest: str, max_length: int = 1 << 26) -> bytes:
            barrier.wait()
            return store.get_chunk(digest)

        def get_chunk_map(self, blob: str) -> ChunkMap:
            return store.get_chunk_map(blob)

    async with rig(AllAtOnce(), tmp_path / "cache", concurrency=4) as r:  # type: ignore[arg-type]
        fh = await r.open_blob(cmap.blob)
        assert await r.fs.read(fh, 2 * CHUNK + 5, 4 * CHUNK - 10) == data[2 * CHUNK + 5:6 * CHUNK - 5]
        assert r.stats.blobs[cmap.blob].misses == 1


@pytest.mark.trio
async def test_a_long_stream_is_served_from_the_mapping_other_hits_by_pread(
        store: Store, data: bytes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(readermod, "MAP_STREAM_MIN", 3 * CHUNK)
    cmap = put_blob(store, data)
    async with rig(store, tmp_path / "cache") as r:
        fh = await r.open_blob(cmap.blob)
        assert await r.read_all(fh, len(data)) == data  # fetched (misses)
        entry = r.cache.get(cmap.blob)
        assert entry is not None
        entry.release_pages()
        got = await r.fs.read(fh, CHUNK - 10, CHUNK)  # not a stream: a pread's copy
        assert isinstance(got, bytes) and got == data[CHUNK - 10:2 * CHUNK - 10]
        assert not entry.mapped
        off = 2 * CHUNK - 10
        while off < 4 * CHUNK - 10:  # the stream grows to 3 chunks: still pread
            got = await r.fs.read(fh, off, CHUNK)
            assert isinstance(got, bytes) and got == data[off:off + CHUNK]
            off += CHUNK
        got = await r.fs.read(fh, off, 3 * CHUNK)  # continues 3 chunks: a view, no copy in the daemon
        assert isinstance(got, memoryview) and got.readonly
        assert got == data[off:off + 3 * CHUNK]
        del got
        assert entry.mapped
        entry.release_pages()  # what the release loop does every RELEASE_INTERVAL
        assert not entry.mapped
        off += 3 * CHUNK
        assert await r.read(fh, off, 100) == data[off:off + 100]  # faults back in
        assert entry.mapped
        await r.fs.release(fh)


@pytest.mark.trio
async def test_read_sync_refuses_a_closed_entry(store: Store, data: bytes, tmp_path: Path) -> None:
    """Metadata pushes read in worker threads that may outlive the cache at shutdown: after
    `close` they get EBADF, never a pread of a descriptor number the process reused."""
    cmap = put_blob(store, data)
    async with rig(store, tmp_path / "cache") as r:
        fh = await r.open_blob(cmap.blob)
        assert await r.read(fh, 0, 100) == data[:100]
        entry = r.cache.get(cmap.blob)
        assert entry is not None
        assert entry.read_sync(10, 30) == data[10:30]
        await r.fs.release(fh)
    assert entry.closed  # the rig closed the cache
    with pytest.raises(OSError) as ei:
        entry.read_sync(10, 30)
    assert ei.value.errno == errno.EBADF


@pytest.mark.trio
async def test_hits_fall_back_to_pread_when_the_file_cannot_be_mapped(
        store: Store, data: bytes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    import fuse_client.nodecache.entry as entrymod

    def no_map(*args: object, **kw: object) -> None:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(entrymod.mmap, "mmap", no_map)
    monkeypatch.setattr(readermod, "MAP_STREAM_MIN", 0)  # every hit tries the mapping
    cmap = put_blob(store, data)
    async with rig(store, tmp_path / "cache") as r:
        fh = await r.open_blob(cmap.blob)
        with caplog.at_level(logging.WARNING, logger="layerstore.fuse.cache"):
            assert await r.read_all(fh, len(data), 100_000) == data
            got = await r.fs.read(fh, 3, 2 * CHUNK)
        assert isinstance(got, bytes) and got == data[3:2 * CHUNK + 3]
        assert r.stats.blobs[cmap.blob].hits > 0
        assert sum("cannot map" in rec.getMessage() for rec in caplog.records) == 1  # said once
        await r.fs.release(fh)


@pytest.mark.slow  # about 3-5 s: kept out of `make check`'s 2 minutes
@pytest.mark.trio
async def test_sequential_reader_of_a_cold_blob_keeps_the_fetch_slots_busy(store: Store, data: bytes,
                                                                            tmp_path: Path) -> None:
    """The readahead window runs ahead of a sequential reader: while the reader waits for one
    chunk, the prefetch tokens' worth of the following chunks are being fetched."""
    cmap = put_blob(store, data)
    lock = threading.Lock()
    state = {"now": 0, "max": 0}
    release = threading.Event()

    class Slow(SingleChunkSource):
        """Loads wait until six are in flight at once (or a generous timeout), so the test
        sees how many the daemon keeps in flight; counts the peak."""

        def get_chunk(self, digest: str, max_length: int = 1 << 26) -> bytes:
            with lock:
                state["now"] += 1
                state["max"] = max(state["max"], state["now"])
                if state["now"] >= 6:
                    release.set()
            release.wait(2)
            try:
                return store.get_chunk(digest)
            finally:
                with lock:
                    state["now"] -= 1

        def get_chunk_map(self, blob: str) -> ChunkMap:
            return store.get_chunk_map(blob)

    async with rig(Slow(), tmp_path / "cache", concurrency=8) as r:  # type: ignore[arg-type]
        fh = await r.open_blob(cmap.blob)
        assert await r.read_all(fh, len(data), CHUNK) == data
        assert state["max"] >= 6  # 3/4 of 8 slots for readahead, plus the demand fetch
        assert r.stats.blobs[cmap.blob].fetched_bytes == len(data)  # each chunk once
        await r.fs.release(fh)


@pytest.mark.trio
async def test_interleaved_readers_of_one_blob_do_not_open_readahead_windows(store: Store, tmp_path: Path) -> None:
    """Sandboxes reading different small files of one image: their requests interleave on the
    blob, near but not contiguous; readahead must fetch nothing beyond what they read (issue 6:
    one stream per blob fetched twice the data). Then one sequential reader still gets it."""
    data = random.Random(3).randbytes(64 * CHUNK)
    cmap = put_blob(store, data)
    async with rig(store, tmp_path / "cache") as r:
        fh = await r.open_blob(cmap.blob)
        # Four readers, each reading one page of every fourth chunk, one chunk further each
        # round, so each read starts a little after where another reader's read ended.
        for k in range(0, 32, 4):
            for j in range(4):
                await r.read(fh, (k + j) * CHUNK + 8192 * j, 4096)
        await r.cache.flush()
        st = r.stats.blobs[cmap.blob]
        assert st.fetched_bytes == 32 * CHUNK and st.fetches == 32
        # A sequential reader of the rest: its window ramps up and runs ahead of it, once the
        # readers' burst of misses is over (during one, readahead waits: docs/node-cache.md,
        # "Fairness under a burst").
        await trio.sleep(r.fetcher.slots.linger + 0.1)
        for off in range(32 * CHUNK, 40 * CHUNK, 16384):
            assert await r.read(fh, off, 16384) == data[off:off + 16384]
        with trio.fail_after(10):
            while r.stats.blobs[cmap.blob].fetches < 32 + 8 + 8:
                await trio.sleep(0.01)
        assert r.stats.blobs[cmap.blob].misses < 32 + 8
