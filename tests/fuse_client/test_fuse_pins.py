"""Pins: a complete blob's cache data file mounted directly (no FUSE hop). Without a kernel: the
cache's pin protocol (complete only, durable, never modified by eviction, verify or recovery),
the control routes and the blocking client (through a daemon's socket and offline). With a
kernel: EROFS mounted on the pinned file outlives the daemon and its eviction."""

from __future__ import annotations

import contextlib
import logging
import os
import random
from pathlib import Path

import httpx
import pytest
import trio
from testkit.cli_helpers import assert_clean_failure, layerctl
from testkit.erofs_helpers import assert_trees_equal, mounted_erofs, snapshot_tree
from testkit.fuse_helpers import DaemonProcess, build_and_push, make_tree

from fuse_client import control
from fuse_client.control import socket_path
from fuse_client.control.server import ControlAPI, ControlServer
from fuse_client.nodecache import INDEX_DIR, BlobIncomplete, BlobPinned, Budget
from fuse_client.nodecache.files import BlobFiles
from fuse_client.nodecache.index import CacheIndex, DelChunk
from fuse_client.nodecache.maintenance import pin_offline, unpin_offline
from fuse_client.nodecache.recovery import recover
from fuse_client.nodecache.seal import SEAL_NAME
from layerstore.errors import BadInput
from layerstore.store import Store
from tests.fuse_client.test_fuse_handlers import CHUNK, put_blob, rig


@pytest.fixture
def store(tmp_path: Path) -> Store:
    s = Store.open(str(tmp_path / "store"))
    s.init()
    return s


@pytest.fixture
def data() -> bytes:
    return random.Random(11).randbytes(20 * CHUNK + 1234)


async def _fill(r, blob: str, size: int) -> int:  # type: ignore[no-untyped-def]
    fh = await r.open_blob(blob)
    await r.read_all(fh, size)
    return fh


@pytest.mark.trio
async def test_pin_only_complete_blobs_and_it_is_durable(store: Store, data: bytes, tmp_path: Path) -> None:
    cmap = put_blob(store, data, meta=(0,))
    cache_dir = tmp_path / "cache"
    async with rig(store, cache_dir) as r:
        with pytest.raises(BlobIncomplete) as ei:
            await r.cache.pins.pin_blob(cmap.blob, "shim:a")  # not even its map is here
        assert ei.value.missing_bytes is None
        fh = await r.open_blob(cmap.blob)
        await r.fs.read(fh, 3 * CHUNK, 10)
        with pytest.raises(BlobIncomplete) as ei:
            await r.cache.pins.pin_blob(cmap.blob, "shim:a")
        assert ei.value.missing_bytes == len(data) - 2 * CHUNK  # chunk 0 (metadata) and 3 are here
        assert r.cache.holds.pinned == {} and r.cache.index.pins() == {}
        await r.read_all(fh, len(data))
        path = await r.cache.pins.pin_blob(cmap.blob, "shim:a")
        # Committed on return: the pin and every chunk record (the data synced before them).
        assert path.is_absolute() and path.read_bytes() == data
        assert set(r.cache.index.pins()[cmap.blob]) == {"shim:a"}
        assert len(r.cache.index.committed_of(cmap.blob)) == len(cmap.chunks)
        assert await r.cache.pins.pin_blob(cmap.blob, "shim:a") == path  # idempotent
        await r.cache.pins.pin_blob(cmap.blob, "shim:b")
        ls = r.cache.ls()
        assert [(p["blob"], p["holder"]) for p in ls["pins"]] == [(cmap.blob, "shim:a"), (cmap.blob, "shim:b")]
        assert ls["pins"][0]["path"] == str(path)
        assert ls["blobs"][0]["complete"] and ls["blobs"][0]["pinned_by"] == ["shim:a", "shim:b"]
        assert ls["pinned_bytes"] == len(data)
        with pytest.raises(BadInput):
            await r.cache.pins.pin_blob(cmap.blob, "")
        assert await r.cache.pins.unpin_blob(cmap.blob, "shim:b")
        assert not await r.cache.pins.unpin_blob(cmap.blob, "shim:b")  # idempotent
    # A restart (the same as after kill -9: nothing but the index is read) keeps the pin.
    async with rig(store, cache_dir) as r:
        assert set(r.cache.holds.pinned) == {cmap.blob} and set(r.cache.holds.pinned[cmap.blob]) == {"shim:a"}
        with pytest.raises(BlobPinned, match="shim:a"):
            await r.cache.evictor.drop_blob(cmap.blob)


