"""`layerctl cache gc` and `Forgetting.gc_unused`: cached blobs nothing uses and nobody used for a
while are forgotten (chunks, map, index records, data file); pinned, open, in-flight and in-use
blobs never are. Without a kernel (the FUSE operations called directly), offline (the CLI with
no daemon), and through a real daemon's control socket (root)."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest
import trio
from testkit.cli_helpers import assert_clean_failure, layerctl
from testkit.fuse_helpers import DaemonProcess, read_file
from testkit.node_lease import lease_rig

from fuse_client.control import request_json
from fuse_client.nodecache import INDEX_DIR
from fuse_client.nodecache.files import BlobFiles
from fuse_client.nodecache.index import CacheIndex
from fuse_client.nodecache.maintenance import gc_offline
from fuse_client.nodecache.unused import BlobUse, choose_unused
from layerstore.errors import BadInput
from layerstore.store import Store
from tests.fuse_client.test_fuse_control_http import serving
from tests.fuse_client.test_fuse_handlers import CHUNK, put_blob

HOUR = 3600.0


class Clock:
    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset


@pytest.fixture
def store(tmp_path: Path) -> Store:
    s = Store.open(str(tmp_path / "store"))
    s.init()
    return s


def blobs_of(store: Store, n: int) -> list[tuple[str, bytes]]:
    rng = random.Random(5)
    out = [(put_blob(store, data, meta=(0,)).blob, data)
           for data in (rng.randbytes(4 * CHUNK + 99) for _ in range(n))]
    store.close()  # (the pushing handle's own lease released)
    return out


def test_choose_unused_is_pure_policy() -> None:
    uses = [BlobUse("old", 10, 100.0), BlobUse("older", 5, 50.0), BlobUse("recent", 7, 500.0),
            BlobUse("open-old", 9, 1.0, "open"), BlobUse("never", 0, 0.0)]
    choice = choose_unused(uses, cutoff=200.0)
    assert [u.blob for u in choice.victims] == ["never", "older", "old"]  # oldest first
    assert [u.blob for u in choice.kept_in_use] == ["open-old"]
    assert [u.blob for u in choice.kept_recent] == ["recent"]
    assert choose_unused(uses, cutoff=0.0).victims == []  # nothing is older than the epoch


def _index_maps(cache_dir: Path) -> set[str]:
    idx = CacheIndex(cache_dir / INDEX_DIR, readonly=True)
    try:
        return {b for b, _ in idx.maps()}
    finally:
        idx.close()


@pytest.mark.trio
async def test_gc_forgets_only_blobs_nothing_uses(store: Store, tmp_path: Path) -> None:
    (a, da), (b, db), (c, dc), (d, dd), (e, de) = blobs_of(store, 5)
    clock = Clock()
    cache_dir = tmp_path / "cache"
    files = BlobFiles(cache_dir)
    async with lease_rig(store, cache_dir, linger=60.0, clock=clock) as r:
        r.cache.clock = clock
        handles = {}
        for blob, data in ((a, da), (b, db), (c, dc), (d, dd), (e, de)):
            handles[blob] = await r.open_blob(blob)
            assert await r.read_all(handles[blob], len(data)) == data
        for blob in (b, c, d, e):
            await r.fs.release(handles[blob])
        await r.lazy.pin_blob(b, "shim:/node/layers/b")  # b: a direct mount; a: open through FUSE
        clock.offset = 2 * HOUR  # two hours later ...
        fd = await r.open_blob(d)  # ... d is read again
        await r.read_all(fd, len(dd))
        await r.fs.release(fd)
        r.cache.pin(r.cache.entries[e], [0])  # e: a reader holds one of its chunks right now
        for blob in (a, b, c, d, e):  # (the data files were written two "hours" ago)
            os.utime(files.path(blob), (clock() - 2 * HOUR, clock() - 2 * HOUR))
        r.inuse.seen.clear()  # (the daemon's own view: only what is open or pinned now)

        used = r.cache.usage
        dry = await r.cache.forgetting.gc_unused(HOUR, dry_run=True)
        assert [x["blob"] for x in dry["dropped"]] == [c] and dry["dry_run"]
        assert set(r.cache.entries) == {a, b, c, d, e} and r.cache.usage == used  # nothing changed
        res = await r.cache.forgetting.gc_unused(HOUR)
        assert [x["blob"] for x in res["dropped"]] == [c]
        assert res["dropped_bytes"] == len(dc) and res["kept_in_use"] == 3 and res["kept_recent"] == 1
        assert c not in r.cache.entries and not files.exists(c) and r.cache.usage == used - len(dc)
        assert c not in {m for m, _ in r.cache.index.maps()}  # committed before gc_unused returned
        # Even with no threshold, the open, the pinned and the held one stay.
        res = await r.cache.forgetting.gc_unused(0.0)
        assert {x["blob"] for x in res["dropped"]} == {d}
        assert set(r.cache.entries) == {a, b, e}
        r.cache.unpin(r.cache.entries[e], [0])
        assert await r.read_all(handles[a], len(da)) == da
        # A forgotten blob is fetched again on its next use, from a fresh entry and data file.
        fc = await r.open_blob(c)
        assert await r.read_all(fc, len(dc)) == dc
        await r.fs.release(fc)
        await r.fs.release(handles[a])
        assert await r.cache.pins.unpin_blob(b, "shim:/node/layers/b")
        # b's last use is its unpin (a direct mount reads without a FUSE hop): recent
        res = await r.cache.forgetting.gc_unused(HOUR)
        assert b not in {x["blob"] for x in res["dropped"]}
    assert _index_maps(cache_dir) == {a, b, c, e} - {x["blob"] for x in res["dropped"]}


@pytest.mark.trio
async def test_the_daemons_view_keeps_a_blob_being_mounted(store: Store, tmp_path: Path) -> None:
    [(a, da)] = blobs_of(store, 1)
    clock = Clock()
    async with lease_rig(store, tmp_path / "cache", linger=60.0, clock=clock) as r:
        r.cache.clock = clock
        fh = await r.open_blob(a)
        await r.read_all(fh, len(da))
        await r.fs.release(fh)
        clock.offset = 2 * HOUR
        await r.lookup(a)  # the shim asked about it: a mount is on its way
        res = await r.cache.forgetting.gc_unused(0.0)
        assert res["dropped"] == [] and res["kept_in_use"] == 1
        clock.offset += 61  # the request lingers one rotation interval, then counts as its last use
        assert (await r.cache.forgetting.gc_unused(120.0))["dropped"] == []
        assert [x["blob"] for x in (await r.cache.forgetting.gc_unused(30.0))["dropped"]] == [a]


def _filled_cache(store: Store, tmp_path: Path, pin: str | None = None) -> tuple[Path, list[tuple[str, bytes]]]:
    blobs = blobs_of(store, 3)
    cache_dir = tmp_path / "cache"

    async def fill() -> None:
        async with lease_rig(store, cache_dir) as r:
            for blob, data in blobs:
                fh = await r.open_blob(blob)
                await r.read_all(fh, len(data))
                await r.fs.release(fh)
            if pin:
                await r.lazy.pin_blob(blobs[0][0], pin)

    trio.run(fill)
    return cache_dir, blobs


def test_gc_offline_keeps_pins_and_recovers_cleanly(store: Store, tmp_path: Path) -> None:
    cache_dir, [(a, da), (b, _), (c, _)] = _filled_cache(store, tmp_path, pin="shim:/node/layers/a")
    res = gc_offline(cache_dir, older_than=HOUR)
    assert res["dropped"] == [] and res["kept_recent"] == 2 and res["kept_in_use"] == 1
    assert gc_offline(cache_dir, older_than=0, dry_run=True)["dropped_blobs"] == 2
    assert _index_maps(cache_dir) == {a, b, c}
    res = gc_offline(cache_dir, older_than=0)
    assert {x["blob"] for x in res["dropped"]} == {b, c} and res["kept_in_use"] == 1
    assert _index_maps(cache_dir) == {a}
    files = BlobFiles(cache_dir)
    assert files.path(a).read_bytes() == da and not files.exists(b) and not files.exists(c)
    ls = layerctl("cache", "ls", "--cache", str(cache_dir), "--json").json()
    assert [x["blob"] for x in ls["blobs"]] == [a] and ls["blobs"][0]["complete"] and ls["used_bytes"] == len(da)


@pytest.mark.slow  # about 2-3 s: kept out of `make check`'s 2 minutes
def test_cache_gc_cli_offline(store: Store, tmp_path: Path) -> None:
    cache_dir, blobs = _filled_cache(store, tmp_path)
    r = layerctl("cache", "gc", "--cache", str(cache_dir), "--older-than", "0s", "--dry-run", "--json")
    assert r.code == 0, r.err
    assert r.json()["dry_run"] and r.json()["dropped_blobs"] == 3
    assert _index_maps(cache_dir) == {b for b, _ in blobs}
    r = layerctl("cache", "gc", "--cache", str(cache_dir), "--older-than", "1h")
    assert r.code == 0 and "forgot 0 blob(s)" in r.out and "3 used in the last 1h" in r.out
    r = layerctl("cache", "gc", "--cache", str(cache_dir), "--older-than", "0")
    assert r.code == 0 and "forgot 3 blob(s)" in r.out
    assert _index_maps(cache_dir) == set()
    assert_clean_failure(layerctl("cache", "gc", "--cache", str(cache_dir), "--older-than", "soon"), "duration")
    assert_clean_failure(layerctl("cache", "gc", "--cache", str(tmp_path / "nothing"), "--older-than", "0"),
                         "not a node cache")


@pytest.mark.root
@pytest.mark.trio
async def test_the_control_route_checks_its_body(store: Store, tmp_path: Path) -> None:
    [(a, da)] = blobs_of(store, 1)
    cache_dir = tmp_path / "cache"
    async with serving(store, cache_dir):
        for bad in ({}, {"older_than": -1}, {"older_than": "soon"}, {"older_than": float("nan")}):
            with pytest.raises(BadInput):
                await trio.to_thread.run_sync(request_json, cache_dir, "POST", "/cache/gc", bad)
        res = await trio.to_thread.run_sync(request_json, cache_dir, "POST", "/cache/gc",
                                            {"older_than": 0, "dry_run": True})
        assert res["dry_run"] and res["dropped"] == []


@pytest.mark.root
def test_cache_gc_through_the_daemon_never_drops_an_open_blob(store: Store, tmp_path: Path) -> None:
    blobs = blobs_of(store, 2)
    (a, da), (b, db) = blobs
    cache_dir, mnt = tmp_path / "cache", tmp_path / "mnt"
    with DaemonProcess(store.url, cache_dir, mnt, env={"LAYERSTORE_NODE_LEASE_INTERVAL": "0.2"}) as d:
        assert read_file(d.blob(b)) == db
        with open(d.blob(a), "rb") as fa:  # an open handle, as a file-backed EROFS mount holds
            assert fa.read() == da
            # b was read a moment ago: only a threshold of 0 drops it (its lookup lingers one
            # rotation interval, 0.2 s here)
            res = layerctl("cache", "gc", "--cache", str(cache_dir), "--older-than", "1h", "--json").json()
            assert res["dropped"] == [] and res["kept_in_use"] + res["kept_recent"] == 2
            time.sleep(0.5)
            r = layerctl("cache", "gc", "--cache", str(cache_dir), "--older-than", "0", "--json")
            assert r.code == 0, r.err
            assert [x["blob"] for x in r.json()["dropped"]] == [b] and r.json()["kept_in_use"] == 1
            fa.seek(0)
            assert fa.read() == da
        assert read_file(d.blob(b)) == db  # fetched again
