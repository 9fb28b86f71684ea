"""End to end through the CLI: `layerctl daemon` as a subprocess, EROFS mounted from its blobs,
the cache/stats/prefetch commands, and the failure behaviours (store directory gone, kill -9)."""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import random
import threading
from pathlib import Path

import pytest
from testkit.cli_helpers import assert_clean_failure, layerctl
from testkit.erofs_helpers import assert_trees_equal, mounted_erofs, snapshot_tree
from testkit.fuse_helpers import DaemonProcess, build_and_push, force_unmount, make_tree, read_errno, wait_until

from erofs_builder.build import BuiltLayer
from fuse_client.control import request, request_json
from layerstore import linux
from layerstore.store import Store

pytestmark = pytest.mark.root


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture
def store(store_dir: Path) -> Store:
    s = Store.open(str(store_dir))
    s.init()
    return s


@pytest.fixture
def src(tmp_path: Path) -> Path:
    return make_tree(tmp_path / "src", small=50, big=(4 << 20,))


@pytest.fixture
def layer(store: Store, src: Path, tmp_path: Path) -> BuiltLayer:
    return build_and_push(store, src, tmp_path / "image.erofs")


def test_daemon_end_to_end(store_dir: Path, src: Path, layer: BuiltLayer, tmp_path: Path) -> None:
    cache, mnt, trace = tmp_path / "cache", tmp_path / "mnt", tmp_path / "trace.json"
    d = DaemonProcess(str(store_dir), cache, mnt, "--record-trace", str(trace), "--cache-size", "64M")
    with d:
        with mounted_erofs(d.blob(layer.blob)) as emnt:
            assert_trees_equal(snapshot_tree(src, root_meta=False), snapshot_tree(emnt, root_meta=False))

        r = layerctl("stats", "--cache", str(cache), "--json")
        assert r.code == 0, r.err
        stats = r.json()
        assert set(stats) == {"blobs", "corrupt_chunks", "store_errors", "cache_write_failures", "pid", "data_path",
                              "data_path_reason"}
        assert stats["data_path"] == "fuse" and stats["pid"] == d.pid  # FUSE unless fanotify is asked for
        assert stats["data_path_reason"], stats  # (why: the default, asked for, or no pre-content events)
        st = stats["blobs"][layer.blob]
        assert set(st) == {"size", "fetched_bytes", "served_bytes", "hits", "misses"}
        assert st["size"] == layer.size and 0 < st["fetched_bytes"] <= layer.size
        assert st["misses"] > 0 and st["served_bytes"] > 0
        assert stats["corrupt_chunks"] == 0 and stats["store_errors"] == 0

        ctype, metrics = request(cache, "GET", "/metrics")
        text = metrics.decode()
        assert ctype.startswith("text/plain")
        assert "layerstore_fuse_fetch_seconds_bucket" in text
        assert f'layerstore_fuse_fetched_bytes_total{{blob="{layer.blob}"}}' in text
        assert "layerstore_fuse_corrupt_chunks_total 0.0" in text

        r = layerctl("prefetch", "--cache", str(cache), layer.blob, "--all", "--wait", "--json")
        assert r.code == 0, r.err
        assert r.json()["failed"] == 0
        r = layerctl("cache", "ls", "--cache", str(cache), "--json")
        assert r.code == 0, r.err
        (entry,) = r.json()["blobs"]
        assert entry["cached_chunks"] == entry["chunks"] and entry["cached_bytes"] == layer.size
        assert r.json()["budget"]["size"] == 64 << 20 and r.json()["budget"]["source"] == "--cache-size"
        assert d.stats()["blobs"][layer.blob]["fetched_bytes"] == layer.size

        # readdir of blobs/ lists the blobs the node has seen
        assert os.listdir(mnt / "blobs") == [layer.blob]
        # One daemon per cache directory.
        other = tmp_path / "mnt2"
        other.mkdir()
        assert_clean_failure(layerctl("daemon", "--store", str(store_dir), "--cache", str(cache), "--mountpoint",
                                      str(other)), "in use")
        assert not linux.is_mount(other)
        assert d.stop() == 0
    assert not linux.is_mount(mnt)
    assert not (cache / "control.sock").exists()
    doc = json.loads(trace.read_text())
    assert doc["version"] == 1 and set(doc["blobs"]) == {layer.blob}
    order = doc["blobs"][layer.blob]
    assert order and len(order) == len(set(order)) and all(0 <= i < len(layer.refs) for i in order)
    assert "Traceback" not in d.log_text()


