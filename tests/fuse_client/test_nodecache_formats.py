"""The node cache's two formats (`fuse_client.nodecache.frames`): a zstd cache keeps the store's
verified frames (raw where a frame would not be smaller), checks what it decompresses before
serving it, recovers after kill -9, refuses direct mounts and the fanotify path, and a cache
directory keeps the format it was created with."""

from __future__ import annotations

import errno
import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import trio
import zstandard
from testkit.fuse_helpers import CountingBackend
from testkit.nodecache_formats import compressible

from fuse_client.daemon import choose_data_path
from fuse_client.nodecache import NoPlainImage, frames
from fuse_client.nodecache.cachedir import FORMAT_ENV, FORMAT_FILE, LRU_ENV, cache_format, recorded_format
from fuse_client.nodecache.files import BlobFiles
from fuse_client.nodecache.maintenance import ls, pin_offline, verify
from fuse_client.nodecache.seal import SEAL_NAME
from layerstore import chunkobj
from layerstore import digest as digestmod
from layerstore.chunkmap import ChunkMap, ChunkRef
from layerstore.errors import ConfigError, CorruptObject
from layerstore.store import Store
from tests.fuse_client.test_fuse_handlers import CHUNK, put_blob, rig

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def zstd(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FORMAT_ENV, "zstd")


@pytest.mark.usefixtures("zstd")
def test_a_zstd_cache_keeps_the_fetched_frames_and_serves_the_plain_bytes(store: Store, tmp_path: Path) -> None:
    data = compressible(1, 16 * CHUNK + 99)
    cmap = put_blob(store, data)

    async def go() -> None:
        async with rig(store, tmp_path / "cache") as r:
            fh = await r.open_blob(cmap.blob)
            assert await r.read_all(fh, len(data), 16 * 1024) == data  # several requests per chunk
            lru = r.cache.lru
            assert lru is not None and lru.hits > lru.misses > 0  # a chunk decompressed once per 4 reads
            assert await r.read(fh, CHUNK - 7, 20) == data[CHUNK - 7:CHUNK + 13]  # across two chunks
            await r.cache.flush()
            stored = r.cache.index.stored_lengths()[cmap.blob]
            assert sorted(stored) == list(range(len(cmap.chunks)))
            assert all(0 < n < cmap.chunks[i].length for i, n in stored.items() if i < len(stored) - 1)
            assert stored[len(stored) - 1] == 99  # 99 random bytes: the store keeps them raw, so does the cache
            assert r.cache.ls()["format"] == "zstd"

    trio.run(go)
    disk = BlobFiles(tmp_path / "cache").allocated_bytes(cmap.blob)
    assert disk < 0.7 * len(data)  # the compressed bytes, not the blob
    assert recorded_format(tmp_path / "cache") == "zstd"
    assert verify(tmp_path / "cache")["bad"] == []


@pytest.mark.usefixtures("zstd")
def test_a_frame_not_smaller_than_its_chunk_is_stored_raw(store: Store, tmp_path: Path) -> None:
    noise = random.Random(2).randbytes(CHUNK)
    frame = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(noise)
    assert len(frame) > len(noise)  # what another encoder may store: valid, larger than the chunk
    big = digestmod.of(noise)
    store.put_chunk_object(big, chunkobj.HEADER.pack(chunkobj.MAGIC, chunkobj.VERSION, chunkobj.COMP_ZSTD, 0,
                                                     len(noise)) + frame, len(noise), verify=True)
    small = compressible(3, CHUNK)
    small_digest, _ = store.put_chunk(small)
    cmap = ChunkMap.build([ChunkRef(0, CHUNK, big), ChunkRef(CHUNK, CHUNK, small_digest)])
    store.put_chunk_map(cmap)
    data = noise + small

    async def fill() -> None:
        async with rig(store, tmp_path / "cache") as r:
            fh = await r.open_blob(cmap.blob)
            assert await r.read_all(fh, len(data)) == data
            await r.cache.flush()
            stored = r.cache.index.stored_lengths()[cmap.blob]
            assert stored[0] == CHUNK  # raw
            assert stored[1] < CHUNK  # the store's frame

    async def again() -> None:  # recovered after a crash (no verified seal), re-hashed (raw and frame), served
        (tmp_path / "cache" / SEAL_NAME).unlink()
        async with rig(store, tmp_path / "cache") as r:
            fh = await r.open_blob(cmap.blob)
            assert await r.read_all(fh, len(data)) == data
            assert r.stats.blobs[cmap.blob].fetched_bytes == 0 and r.cache.verifier.verified_chunks == 2

    trio.run(fill)
    trio.run(again)


