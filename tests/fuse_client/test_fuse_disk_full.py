"""One sandbox must not take the node down through the node cache: a default budget when none is
configured, and defined behaviour when the node's disk fills anyway (a small tmpfs as the cache
directory's filesystem, filled to the last block)."""

from __future__ import annotations

import contextlib
import errno
import os
import random
from collections.abc import Iterator
from pathlib import Path

import pyfuse3
import pytest
import trio

from fuse_client.daemon import DaemonConfig
from fuse_client.nodecache import Budget
from fuse_client.nodecache.eviction import DEFAULT_FS_FRACTION
from fuse_client.nodecache.files import BlobFiles
from fuse_client.nodecache.index import CacheIndex
from layerstore import linux
from layerstore.store import Store
from tests.fuse_client.test_fuse_handlers import CHUNK, put_blob, rig


@contextlib.contextmanager
def small_tmpfs(where: Path, size: str) -> Iterator[Path]:
    where.mkdir(parents=True, exist_ok=True)
    linux.mount("tmpfs", where, "tmpfs", options=f"size={size},mode=0700")
    try:
        yield where
    finally:
        linux.umount(where, lazy=True)


def fill_disk(path: Path) -> int:
    """Write `path` until the filesystem is full; returns the bytes written."""
    n = 0
    block = b"\xaa" * 65536
    with open(path, "wb", buffering=0) as f:
        with contextlib.suppress(OSError):
            while True:
                n += f.write(block)
        with contextlib.suppress(OSError):  # the last partial block
            while True:
                n += f.write(b"\xaa" * 512)
    return n


def test_the_default_budget_is_a_fraction_of_the_cache_filesystem(tmp_path: Path) -> None:
    cfg = DaemonConfig(cache_dir=tmp_path / "not" / "yet" / "cache", mountpoint=tmp_path / "mnt")
    budget = cfg.budget()
    fs = linux.fs_size(tmp_path)
    assert budget.size == int(fs * DEFAULT_FS_FRACTION) and "default" in budget.source
    assert budget.to_json()["source"] == budget.source
    assert DaemonConfig(cache_dir=tmp_path, mountpoint=tmp_path, cache_size=1 << 20).budget().size == 1 << 20


@pytest.mark.root
def test_a_full_disk_fails_cold_reads_keeps_cached_ones_the_index_and_eviction(store: Store, tmp_path: Path) -> None:
    rng = random.Random(5)
    cached = put_blob(store, rng.randbytes(40 * CHUNK))
    cold = put_blob(store, rng.randbytes(16 * CHUNK))
    with small_tmpfs(tmp_path / "disk", "6M") as disk:
        cache_dir = disk / "cache"

        async def go() -> None:
            # A budget larger than the disk: the disk fills first.
            async with rig(store, cache_dir, budget=Budget(64 << 20)) as r:
                fh = await r.open_blob(cached.blob)
                want = await r.read_all(fh, cached.size)
                cold_fh = await r.open_blob(cold.blob)  # its chunk map is in the index now
                await r.cache.flush()
                fill_disk(disk / "filler")
                usage = r.cache.usage
                # A cold read cannot be cached: EIO at once (no retry until the deadline), counted.
                with pytest.raises(pyfuse3.FUSEError) as ei:
                    await r.read(cold_fh, 3 * CHUNK, 100)
                assert ei.value.errno == errno.EIO
                assert r.stats.cache_write_failures >= 1 and r.cache.evictor.disk_full >= 1
                assert r.stats.to_json()["cache_write_failures"] == r.stats.cache_write_failures
                # What is cached is served (hits never wait, so the eviction the failure kicked
                # cannot run between these reads).
                entry = r.cache.get(cached.blob)
                assert entry is not None
                here = [i for i, p in enumerate(entry.present) if p]
                assert len(here) >= len(cached.chunks) // 2
                for i in here:
                    assert await r.read(fh, i * CHUNK, CHUNK) == want[i * CHUNK:(i + 1) * CHUNK]
                # The failure kicked an eviction, which frees blocks on the full disk.
                with trio.fail_after(30):
                    while r.cache.evictor.evicted_chunks == 0:
                        await trio.sleep(0.01)
                assert r.cache.usage < usage
                assert await r.read(cold_fh, 3 * CHUNK, 100) == cold_bytes[3 * CHUNK:3 * CHUNK + 100]
                left = {i for i, p in enumerate(entry.present) if p}
                await r.cache.flush()
                return left

        cold_bytes = b"".join(store.get_chunk(c.digest) for c in cold.chunks)
        left = trio.run(go)
        # Nothing committed was lost from the index on the way.
        index = CacheIndex(cache_dir / "index")
        try:
            assert set(index.committed_of(cached.blob)) == left
            assert index.get_map(cached.blob) is not None and index.get_map(cold.blob) is not None
        finally:
            index.close()
        assert BlobFiles(cache_dir).allocated_bytes(cached.blob) <= len(left) * CHUNK
        os.unlink(disk / "filler")
