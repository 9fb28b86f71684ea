"""A verified chunk is not trusted forever: after a restart (a crash, or someone writing to the
cache files meanwhile) the node cache keeps its committed chunks *unverified* and serves none of
them before re-hashing it. Each test corrupts cached bytes while no cache is open (between two
opens of the same directory), as a hostile or failing node disk would."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from pathlib import Path

import pyfuse3
import pytest
import trio
from testkit.fuse_helpers import CountingBackend
from testkit.nodecache_formats import compressible

from fuse_client.nodecache import BlobIncomplete
from fuse_client.nodecache.files import BlobFiles
from fuse_client.nodecache.maintenance import ls, pin_offline, verify
from fuse_client.nodecache.seal import SEAL_NAME
from layerstore import digest as digestmod
from layerstore.errors import StoreUnavailable
from layerstore.store import Store
from tests.fuse_client.test_fuse_handlers import CHUNK, put_blob, rig


@pytest.fixture
def data() -> bytes:
    return compressible(12, 12 * CHUNK + 777)


def _fill(store: Store, cache_dir: Path, blob: str, size: int, *, pin: str | None = None) -> None:
    """The whole blob read into the cache, then the cache left as a crash leaves it (no verified
    seal: `_crashed`)."""
    async def go() -> None:
        async with rig(store, cache_dir) as r:
            fh = await r.open_blob(blob)
            await r.read_all(fh, size)
            if pin:
                await r.cache.pins.pin_blob(blob, pin)

    trio.run(go)
    _crashed(cache_dir)


def _crashed(cache_dir: Path) -> None:
    """What a crash leaves: no verified seal (a clean close writes one, the next open removes it)."""
    (cache_dir / SEAL_NAME).unlink(missing_ok=True)


def _corrupt(cache_dir: Path, blob: str, offset: int) -> None:
    """Flip bytes of the data file while no cache is open (what recovery cannot see)."""
    fd = os.open(BlobFiles(cache_dir).path(blob), os.O_RDWR)
    try:
        old = os.pread(fd, 4, offset)
        os.pwrite(fd, bytes(b ^ 0xFF for b in old), offset)
    finally:
        os.close(fd)


@pytest.mark.usefixtures("cache_format")
def test_a_chunk_corrupted_on_disk_is_refetched_after_a_restart_never_served(
        store: Store, backend: CountingBackend, data: bytes, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cmap = put_blob(store, data)
    cache_dir = tmp_path / "cache"
    _fill(store, cache_dir, cmap.blob, len(data))
    _corrupt(cache_dir, cmap.blob, 3 * CHUNK + 100)

    async def go() -> None:
        async with rig(store, cache_dir) as r:
            before = backend.chunk_loads()
            fh = await r.open_blob(cmap.blob)
            with caplog.at_level(logging.ERROR, "layerstore.fuse.cache"):
                assert await r.read(fh, 3 * CHUNK, 2 * CHUNK) == data[3 * CHUNK:5 * CHUNK]
            # Chunk 3 failed its re-hash: dropped, counted, logged, fetched from the store; chunk 4
            # matched and was served without a fetch.
            fetched = backend.chunk_loads() - before
            assert sum(fetched.values()) == 1 and digestmod.hex_of(cmap.chunks[3].digest) in "".join(fetched)
            assert r.cache.corrupt_cached_chunks == 1 and r.cache.verifier.verified_chunks == 1
            assert "do not match the digest" in caplog.text
            assert await r.read_all(fh, len(data)) == data
            assert r.stats.blobs[cmap.blob].fetched_bytes == CHUNK
            entry = r.cache.get(cmap.blob)
            assert entry is not None and entry.held_bytes() == len(data)
            # (usage counts what the chunks occupy on disk: a zstd cache's frames)
            assert r.cache.ls()["unverified_bytes"] == 0 and r.cache.usage == r.cache.held_disk_bytes(entry)

    trio.run(go)


@pytest.mark.usefixtures("cache_format")
def test_a_corrupted_chunk_with_the_store_down_is_eio(store: Store, backend: CountingBackend, data: bytes,
                                                      tmp_path: Path) -> None:
    cmap = put_blob(store, data)
    cache_dir = tmp_path / "cache"
    _fill(store, cache_dir, cmap.blob, len(data))
    _corrupt(cache_dir, cmap.blob, 6 * CHUNK)
    backend.fail = StoreUnavailable("down")

    async def go() -> None:
        async with rig(store, cache_dir, deadline=0.3) as r:
            fh = await r.open_blob(cmap.blob)
            assert await r.read(fh, 5 * CHUNK, CHUNK) == data[5 * CHUNK:6 * CHUNK]  # a good one: served
            with pytest.raises(pyfuse3.FUSEError) as ei:
                await r.read(fh, 6 * CHUNK, 10)
            assert ei.value.errno == errno.EIO
            entry = r.cache.get(cmap.blob)
            assert entry is not None and not entry.present[6] and not entry.unverified[6]

    trio.run(go)


def test_a_pin_after_a_restart_rehashes_and_repairs_or_refuses(store: Store, data: bytes, tmp_path: Path) -> None:
    cmap = put_blob(store, data)
    cache_dir = tmp_path / "cache"
    _fill(store, cache_dir, cmap.blob, len(data))
    _corrupt(cache_dir, cmap.blob, 2 * CHUNK + 9)
    # Offline (no store): the pin re-hashes every recovered chunk and refuses the damaged blob.
    assert pin_offline(cache_dir, cmap.blob, "shim:a") is None
    assert ls(cache_dir)["pins"] == [] and ls(cache_dir)["corrupt_cached_chunks"] == 0  # counters are per open
    _corrupt(cache_dir, cmap.blob, 7 * CHUNK + 1)

    async def go() -> None:
        # Online: the pin repairs a bad chunk (7) from the store before recording anything; chunk 2,
        # dropped by the offline pin, is missing, so the blob must be fetched whole first (as ever).
        async with rig(store, cache_dir) as r:
            with pytest.raises(BlobIncomplete) as ei:
                await r.lazy.pin_blob(cmap.blob, "shim:a")
            assert ei.value.missing_bytes == CHUNK
            assert r.cache.corrupt_cached_chunks == 1 and r.cache.pins.holders(cmap.blob) == []
            await r.lazy.prefetch(cmap.blob, all_chunks=True, wait=True)
            path = await r.lazy.pin_blob(cmap.blob, "shim:a")
            assert path.read_bytes() == data
            assert r.stats.blobs[cmap.blob].fetched_bytes == 2 * CHUNK  # chunks 7 and 2

    trio.run(go)


def test_a_pinned_blob_is_reverified_and_repaired_after_a_restart(store: Store, data: bytes, tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """Its file may be mounted directly (no FUSE hop verifies those reads): the daemon re-hashes
    it in the background at start, logs loudly and rewrites the verified bytes in place."""
    cmap = put_blob(store, data)
    cache_dir = tmp_path / "cache"
    _fill(store, cache_dir, cmap.blob, len(data), pin="shim:a")
    _corrupt(cache_dir, cmap.blob, 9 * CHUNK + 50)
    path = BlobFiles(cache_dir).path(cmap.blob)
    assert path.read_bytes() != data

    async def go() -> None:
        async with rig(store, cache_dir) as r:
            with caplog.at_level(logging.ERROR):
                await r.lazy.verify_pinned()
            assert "changed on disk since they were verified" in caplog.text
            assert r.cache.corrupt_cached_chunks == 1 and r.cache.verifier.verified_chunks == len(cmap.chunks) - 1
            assert path.read_bytes() == data
            assert r.cache.pins.holders(cmap.blob) == ["shim:a"]

    trio.run(go)


@pytest.mark.usefixtures("cache_format")
def test_recovered_chunks_count_in_usage_ls_eviction_and_verify(store: Store, data: bytes, tmp_path: Path) -> None:
    cmap = put_blob(store, data)
    cache_dir = tmp_path / "cache"
    _fill(store, cache_dir, cmap.blob, len(data))
    res = ls(cache_dir)
    blob = res["blobs"][0]
    # usage counts what the chunks occupy on disk (a zstd cache: their frames, about half here)
    assert res["used_bytes"] == blob["stored_bytes"] and res["unverified_bytes"] == len(data)
    assert blob["stored_bytes"] == len(data) if res["format"] == "plain" else blob["stored_bytes"] < 0.7 * len(data)
    assert blob["complete"] and blob["cached_chunks"] == 0 and blob["unverified_chunks"] == len(cmap.chunks)
    _corrupt(cache_dir, cmap.blob, 0)
    res = verify(cache_dir)
    assert res["checked"] == len(cmap.chunks)
    assert [(b["blob"], b["chunk"]) for b in res["bad"]] == [(cmap.blob, 0)]
    _crashed(cache_dir)
    res = ls(cache_dir)
    used = res["used_bytes"]
    assert res["unverified_bytes"] == len(data) - CHUNK  # (a new open after a crash: unverified again)
    _crashed(cache_dir)
    assert used == res["blobs"][0]["stored_bytes"] < blob["stored_bytes"]

    async def go() -> None:
        async with rig(store, cache_dir) as r:  # unverified again after this reopen (after a crash)
            assert r.cache.usage == used
            n, b = await r.cache.evictor.evict_to(0)
            assert (n, b) == (len(cmap.chunks) - 1, used)
            assert r.cache.usage == 0 and r.cache.ls()["unverified_bytes"] == 0
        # The partial block of the last chunk (ext4 may keep two blocks there after a small frame's write).
        assert BlobFiles(cache_dir).allocated_bytes(cmap.blob) <= 8192

    trio.run(go)


@pytest.mark.usefixtures("cache_format")
def test_the_read_hot_path_tests_presence_only(store: Store, data: bytes, tmp_path: Path) -> None:
    """Unverified chunks are not present: `read_cached` says "missing" for them (no extra test
    on the hot path), and `read_missing` verifies."""
    cmap = put_blob(store, data)
    cache_dir = tmp_path / "cache"
    _fill(store, cache_dir, cmap.blob, len(data))

    async def go() -> None:
        async with rig(store, cache_dir) as r:
            entry = await r.lazy.entry(cmap.blob)
            reader = r.lazy.open_reader(entry)
            with contextlib.closing(reader):
                assert reader.read_cached(0, 100) is None
                assert bytes(await reader.read_missing(0, 100)) == data[:100]
                assert bytes(reader.read_cached(0, 100) or b"") == data[:100]

    trio.run(go)
