"""The verified seal (fuse_client/nodecache/seal.py): after a clean close the next open serves the
chunks the closing process verified at once, on the inline hit path (no worker-thread hop, no
re-hash, no fetch), for every data file that nobody changed in between; a changed file, a crash
(no seal: the open removed it) or a malformed seal leave the re-hash rule of
docs/fuse-client.md ("What is verified when") as it was."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
import trio
from testkit.fuse_helpers import CountingBackend
from testkit.nodecache_formats import compressible

from fuse_client.nodecache.files import BlobFiles
from fuse_client.nodecache.seal import SEAL_NAME, runs_of
from layerstore.store import Store
from tests.fuse_client.test_fuse_handlers import CHUNK, put_blob, rig


def _fill(store: Store, cache_dir: Path, *blobs: tuple[str, int]) -> None:
    """Every blob read whole through the FUSE handlers, then a clean close."""
    async def go() -> None:
        async with rig(store, cache_dir) as r:
            for blob, size in blobs:
                await r.read_all(await r.open_blob(blob), size)

    trio.run(go)


@pytest.mark.usefixtures("cache_format")
def test_a_clean_close_lets_the_next_open_serve_unchanged_files_inline(
        store: Store, backend: CountingBackend, tmp_path: Path) -> None:
    a, b = compressible(31, 9 * CHUNK + 5), compressible(32, 7 * CHUNK + 9)
    ma, mb = put_blob(store, a), put_blob(store, b)
    cache_dir = tmp_path / "cache"
    _fill(store, cache_dir, (ma.blob, len(a)), (mb.blob, len(b)))
    assert (cache_dir / SEAL_NAME).is_file()
    # b's data file is written while no cache is open: its seal no longer holds
    fd = os.open(BlobFiles(cache_dir).path(mb.blob), os.O_RDWR)
    try:
        os.pwrite(fd, b"\xff\xff\xff\xff", 2 * CHUNK + 10)
    finally:
        os.close(fd)

    async def go() -> None:
        async with rig(store, cache_dir) as r:
            assert not (cache_dir / SEAL_NAME).exists()  # removed on open: a crash from here leaves none
            before = backend.chunk_loads()
            ea, eb = await r.lazy.entry(ma.blob), await r.lazy.entry(mb.blob)
            assert ea.complete() and not ea.unverified_idxs()
            assert not eb.complete() and eb.unverified_idxs() == list(range(len(mb.chunks)))
            reader = r.lazy.open_reader(ea)
            with contextlib.closing(reader):  # every read of the sealed blob is an inline hit
                got = [reader.read_cached(off, CHUNK) for off in range(0, len(a), CHUNK)]
                assert all(g is not None for g in got) and b"".join(bytes(g) for g in got if g is not None) == a
            assert r.cache.verifier.verified_chunks == 0  # nothing was re-hashed ...
            fh = await r.open_blob(mb.blob)
            assert await r.read_all(fh, len(b)) == b  # ... but the changed file's chunks, on their first read
            assert r.cache.verifier.verified_chunks == len(mb.chunks) - 1 and r.cache.corrupt_cached_chunks == 1
            assert sum((backend.chunk_loads() - before).values()) == 1  # only b's changed chunk was fetched

    trio.run(go)


@pytest.mark.usefixtures("cache_format")
def test_the_seal_is_gone_while_the_cache_is_open_so_a_crash_leaves_none(store: Store, tmp_path: Path) -> None:
    """A crash leaves what the open left: no seal, so the next open re-hashes every recorded chunk
    (tests/fuse_client/test_fuse_integrity.py starts from that state)."""
    data = compressible(33, 6 * CHUNK + 1)
    cmap = put_blob(store, data)
    cache_dir = tmp_path / "cache"
    _fill(store, cache_dir, (cmap.blob, len(data)))
    assert (cache_dir / SEAL_NAME).is_file()

    async def go() -> None:
        async with rig(store, cache_dir) as r:
            assert (await r.lazy.entry(cmap.blob)).complete()
            assert not (cache_dir / SEAL_NAME).exists()
        assert (cache_dir / SEAL_NAME).is_file()  # the clean close writes it again
        (cache_dir / SEAL_NAME).unlink()  # as a crash would have left it
        async with rig(store, cache_dir) as r:
            e = await r.lazy.entry(cmap.blob)
            assert not e.complete() and len(e.unverified_idxs()) == len(cmap.chunks)

    trio.run(go)


def test_a_malformed_or_foreign_seal_is_not_trusted(store: Store, tmp_path: Path) -> None:
    data = compressible(34, 5 * CHUNK + 3)
    cmap = put_blob(store, data)
    cache_dir = tmp_path / "cache"
    for seal_text in (b"{not json", b'{"version": 1, "blobs": {"%s": {"file": [1, 2, 3, 4, 5, 6], "map": "00", '
                                    b'"runs": [[0, 5]]}}}' % cmap.blob.encode()):
        _fill(store, cache_dir, (cmap.blob, len(data)))
        (cache_dir / SEAL_NAME).write_bytes(seal_text)

        async def go() -> None:
            async with rig(store, cache_dir) as r:
                e = await r.lazy.entry(cmap.blob)
                assert not e.complete() and len(e.unverified_idxs()) == len(cmap.chunks)
                assert not (cache_dir / SEAL_NAME).exists()

        trio.run(go)


def test_runs_of() -> None:
    assert runs_of(bytearray(b"\x01\x01\x00\x01\x00\x00\x01")) == ((0, 2), (3, 4), (6, 7))
    assert runs_of(bytearray(3)) == ()