def test_cache_commands_online_and_offline(store_dir: Path, layer: BuiltLayer, tmp_path: Path) -> None:
    cache, mnt = tmp_path / "cache", tmp_path / "mnt"
    want = layer.path.read_bytes()
    with DaemonProcess(str(store_dir), cache, mnt) as d:
        assert d.blob(layer.blob).read_bytes() == want
        r = layerctl("cache", "verify", "--cache", str(cache), "--json")
        assert r.code == 0 and r.json()["bad"] == [] and r.json()["checked"] == len(layer.refs)

        # Damage one committed chunk on the cache's disk: verify finds it and drops it.
        victim = next(i for i, ref in enumerate(layer.refs) if ref.length > 100)
        ref = layer.refs[victim]
        hexd = layer.blob[3:]
        data_file = cache / "data" / hexd[:2] / hexd
        with open(data_file, "r+b") as f:
            f.seek(ref.offset + 7)
            f.write(b"\xff\xfe\xfd")
        r = layerctl("cache", "verify", "--cache", str(cache), "--json")
        assert r.code == 1
        assert [(b["blob"], b["chunk"]) for b in r.json()["bad"]] == [(layer.blob, victim)]
        # It is fetched again on the next read (the page cache is bypassed with O_DIRECT).
        buf = mmap.mmap(-1, 1 << 20)
        fd = os.open(d.blob(layer.blob), os.O_RDONLY | os.O_DIRECT)
        try:
            start = ref.offset // 4096 * 4096
            n = os.preadv(fd, [buf], start)
            assert buf[:n] == want[start:start + n]
        finally:
            os.close(fd)
            buf.close()
        r = layerctl("cache", "verify", "--cache", str(cache), "--json")
        assert r.code == 0 and r.json()["bad"] == []

        r = layerctl("cache", "evict", "--cache", str(cache), "--all", "--json")
        assert r.code == 0 and r.json()["used_bytes"] == 0 and r.json()["evicted_chunks"] > 0
        r = layerctl("cache", "ls", "--cache", str(cache), "--json")
        assert r.json()["used_bytes"] == 0
        assert d.blob(layer.blob).read_bytes() == want  # still served (re-fetched or page cache)
    # Offline: no daemon, the same commands work on the directory.
    r = layerctl("cache", "ls", "--cache", str(cache), "--json")
    assert r.code == 0, r.err
    used = r.json()["used_bytes"]
    r = layerctl("cache", "verify", "--cache", str(cache))
    assert r.code == 0, r.err
    r = layerctl("cache", "evict", "--cache", str(cache), "--to", "0", "--json")
    assert r.code == 0 and r.json()["evicted_bytes"] == used and r.json()["used_bytes"] == 0
    assert_clean_failure(layerctl("stats", "--cache", str(cache), "--json"), "no daemon")
    assert_clean_failure(layerctl("prefetch", "--cache", str(cache), layer.blob, "--all"), "no daemon")
    assert_clean_failure(layerctl("cache", "ls", "--cache", str(tmp_path / "nope")), "not a node cache")
    assert_clean_failure(layerctl("daemon", "--store", str(store_dir), "--cache", str(cache), "--mountpoint",
                                  str(mnt), "--cache-size", "lots"), "not a size")


