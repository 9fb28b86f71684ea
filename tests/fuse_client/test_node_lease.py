"""The node lease (fuse_client.nodecache.inuse), with the FUSE operations called without a
kernel: a blob is held before the daemon first relies on it, a sweep that may delete it is
waited out, the lease rotates to exactly the in-use set, cached reads write nothing, a read-only
store is one warning, and the lease goes at a clean shutdown."""

from __future__ import annotations

import errno
import logging
import random
import subprocess
import time
from pathlib import Path

import pyfuse3
import pytest
import trio
from testkit.fuse_helpers import DaemonProcess, read_file
from testkit.node_lease import (
    JournalBackend,
    held_blobs,
    journal_store,
    lease_rig,
    node_leases,
    publish_sweep,
    set_run_state,
)

from fuse_client.nodecache.inuse import blob_key, interval_from_env
from layerstore import leases, linux
from layerstore.errors import PermissionDenied
from layerstore.store import Store
from tests.fuse_client.test_fuse_handlers import CHUNK, put_blob


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return journal_store(tmp_path / "store")


@pytest.fixture
def backend(store: Store) -> JournalBackend:
    assert isinstance(store.backend, JournalBackend)
    return store.backend


def blobs_of(store: Store, n: int, seed: int = 3) -> list[tuple[str, bytes]]:
    """`n` blobs pushed, the pushing handle's own lease released (as when `layerctl build` exits)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        data = rng.randbytes(5 * CHUNK + 77)
        out.append((put_blob(store, data, meta=(0,)).blob, data))
    store.close()
    return out


@pytest.mark.trio
async def test_a_blob_is_held_before_its_chunk_map_is_loaded(store: Store, backend: JournalBackend,
                                                             tmp_path: Path) -> None:
    [(a, data)] = blobs_of(store, 1)
    assert not list(leases.read_leases(backend))
    async with lease_rig(store, tmp_path / "cache") as r:
        backend.take()
        fh = await r.open_blob(a)
        calls = backend.take()
        map_load = calls.index(("load", blob_key(a)))
        lease_writes = [i for i, (op, key) in enumerate(calls) if key.startswith(leases.LEASES)
                        and op in ("replace", "store_once")]
        sweeps_read = [i for i, (op, key) in enumerate(calls) if key == leases.RUNS]
        assert lease_writes and sweeps_read and max(lease_writes) < min(sweeps_read) < map_load
        [info] = node_leases(backend)
        assert info.keys == {blob_key(a)} and info.name == f"test:{tmp_path / 'cache'}"
        assert await r.read_all(fh, len(data)) == data
        # vouched: more requests about it cost no store call, and cached reads none either
        backend.take()
        await r.lookup(a)
        await r.fs.getattr(await r.lookup(a))
        assert await r.read_all(fh, len(data)) == data
        assert backend.take() == []
        await r.fs.release(fh)
    # a clean shutdown releases the lease
    assert list(backend.list(leases.LEASES)) == []


@pytest.mark.trio
async def test_the_lease_rotates_to_exactly_the_blobs_in_use(store: Store, backend: JournalBackend,
                                                             tmp_path: Path) -> None:
    (a, da), (b, db), (c, _dc) = blobs_of(store, 3)
    clock = Clock()
    async with lease_rig(store, tmp_path / "cache", linger=30.0, clock=clock) as r:
        fa = await r.open_blob(a)  # open: a file-backed mount through FUSE
        fb = await r.open_blob(b)
        await r.read_all(fb, len(db))
        await r.fs.release(fb)
        await r.lazy.pin_blob(b, "shim:/node/layers/b")  # pinned: a direct mount
        await r.lookup(c)  # asked about: a mount on its way
        assert held_blobs(backend) == {a, b, c}
        clock.now += 10
        await r.inuse.rotate()
        assert held_blobs(backend) == {a, b, c} and r.inuse.rotations == 0  # nothing changed: nothing written
        clock.now += 30  # c was only looked up, longer than the linger ago
        await r.inuse.rotate()
        assert held_blobs(backend) == {a, b} and r.inuse.rotations == 1
        assert r.inuse.vouched == {a, b}
        await r.fs.release(fa)
        assert await r.cache.pins.unpin_blob(b, "shim:/node/layers/b")
        await r.inuse.rotate()  # a and b were in use until now: they linger
        assert held_blobs(backend) == {a, b}
        clock.now += 31
        await r.inuse.rotate()
        assert held_blobs(backend) == set() and r.inuse.vouched == set()
        [info] = node_leases(backend)
        assert list(backend.list(f"{leases.LEASES}{info.id}/")) == [leases.head_key(info.id)]  # shards gone
        # used again: protected again (held before it is relied on) and in the lease again
        backend.take()
        fa = await r.open_blob(a)
        shard = f"{leases.LEASES}{info.id}/s"
        shard_writes = [k for op, k in backend.take() if op == "store_once" and k.startswith(shard)]
        assert len(shard_writes) == 1  # a new shard (numbers only go up: never one the rotation deleted)
        assert held_blobs(backend) == {a}
        assert await r.read_all(fa, len(da)) == da
        await r.fs.release(fa)


@pytest.mark.trio
async def test_a_sweep_with_the_blob_among_its_candidates_is_waited_out(store: Store, backend: JournalBackend,
                                                                        tmp_path: Path) -> None:
    (a, da), (b, _db) = blobs_of(store, 2)
    publish_sweep(backend, "gc-run-a", [blob_key(a), blob_key(b)])
    async with lease_rig(store, tmp_path / "cache") as r:
        outcome: dict[str, object] = {}

        async def use(blob: str) -> None:
            try:
                outcome[blob] = await r.open_blob(blob)
            except pyfuse3.FUSEError as e:
                outcome[blob] = e.errno

        async with trio.open_nursery() as nursery:
            nursery.start_soon(use, a)
            nursery.start_soon(use, b)
            with trio.fail_after(30):
                while held_blobs(backend) != {a, b}:  # held first ...
                    await trio.sleep(0.02)
            await trio.sleep(0.3)
            assert outcome == {}  # ... then waiting for the sweep
            # The sweep ends: it deleted b (its re-read of the leases came before our hold), not a.
            backend.delete(blob_key(b))
            set_run_state(backend, "gc-run-a", "done")
        assert outcome[b] == errno.ENOENT  # failed cleanly: nothing of b was relied on
        assert isinstance(outcome[a], int) and outcome[a] != errno.ENOENT
        assert await r.read_all(int(outcome[a]), len(da)) == da  # type: ignore[call-overload]
        await r.fs.release(int(outcome[a]))  # type: ignore[call-overload]
        assert a in r.inuse.vouched


@pytest.mark.trio
async def test_a_blob_known_from_before_is_checked_in_the_store_again(store: Store, backend: JournalBackend,
                                                                      tmp_path: Path) -> None:
    (a, da), (b, db) = blobs_of(store, 2)
    cache_dir = tmp_path / "cache"
    async with lease_rig(store, cache_dir) as r:
        for blob, data in ((a, da), (b, db)):
            fh = await r.open_blob(blob)
            await r.read_all(fh, len(data))
            await r.fs.release(fh)
    backend.delete(blob_key(b))  # collected while no daemon ran (nothing held it)
    async with lease_rig(store, cache_dir) as r:  # a restart: both recovered from the index
        assert set(r.cache.entries) == {a, b}
        with pytest.raises(pyfuse3.FUSEError) as ei:
            await r.lookup(b)
        assert ei.value.errno == errno.ENOENT
        fh = await r.open_blob(a)
        assert await r.read_all(fh, len(da)) == da
        await r.fs.release(fh)
        assert held_blobs(backend) == {a, b} and r.inuse.vouched == {a}


@pytest.mark.trio
async def test_a_read_only_store_is_one_warning(store: Store, backend: JournalBackend, tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    (a, da), (b, db) = blobs_of(store, 2)
    backend.refuse_leases = PermissionDenied("store: read-only for this node")
    with caplog.at_level(logging.WARNING, logger="layerstore.fuse.inuse"):
        async with lease_rig(store, tmp_path / "cache") as r:
            for blob, data in ((a, da), (b, db)):
                fh = await r.open_blob(blob)
                assert await r.read_all(fh, len(data)) == data
                await r.fs.release(fh)
            await r.inuse.rotate()
            assert r.inuse.disabled
    warnings = [rec for rec in caplog.records if rec.name == "layerstore.fuse.inuse"]
    assert len(warnings) == 1 and "grace period" in warnings[0].getMessage()
    assert list(backend.list(leases.LEASES)) == []


@pytest.mark.trio
async def test_pins_from_before_a_restart_are_held_at_start(store: Store, backend: JournalBackend,
                                                            tmp_path: Path) -> None:
    [(a, da)] = blobs_of(store, 1)
    cache_dir = tmp_path / "cache"
    async with lease_rig(store, cache_dir) as r:
        fh = await r.open_blob(a)
        await r.read_all(fh, len(da))
        await r.fs.release(fh)
        await r.lazy.pin_blob(a, "shim:/node/layers/a")
    assert node_leases(backend) == []  # released at the clean shutdown; the direct mount stays
    async with lease_rig(store, cache_dir) as r:
        with trio.fail_after(10):  # the first rotation, at start
            while held_blobs(backend) != {a}:
                await trio.sleep(0.02)
        assert await r.cache.pins.unpin_blob(a, "shim:/node/layers/a")


def test_the_rotation_interval_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAYERSTORE_NODE_LEASE_INTERVAL", "0.5")
    assert interval_from_env() == 0.5
    for bad in ("0", "-1", "soon", "inf", "nan"):
        monkeypatch.setenv("LAYERSTORE_NODE_LEASE_INTERVAL", bad)
        assert interval_from_env(60.0) == 60.0
    monkeypatch.delenv("LAYERSTORE_NODE_LEASE_INTERVAL")
    assert interval_from_env(60.0) == 60.0


@pytest.mark.root
def test_a_daemon_on_a_read_only_store_warns_once_and_serves(tmp_path: Path) -> None:
    store = Store.open(str(tmp_path / "store"))
    store.init()
    blobs = blobs_of(store, 2)
    ro = tmp_path / "ro"
    ro.mkdir()
    subprocess.run(["mount", "--bind", str(tmp_path / "store"), str(ro)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], check=True)
        with DaemonProcess(str(ro), tmp_path / "cache", tmp_path / "mnt") as d:
            for blob, data in blobs:
                assert read_file(d.blob(blob)) == data
        log = d.log_text()
        assert log.count("refuses this node's lease") == 1, log
        assert list(store.backend.list(leases.LEASES)) == []
    finally:
        linux.umount(ro, lazy=True)


@pytest.mark.trio
async def test_holds_and_rotations_interleaved_keep_every_vouched_blob_held(store: Store, backend: JournalBackend,
                                                                            tmp_path: Path) -> None:
    """Many opens, closes, pins and lookups of many blobs at once, with rotations (no linger)
    running between and during them: whatever the node relies on is always in its lease."""
    blobs = [b for b, _ in blobs_of(store, 12, seed=9)]
    rng = random.Random(4)
    async with lease_rig(store, tmp_path / "cache", linger=0.0) as r:

        def check() -> None:
            held = held_blobs(backend)
            missing = (r.inuse.vouched | r.inuse.held) - held
            assert not missing, f"relied on but not in the lease: {missing}"
            in_use = set(r.cache.holds.pinned) | {b for b, e in r.cache.entries.items() if e.open_count}
            assert in_use <= r.inuse.vouched | set(r.inuse.seen)

        async def worker(seed: int) -> None:
            wr = random.Random(seed)
            for _ in range(15):
                blob = wr.choice(blobs)
                fh = await r.open_blob(blob)
                await trio.sleep(wr.random() / 50)
                await r.fs.release(fh)
                await r.lookup(wr.choice(blobs))

        async def rotator() -> None:
            for _ in range(30):
                await r.inuse.rotate()
                check()
                await trio.sleep(rng.random() / 100)

        async with trio.open_nursery() as nursery:
            for seed in range(6):
                nursery.start_soon(worker, seed)
            nursery.start_soon(rotator)
        check()
        await r.inuse.rotate()
        assert held_blobs(backend) == set() and r.inuse.vouched == set()  # nothing open, nothing lingers


@pytest.mark.root
def test_after_kill_9_the_lease_stays_until_it_expires(tmp_path: Path) -> None:
    store = Store.open(str(tmp_path / "store"))
    store.init()
    (a, da), (b, db) = blobs_of(store, 2)
    cache, mnt = tmp_path / "cache", tmp_path / "mnt"
    with DaemonProcess(store.url, cache, mnt) as d:
        assert read_file(d.blob(a)) == da
        d.kill9()
    [old] = node_leases(store.backend)
    assert held_blobs(store.backend) == {a}
    assert old.live(old.expires) and not old.live(old.expires + leases.SKEW + 1)  # a collector's view
    assert old.expires <= time.time() + leases.DEFAULT_TTL
    with DaemonProcess(store.url, cache, mnt) as d:  # a new daemon: a lease of its own
        assert read_file(d.blob(b)) == db
        assert {info.id for info in node_leases(store.backend)} > {old.id}
        assert held_blobs(store.backend) == {a, b}
    assert [info.id for info in node_leases(store.backend)] == [old.id]  # (the new one was released)


@pytest.mark.trio
async def test_digests_the_store_never_had_cost_no_lease_write(store: Store, backend: JournalBackend,
                                                               tmp_path: Path) -> None:
    rng = random.Random(8)
    async with lease_rig(store, tmp_path / "cache") as r:
        backend.take()
        for _ in range(20):
            with pytest.raises(pyfuse3.FUSEError) as ei:
                await r.lookup("b3:" + rng.randbytes(32).hex())
            assert ei.value.errno == errno.ENOENT
        writes = [c for c in backend.take() if c[0] in ("store_once", "replace", "delete")]
        assert writes == [] and list(backend.list(leases.LEASES)) == []