@pytest.mark.trio
async def test_eviction_skips_pinned_blobs_and_says_so(store: Store, data: bytes, tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    pinned = put_blob(store, data)
    other = put_blob(store, data[::-1])
    budget = Budget(len(data) + 4 * CHUNK, 0.9, 0.8)
    async with rig(store, tmp_path / "cache", budget=budget) as r:
        await _fill(r, pinned.blob, len(data))
        path = await r.cache.pins.pin_blob(pinned.blob, "h")
        disk = os.stat(path).st_blocks
        with caplog.at_level(logging.WARNING, logger="layerstore.fuse.cache"):
            await _fill(r, other.blob, len(data))  # over budget: only `other` can give way
            with trio.fail_after(10):
                while r.cache.evictor.evicted_chunks == 0 or r.cache.evictor.episode:
                    await trio.sleep(0.05)
            await r.cache.evictor.evict_to(0)
        assert "pinned blob" in caplog.text
        e = r.cache.get(pinned.blob)
        assert e is not None and all(e.present) and os.stat(path).st_blocks == disk
        assert path.read_bytes() == data
        assert r.cache.usage == len(data)  # the pinned bytes still count against the budget
        assert not any(r.cache.get(other.blob).present)  # type: ignore[union-attr]
        with pytest.raises(BlobPinned):
            await r.cache.evictor.evict(blob=pinned.blob)
        res = await r.cache.evictor.evict(all_chunks=True)
        assert res["pinned_bytes"] == len(data) and res["used_bytes"] == len(data)
        # Unpinned, it is an ordinary blob again.
        await r.cache.pins.unpin_blob(pinned.blob, "h")
        assert await r.cache.evictor.drop_blob(pinned.blob) == (len(pinned.chunks), len(data))


@pytest.mark.trio
async def test_verify_reports_a_bad_chunk_of_a_pinned_blob_without_punching(store: Store, data: bytes,
                                                                           tmp_path: Path) -> None:
    cmap = put_blob(store, data)
    async with rig(store, tmp_path / "cache") as r:
        fh = await _fill(r, cmap.blob, len(data))
        path = await r.cache.pins.pin_blob(cmap.blob, "h")
        with open(path, "r+b") as f:
            f.seek(5 * CHUNK + 3)
            f.write(b"\xff\xfe")
        res = await r.cache.verifier.verify()
        assert res["bad"] == [{"blob": cmap.blob, "chunk": 5, "digest": cmap.chunks[5].digest, "pinned": True}]
        # Not punched: the damaged bytes are still there, but no longer recorded nor served.
        assert os.pread(r.cache.get(cmap.blob).fd, 2, 5 * CHUNK + 3) == b"\xff\xfe"  # type: ignore[union-attr]
        assert 5 not in r.cache.index.committed_of(cmap.blob)
        # A FUSE read fetches the chunk again and rewrites the verified bytes in place.
        assert await r.read(fh, 5 * CHUNK, CHUNK) == data[5 * CHUNK:6 * CHUNK]
        assert path.read_bytes() == data
        assert (await r.cache.verifier.verify())["bad"] == []


def test_recovery_never_punches_a_pinned_blob(store: Store, data: bytes, tmp_path: Path) -> None:
    cmap = put_blob(store, data)
    cache_dir = tmp_path / "cache"

    async def fill() -> None:
        async with rig(store, cache_dir) as r:
            await _fill(r, cmap.blob, len(data))
            await r.cache.pins.pin_blob(cmap.blob, "h")

    trio.run(fill)
    (cache_dir / SEAL_NAME).unlink()  # a crash: no verified seal
    index = CacheIndex(cache_dir / INDEX_DIR)
    index.apply([DelChunk(cmap.blob, 2)])  # as if the record had been lost: its bytes are unrecorded
    files = BlobFiles(cache_dir)
    with contextlib.ExitStack() as stack:
        stack.callback(index.close)
        cache = recover(cache_dir, files, index)
        stack.callback(cache.close)
        entry = cache.get(cmap.blob)
        assert entry is not None and not entry.present[2] and not entry.unverified[2]
        assert len(entry.unverified_idxs()) == len(cmap.chunks) - 1
        assert files.path(cmap.blob).read_bytes() == data  # not punched
        assert set(cache.holds.pinned) == {cmap.blob}


@pytest.mark.root
@pytest.mark.trio
async def test_pin_routes_and_the_blocking_client(store: Store, data: bytes, tmp_path: Path) -> None:
    cmap = put_blob(store, data)
    cache_dir = tmp_path / "cache"
    async with rig(store, cache_dir) as r, trio.open_nursery() as nursery:
        server = ControlServer(socket_path(cache_dir), ControlAPI(r.lazy))
        await nursery.start(server.serve)
        # Unknown to the node: the route fetches the chunk map, so it can say what is missing.
        async with httpx.AsyncClient(transport=httpx.ASGITransport(server.api.app), base_url="http://x") as app:
            answer = await app.post("/pin", json={"blob": cmap.blob, "holder": "x"})
            assert answer.status_code == 409
            assert answer.json()["missing_bytes"] == len(data) and answer.json()["complete"] is False
            assert (await app.post("/pin", json={"blob": cmap.blob})).status_code == 400
        assert await trio.to_thread.run_sync(control.pin, cache_dir, cmap.blob, "x") is None
        await _fill(r, cmap.blob, len(data))
        path = await trio.to_thread.run_sync(control.pin, cache_dir, cmap.blob, "x")
        assert path == BlobFiles(cache_dir).path(cmap.blob).absolute() and path.read_bytes() == data
        ls = await trio.to_thread.run_sync(control.request_json, cache_dir, "GET", "/cache")
        assert ls["pins"][0]["holder"] == "x"
        with pytest.raises(BlobPinned):
            await trio.to_thread.run_sync(control.request_json, cache_dir, "POST", "/cache/evict",
                                          {"blob": cmap.blob})
        assert await trio.to_thread.run_sync(control.unpin, cache_dir, cmap.blob, "x")
        assert not await trio.to_thread.run_sync(control.unpin, cache_dir, cmap.blob, "x")
        nursery.cancel_scope.cancel()


def test_pin_and_unpin_offline(store: Store, data: bytes, tmp_path: Path) -> None:
    cmap = put_blob(store, data)
    cache_dir = tmp_path / "cache"
    assert pin_offline(cache_dir, cmap.blob, "x") is None  # no cache at all
    assert not unpin_offline(cache_dir, cmap.blob, "x")

    async def fill(n: int) -> None:
        async with rig(store, cache_dir) as r:
            fh = await r.open_blob(cmap.blob)
            await r.fs.read(fh, 0, n)

    trio.run(fill, CHUNK)
    assert control.pin(cache_dir, cmap.blob, "x") is None  # no daemon: offline, incomplete
    trio.run(fill, len(data))
    path = control.pin(cache_dir, cmap.blob, "x")
    assert path is not None and path.read_bytes() == data
    r = layerctl("cache", "ls", "--cache", str(cache_dir), "--json")
    assert r.code == 0 and [p["holder"] for p in r.json()["pins"]] == ["x"]
    assert_clean_failure(layerctl("cache", "evict", "--cache", str(cache_dir), "--blob", cmap.blob), "pinned by x")
    r = layerctl("cache", "unpin", "--cache", str(cache_dir), cmap.blob, "--holder", "x", "--json")
    assert r.code == 0 and r.json()["removed"] is True
    assert control.unpin(cache_dir, cmap.blob, "x") is False
    r = layerctl("cache", "pin", "--cache", str(cache_dir), cmap.blob, "--holder", "y")
    assert r.code == 0 and r.out.strip() == str(path)


# -- real kernel ----------------------------------------------------------------------------------------
@pytest.mark.root
def test_erofs_on_the_pinned_file_outlives_the_daemon_and_eviction(tmp_path: Path) -> None:
    store_dir, cache, mnt = tmp_path / "store", tmp_path / "cache", tmp_path / "mnt"
    s = Store.open(str(store_dir))
    s.init()
    src = make_tree(tmp_path / "src", small=40, big=(3 << 20,))
    layer = build_and_push(s, src, tmp_path / "image.erofs")
    other = build_and_push(s, make_tree(tmp_path / "src2", small=5, big=(3 << 20,), seed=2), tmp_path / "o.erofs")
    want = snapshot_tree(src, root_meta=False)
    with DaemonProcess(str(store_dir), cache, mnt) as d:
        assert control.pin(cache, layer.blob, "test") is None  # nothing cached yet
        control.request_json(cache, "POST", "/prefetch", {"blob": layer.blob, "all": True, "wait": True})
        path = control.pin(cache, layer.blob, "test")
        assert path is not None
        with mounted_erofs(path) as emnt:
            assert_trees_equal(want, snapshot_tree(emnt, root_meta=False))
            d.kill9()
            # The daemon is gone: the direct mount does not care (a fresh mount neither).
            assert_trees_equal(want, snapshot_tree(emnt, root_meta=False))
        d.cleanup()  # its dead FUSE mount
        # The pin survived kill -9 (read offline: no daemon runs).
        r = layerctl("cache", "ls", "--cache", str(cache), "--json")
        assert r.code == 0 and [(p["blob"], p["holder"]) for p in r.json()["pins"]] == [(layer.blob, "test")]
        disk = os.stat(path).st_blocks
        with mounted_erofs(path) as emnt:
            assert_trees_equal(want, snapshot_tree(emnt, root_meta=False))
            # A daemon with a budget smaller than the pinned blob: it evicts everything else.
            budget = str(layer.size // 2)
            with DaemonProcess(str(store_dir), cache, mnt, "--cache-size", budget) as d2:
                assert d2.blob(other.blob).read_bytes() == other.path.read_bytes()
                r = layerctl("cache", "evict", "--cache", str(cache), "--all", "--json")
                assert r.code == 0 and r.json()["pinned_bytes"] == layer.size
                assert_clean_failure(layerctl("cache", "evict", "--cache", str(cache), "--blob", layer.blob),
                                     "pinned")
                ls = layerctl("cache", "ls", "--cache", str(cache), "--json").json()
                mine = next(b for b in ls["blobs"] if b["blob"] == layer.blob)
                assert mine["complete"] and mine["pinned_by"] == ["test"]
                assert "cannot be evicted" in d2.log_text()
            assert os.stat(path).st_blocks == disk
            assert_trees_equal(want, snapshot_tree(emnt, root_meta=False))
        # Unmounted, then unpinned (offline: no daemon runs): evictable again.
        assert control.unpin(cache, layer.blob, "test")
    r = layerctl("cache", "evict", "--cache", str(cache), "--blob", layer.blob, "--json")
    assert r.code == 0 and r.json()["evicted_bytes"] == layer.size