def test_prefetch_from_a_recorded_trace(store_dir: Path, layer: BuiltLayer, tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    d = DaemonProcess(str(store_dir), tmp_path / "cache1", tmp_path / "mnt", "--record-trace", str(trace))
    with d, mounted_erofs(d.blob(layer.blob)) as emnt:
        (emnt / "d2" / "small2.txt").read_bytes()
        (emnt / "big0.bin").read_bytes()
    order = json.loads(trace.read_text())["blobs"][layer.blob]
    with DaemonProcess(str(store_dir), tmp_path / "cache2", tmp_path / "mnt") as d:
        r = layerctl("prefetch", "--cache", str(tmp_path / "cache2"), layer.blob, "--ranges", str(trace), "--wait",
                     "--json")
        assert r.code == 0, r.err
        assert r.json()["queued"] == len(order) and r.json()["failed"] == 0
        want = sum(layer.refs[i].length for i in order)
        assert d.stats()["blobs"][layer.blob]["fetched_bytes"] == want
        # Byte ranges work too.
        ranges = tmp_path / "ranges.json"
        ranges.write_text(json.dumps([[0, 1], [layer.size - 1, 1]]))
        r = layerctl("prefetch", "--cache", str(tmp_path / "cache2"), layer.blob, "--ranges", str(ranges), "--wait")
        assert r.code == 0, r.err


def test_store_directory_disappears(store_dir: Path, layer: BuiltLayer, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    want = layer.path.read_bytes()
    big = next(r for r in layer.refs if not r.metadata and r.length >= 65536)
    other = next(r for r in reversed(layer.refs) if not r.metadata and r.digest != big.digest and r.length >= 8192)
    with DaemonProcess(str(store_dir), cache, tmp_path / "mnt", "--fetch-deadline", "1") as d:
        path = d.blob(layer.blob)
        fd = os.open(path, os.O_RDONLY)
        try:
            assert os.pread(fd, 4096, big.offset) == want[big.offset:big.offset + 4096]
            moved = store_dir.with_name("store-away")
            store_dir.rename(moved)
            try:
                assert os.pread(fd, 4096, big.offset + 4096) == want[big.offset + 4096:big.offset + 8192]
                assert read_errno(path, other.offset, 4096) == errno.EIO
                assert d.proc is not None and d.proc.poll() is None
                assert d.stats()["store_errors"] > 0
            finally:
                moved.rename(store_dir)
            assert os.pread(fd, 4096, other.offset) == want[other.offset:other.offset + 4096]
        finally:
            os.close(fd)


def test_kill9_mid_read_loop_then_restart(store_dir: Path, src: Path, layer: BuiltLayer, tmp_path: Path) -> None:
    cache, mnt = tmp_path / "cache", tmp_path / "mnt"
    want = layer.path.read_bytes()
    stop = threading.Event()
    failures: list[BaseException] = []
    dead_errnos: list[int] = []

    def reader(seed: int, path: Path) -> None:
        rng = random.Random(seed)
        buf = mmap.mmap(-1, 128 * 1024)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError as e:
            failures.append(e)
            return
        try:
            while not stop.is_set():
                off = rng.randrange(0, len(want) // 4096) * 4096
                try:
                    n = os.preadv(fd, [buf], off)
                except OSError as e:
                    dead_errnos.append(e.errno or 0)
                    return
                if buf[:n] != want[off:off + n]:
                    failures.append(AssertionError(f"wrong bytes at {off}"))
                    return
        finally:
            with contextlib.suppress(OSError):  # close flushes: ENOTCONN once the daemon is dead
                os.close(fd)
            buf.close()

    d = DaemonProcess(str(store_dir), cache, mnt)
    emnt_ctx = None
    try:
        d.start()
        emnt_ctx = mounted_erofs(d.blob(layer.blob))
        emnt = emnt_ctx.__enter__()
        threads = [threading.Thread(target=reader, args=(k, d.blob(layer.blob))) for k in range(4)]
        for t in threads:
            t.start()
        def some_committed() -> bool:
            fetched = d.stats()["blobs"].get(layer.blob, {}).get("fetched_bytes", 0)
            return fetched > 2 << 20 and request_json(cache, "GET", "/cache")["journal"]["chunk_records"] > 0

        wait_until(some_committed, 30, "the readers to fetch (and the journal to commit) some chunks")
        d.kill9()
        for t in threads:
            t.join(30)
        stop.set()
        assert not failures, failures
        # The dead mount answers ENOTCONN, loudly; the EROFS mount on top of it must be remounted.
        with pytest.raises(OSError) as ei:
            os.listdir(mnt / "blobs")
        assert ei.value.errno == errno.ENOTCONN
        with pytest.raises(OSError):
            (emnt / "big0.bin").read_bytes()
        emnt_ctx.__exit__(None, None, None)
        emnt_ctx = None

        # A new daemon on the same cache and mountpoint: it detaches the dead mount itself.
        d2 = DaemonProcess(str(store_dir), cache, mnt)
        with d2:
            r = layerctl("cache", "verify", "--cache", str(cache), "--json")
            assert r.code == 0 and r.json()["bad"] == [], r.out
            assert r.json()["checked"] > 0
            with mounted_erofs(d2.blob(layer.blob)) as emnt2:
                assert_trees_equal(snapshot_tree(src, root_meta=False), snapshot_tree(emnt2, root_meta=False))
            assert d2.blob(layer.blob).read_bytes() == want
    finally:
        stop.set()
        if emnt_ctx is not None:
            emnt_ctx.__exit__(None, None, None)
        d.cleanup()
        force_unmount(mnt)