def test_a_corrupted_stored_frame_is_detected_on_read_and_refetched(
        store: Store, backend: CountingBackend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(FORMAT_ENV, "zstd")
    monkeypatch.setenv(LRU_ENV, "0")  # every read decompresses what is on disk
    data = compressible(4, 6 * CHUNK)
    cmap = put_blob(store, data)
    victim = cmap.chunks[3]

    async def go() -> None:
        async with rig(store, tmp_path / "cache") as r:
            fh = await r.open_blob(cmap.blob)
            assert await r.read_all(fh, len(data)) == data
            entry = r.cache.get(cmap.blob)
            assert entry is not None
            # The disk changes under a running daemon (a plain cache would serve these bytes).
            old = os.pread(entry.fd, 8, victim.offset + 40)
            os.pwrite(entry.fd, bytes(b ^ 0x5A for b in old), victim.offset + 40)
            with caplog.at_level(logging.ERROR):
                assert await r.read(fh, victim.offset + 100, 1000) == data[victim.offset + 100:victim.offset + 1100]
            assert r.cache.corrupt_cached_chunks == 1
            assert any("chunk 3" in m and "do not match" in m for m in caplog.messages), caplog.messages
            assert backend.chunk_loads()[store.chunk_key(victim.digest)] == 2  # fetched again
            assert await r.read_all(fh, len(data)) == data
            await r.cache.flush()
            assert 3 in r.cache.index.committed_of(cmap.blob)

    trio.run(go)
    assert verify(tmp_path / "cache")["bad"] == []


_CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import trio
    from layerstore.backends.posix import PosixBackend
    from layerstore.store import Store
    from tests.fuse_client.test_fuse_handlers import CHUNK, rig

    store_dir, cache_dir, blob, size = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    store = Store(PosixBackend(store_dir, fsync=False))
    real = store.get_chunk_frame

    def slow(digest, *more):
        time.sleep(0.08)  # the whole blob takes > 3 s at 4 fetches at a time: the kill comes mid-fill
        return real(digest, *more)

    store.get_chunk_frame = slow

    async def main():
        async with rig(store, cache_dir, concurrency=4) as r:
            fh = await r.open_blob(blob)
            for n, off in enumerate(range(0, size, CHUNK)):
                await r.read(fh, off, CHUNK)
                if n == 12:
                    print("ready", flush=True)

    trio.run(main)
""")


@pytest.mark.slow  # about 3-5 s: kept out of `make check`'s 2 minutes
@pytest.mark.usefixtures("zstd")
def test_kill_9_while_a_zstd_cache_is_filled_recovers(store: Store, backend: CountingBackend, tmp_path: Path) -> None:
    data = compressible(5, 160 * CHUNK)
    cmap = put_blob(store, data)
    cache_dir = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests' / 'support'}"}
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(backend.inner.root), str(cache_dir),  # type: ignore[attr-defined]
                              cmap.blob, str(len(data))], stdout=subprocess.PIPE, env=env, cwd=REPO)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == b"ready"
        trio.run(trio.sleep, 1.5)  # a journal batch committed (JOURNAL_GATHER), others in flight
        os.kill(child.pid, signal.SIGKILL)
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
        child.wait()
        if child.stdout is not None:
            child.stdout.close()
    res = ls(cache_dir)
    assert res["format"] == "zstd" and 0 < res["unverified_bytes"] < len(data)
    assert verify(cache_dir)["bad"] == []  # every recorded chunk's frame decodes to its digest
    loads = sum(backend.chunk_loads().values())

    async def go() -> None:
        async with rig(store, cache_dir) as r:
            fh = await r.open_blob(cmap.blob)
            assert await r.read_all(fh, len(data)) == data
            fetched = r.stats.blobs[cmap.blob].fetched_bytes
            assert 0 < fetched < len(data)  # what was committed before the kill is not fetched again
            # (`verify` re-hashed every recorded chunk and closed cleanly: its verified seal vouches for them)
            assert r.cache.verifier.verified_chunks == 0 and fetched + r.cache.ls()["blobs"][0]["cached_bytes"] > 0

    trio.run(go)
    assert sum(backend.chunk_loads().values()) > loads


@pytest.mark.usefixtures("zstd")
def test_a_zstd_cache_has_no_direct_mounts(store: Store, tmp_path: Path) -> None:
    """Pins (direct EROFS mounts of a complete blob's data file) need the plain image: a zstd cache
    refuses them (`NoPlainImage`, which the runtime shim takes as "mount the daemon's file") and
    records nothing."""
    data = compressible(6, 4 * CHUNK)
    cmap = put_blob(store, data)

    async def go() -> None:
        async with rig(store, tmp_path / "cache") as r:
            fh = await r.open_blob(cmap.blob)
            assert await r.read_all(fh, len(data)) == data
            with pytest.raises(NoPlainImage, match="compressed"):
                await r.lazy.pin_blob(cmap.blob, "shim:test")
            assert r.cache.pins.holders(cmap.blob) == []

    trio.run(go)
    with pytest.raises(NoPlainImage):
        pin_offline(tmp_path / "cache", cmap.blob, "shim:test")
    res = ls(tmp_path / "cache")
    assert res["pins"] == [] and res["blobs"][0]["complete"]


def test_the_fanotify_data_path_refuses_a_zstd_cache(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert choose_data_path(tmp_path, "fanotify", "zstd") == "fuse"
        assert choose_data_path(tmp_path, "auto", "zstd") == "fuse"
    assert any("compressed" in m and "fanotify" in m for m in caplog.messages), caplog.messages
    assert choose_data_path(tmp_path, "fuse", "zstd") == "fuse"


def test_a_cache_directory_keeps_its_format(store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            caplog: pytest.LogCaptureFixture) -> None:
    import contextlib

    from fuse_client.nodecache import open_cache

    plain, packed, old = tmp_path / "plain", tmp_path / "zstd", tmp_path / "old"
    assert cache_format(plain) == "plain" and cache_format(plain, "zstd") == "zstd"  # nothing created yet
    with contextlib.ExitStack() as stack:
        assert open_cache(plain, None, stack).format == "plain"
    with contextlib.ExitStack() as stack:
        assert open_cache(packed, None, stack, cache_format="zstd").format == "zstd"
    monkeypatch.setenv(FORMAT_ENV, "zstd")
    with caplog.at_level(logging.WARNING), contextlib.ExitStack() as stack:
        assert open_cache(plain, None, stack, cache_format="zstd").format == "plain"  # an existing plain stays plain
        assert open_cache(packed, None, stack.enter_context(contextlib.ExitStack()),
                          cache_format="plain").format == "zstd"
    assert sum("keeps its format" in m for m in caplog.messages) == 2
    assert (plain / FORMAT_FILE).read_text().strip() == "plain" and cache_format(plain, "zstd") == "plain"
    assert (packed / FORMAT_FILE).read_text().strip() == "zstd"
    # A cache made before formats were recorded (an index, no format file) is plain, and says so from now on.
    with contextlib.ExitStack() as stack:
        open_cache(old, None, stack, cache_format="plain")
    (old / FORMAT_FILE).unlink()
    with contextlib.ExitStack() as stack:
        assert open_cache(old, None, stack).format == "plain"
    assert (old / FORMAT_FILE).read_text().strip() == "plain"
    (old / FORMAT_FILE).write_text("lz4\n")
    with pytest.raises(CorruptObject, match="unknown format"), contextlib.ExitStack() as stack:
        open_cache(old, None, stack)
    with pytest.raises(ConfigError, match="expected plain or zstd"), contextlib.ExitStack() as stack:
        open_cache(tmp_path / "new", None, stack, cache_format="gzip")


def test_a_stored_frame_is_checked_before_and_after_it_is_decompressed() -> None:
    """Hostile stored bytes: a frame declaring another size (a decompression bomb included) is
    refused before it is decompressed; a truncated or garbled one, or one that decompresses to
    other bytes, is `StoredChunkCorrupt` (EIO); raw bytes are hashed too."""
    data = compressible(8, CHUNK)
    ref = ChunkRef(0, CHUNK, digestmod.of(data))
    frame = zstandard.ZstdCompressor(write_content_size=True).compress(data)
    assert frames.decode(frame, ref, "b", 0) == data and frames.decode(data, ref, "b", 0) == data
    bomb = zstandard.ZstdCompressor(write_content_size=True).compress(bytes(64 << 20))
    other = zstandard.ZstdCompressor(write_content_size=True).compress(compressible(9, CHUNK))
    flipped = bytearray(frame)
    flipped[len(frame) // 2] ^= 0x10
    for bad in (bomb, frame[:-3], frame[:5], other, bytes(flipped), b"x" * 100, bytes(CHUNK)):
        with pytest.raises(frames.StoredChunkCorrupt) as ei:
            frames.decode(bad, ref, "b", 0)
        assert ei.value.errno == errno.EIO


def test_the_lru_of_decompressed_chunks_is_bounded() -> None:
    lru = frames.ChunkLRU(3 * CHUNK)
    for i in range(5):
        lru.put(("b", i), bytes(CHUNK))
    assert len(lru) == 3 and lru.size == 3 * CHUNK and lru.get(("b", 0)) is None
    assert lru.get(("b", 2)) is not None
    lru.put(("b", 5), bytes(CHUNK))  # drops the least recently used: 3, not 2
    assert lru.get(("b", 3)) is None and lru.get(("b", 2)) is not None
    lru.put(("b", 6), bytes(4 * CHUNK))  # larger than the whole LRU: not kept
    assert lru.get(("b", 6)) is None and lru.size <= 3 * CHUNK
    assert frames.ChunkLRU(0).limit == 0
