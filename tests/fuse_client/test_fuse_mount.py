"""Real kernel: the daemon (in-process, so the store can be wrapped) mounted with FUSE, and EROFS
images mounted file-backed from MOUNTPOINT/blobs/<digest>."""

from __future__ import annotations

import errno
import json
import logging
import mmap
import os
import random
import threading
from pathlib import Path

import pytest
from testkit.erofs_helpers import assert_trees_equal, mounted_erofs, snapshot_tree
from testkit.fuse_helpers import CountingBackend, DaemonThread, make_tree, read_errno, wait_until

from erofs_builder.build import BuiltLayer
from fuse_client.control import request_json
from fuse_client.fuse.mount import DEFAULT_KERNEL_READAHEAD_KB
from layerstore import keys, linux
from layerstore.store import Store

pytestmark = pytest.mark.root


@pytest.fixture
def src(tmp_path: Path) -> Path:
    return make_tree(tmp_path / "src", small=60, big=(5 << 20, 3 << 20 | 12345))


def test_erofs_on_fuse_equals_source(store: Store, src: Path, layer: BuiltLayer, tmp_path: Path) -> None:
    with DaemonThread(store, tmp_path / "cache", tmp_path / "mnt") as d:
        blob = d.blob(layer.blob)
        assert blob.stat().st_size == layer.size
        with mounted_erofs(blob) as mnt:
            assert_trees_equal(snapshot_tree(src, root_meta=False), snapshot_tree(mnt, root_meta=False))
        # The raw blob too, byte for byte.
        assert blob.read_bytes() == layer.path.read_bytes()
        # Nothing is writable.
        with pytest.raises(OSError) as ei:
            os.open(blob, os.O_WRONLY)
        assert ei.value.errno == errno.EROFS
        with pytest.raises(OSError) as ei:
            (d.mountpoint / "blobs" / "new").write_bytes(b"x")
        assert ei.value.errno == errno.EROFS
        assert read_errno(d.blob("b3:" + "1" * 64)) == errno.ENOENT


@pytest.mark.usefixtures("cache_format")
def test_erofs_directio_on_fuse_equals_source(store: Store, src: Path, layer: BuiltLayer, tmp_path: Path) -> None:
    """`-o directio` (what docs/benchmarks-read.md recommends to the shim): every EROFS page-cache
    miss is a FUSE request, metadata still goes through the pushed page cache; cold, then again
    over the filled cache with a fresh mount."""
    with DaemonThread(store, tmp_path / "cache", tmp_path / "mnt") as d:
        for _ in range(2):
            with mounted_erofs(d.blob(layer.blob), "directio") as mnt:
                assert_trees_equal(snapshot_tree(src, root_meta=False), snapshot_tree(mnt, root_meta=False))
        st = d.stats()["blobs"][layer.blob]
        assert st["fetched_bytes"] <= layer.size and st["hits"] > 0


def _fuse_bdi(mountpoint: Path) -> Path:
    ra = linux.bdi_read_ahead_kb(mountpoint)
    assert ra is not None
    return Path(ra).parent


def test_kernel_readahead_survives_fuse_init(store: Store, layer: BuiltLayer, tmp_path: Path) -> None:
    """The FUSE_INIT answer clamps the mount's readahead to what the kernel offered (128 KiB):
    the daemon sets it after INIT, so buffered sequential reads arrive as 1 MiB requests."""
    with DaemonThread(store, tmp_path / "cache", tmp_path / "mnt") as d:
        assert (_fuse_bdi(d.mountpoint) / "read_ahead_kb").read_text().strip() == str(DEFAULT_KERNEL_READAHEAD_KB)
        want = layer.path.read_bytes()
        path = d.blob(layer.blob)
        assert path.read_bytes() == want  # buffered, fresh page cache: readahead makes the requests
        st = d.stats()["blobs"][layer.blob]
        requests = st["hits"] + st["misses"]
        assert requests <= len(want) // (512 * 1024) + 4, (requests, len(want))  # 128 KiB would be 4x more


def test_a_metadata_read_pushes_its_chunk_into_the_page_cache(store: Store, layer: BuiltLayer,
                                                             tmp_path: Path) -> None:
    """EROFS reads metadata a page at a time: the first page read of a metadata chunk makes the
    daemon push the whole chunk to the kernel, so the chunk's other pages need no request."""
    ref = max((r for r in layer.refs if r.metadata), key=lambda r: r.length)
    assert ref.length >= 3 * 4096
    want = layer.path.read_bytes()
    with DaemonThread(store, tmp_path / "cache", tmp_path / "mnt") as d:
        fd = os.open(d.blob(layer.blob), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no kernel readahead: one page, one request
            assert os.pread(fd, 4096, ref.offset) == want[ref.offset:ref.offset + 4096]
            wait_until(lambda: d.call(lambda: d.daemon.stats.metadata_pushes) >= 1, 10, "the metadata push")
            st = d.stats()["blobs"][layer.blob]
            before = st["hits"] + st["misses"]
            last = ref.offset + (ref.length - 1) // 4096 * 4096
            assert os.pread(fd, 4096, last) == want[last:last + 4096]
            st = d.stats()["blobs"][layer.blob]
            assert st["hits"] + st["misses"] == before  # from the page cache
        finally:
            os.close(fd)
        # The pushed bytes are the blob's bytes, as a reader with a fresh page cache sees them.
        assert d.blob(layer.blob).read_bytes() == want


def test_lazy_fetches_metadata_plus_the_file(store: Store, layer: BuiltLayer, tmp_path: Path) -> None:
    meta_bytes = sum(r.length for r in layer.refs if r.metadata)
    max_data_chunk = max(r.length for r in layer.refs if not r.metadata)
    assert meta_bytes > 0
    with DaemonThread(store, tmp_path / "cache", tmp_path / "mnt") as d, mounted_erofs(d.blob(layer.blob)) as mnt:
        want = (layer.path.parent / "src" / "d1" / "small1.txt").read_bytes()
        assert (mnt / "d1" / "small1.txt").read_bytes() == want
        st = d.stats()["blobs"][layer.blob]
        ls = request_json(d.cache_dir, "GET", "/cache")
        (entry,) = ls["blobs"]
        data_chunks = entry["cached_chunks"] - sum(1 for r in layer.refs if r.metadata)
        assert st["fetched_bytes"] <= meta_bytes + max_data_chunk, (st, meta_bytes)
        assert data_chunks <= 1
        assert st["fetched_bytes"] * 4 < layer.size


def test_single_flight_through_the_kernel(store: Store, backend: CountingBackend, layer: BuiltLayer,
                                          tmp_path: Path) -> None:
    """64 concurrent readers of a cold blob: each chunk fetched from the store exactly once."""
    want = layer.path.read_bytes()
    errors: list[BaseException] = []
    barrier = threading.Barrier(64)
    with DaemonThread(store, tmp_path / "cache", tmp_path / "mnt", fetch_concurrency=8) as d:
        path = d.blob(layer.blob)

        def reader(k: int) -> None:
            try:
                rng = random.Random(k)
                offs = list(range(0, len(want), 256 * 1024))
                rng.shuffle(offs)
                fd = os.open(path, os.O_RDONLY)
                try:
                    barrier.wait()
                    for off in offs:
                        got = os.pread(fd, 256 * 1024, off)
                        assert got == want[off:off + 256 * 1024], (k, off)
                finally:
                    os.close(fd)
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=reader, args=(k,)) for k in range(64)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors[:3]
    loads = backend.chunk_loads()
    assert set(loads) == {store.chunk_key(dg) for dg in {r.digest for r in layer.refs}}
    assert set(loads.values()) == {1}, loads.most_common(3)


def _direct_reader(path: Path, want: bytes, rounds: int, seed: int, errors: list[BaseException]) -> None:
    """O_DIRECT reads bypass the page cache, so every read reaches the daemon."""
    try:
        rng = random.Random(seed)
        step = 128 * 1024
        buf = mmap.mmap(-1, step)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            for _ in range(rounds):
                off = rng.randrange(0, len(want) // 4096) * 4096
                n = os.preadv(fd, [buf], off)
                assert buf[:n] == want[off:off + n], (seed, off)
        finally:
            os.close(fd)
            buf.close()
    except BaseException as e:
        errors.append(e)


def test_budget_exceeded_with_active_readers(store: Store, layer: BuiltLayer, tmp_path: Path) -> None:
    want = layer.path.read_bytes()
    budget = 3 << 20
    errors: list[BaseException] = []
    with DaemonThread(store, tmp_path / "cache", tmp_path / "mnt", cache_size=budget, fetch_concurrency=4) as d:
        threads = [threading.Thread(target=_direct_reader, args=(d.blob(layer.blob), want, 150, k, errors))
                   for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors[:3]
        ls = request_json(d.cache_dir, "GET", "/cache")
        assert ls["evicted_chunks"] > 0
        low = ls["budget"]["low"]

        def settled() -> bool:
            # (an eviction in progress has lowered usage before its holes are punched)
            ls = request_json(d.cache_dir, "GET", "/cache")
            return ls["used_bytes"] <= low and ls["disk_bytes"] <= budget

        wait_until(settled, 20, "usage to fall under the low watermark")
        # Data still correct after all that eviction.
        assert d.blob(layer.blob).read_bytes() == want


def test_corrupt_chunk_eio_through_the_kernel(store: Store, backend: CountingBackend, layer: BuiltLayer,
                                              tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    idx, ref = next((i, r) for i, r in enumerate(layer.refs) if not r.metadata and r.length > 8192)
    obj = backend.inner.root / keys.object_key("chunks", ref.digest)  # type: ignore[attr-defined]
    good = obj.read_bytes()
    obj.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    with caplog.at_level(logging.ERROR), DaemonThread(store, tmp_path / "cache", tmp_path / "mnt") as d:
        assert read_errno(d.blob(layer.blob), ref.offset, 4096) == errno.EIO
        stats = d.stats()
        assert stats["corrupt_chunks"] >= 1  # the kernel may retry a failed readahead once
        assert any(layer.blob in m and f"chunk {idx}" in m for m in caplog.messages), caplog.messages
        obj.write_bytes(good)
        fd = os.open(d.blob(layer.blob), os.O_RDONLY)
        try:
            assert os.pread(fd, 4096, ref.offset) == layer.path.read_bytes()[ref.offset:ref.offset + 4096]
        finally:
            os.close(fd)


def test_trace_written_periodically(store: Store, layer: BuiltLayer, tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    with DaemonThread(store, tmp_path / "cache", tmp_path / "mnt", record_trace=trace, trace_interval=0.05) as d:
        fd = os.open(d.blob(layer.blob), os.O_RDONLY)
        try:
            os.pread(fd, 10, layer.size - 10)
            os.pread(fd, 10, 0)
        finally:
            os.close(fd)

        def written() -> bool:
            # A snapshot taken between the two reads holds only the first: wait for both.
            try:
                return len(json.loads(trace.read_text())["blobs"].get(layer.blob, [])) >= 2
            except (OSError, ValueError):
                return False

        wait_until(written, 20, "the trace to be written while the daemon runs")
        doc = json.loads(trace.read_text())
        assert doc["version"] == 1 and list(doc["blobs"]) == [layer.blob]
        # First-access order (kernel readahead may add the chunks after each read).
        assert doc["blobs"][layer.blob][:2] == [len(layer.refs) - 1, 0]


def test_control_socket_errors_and_metrics(store: Store, layer: BuiltLayer, tmp_path: Path) -> None:
    from fuse_client.control import request
    from layerstore.errors import ConfigError, LayerstoreError, NotFound

    with DaemonThread(store, tmp_path / "cache", tmp_path / "mnt") as d:
        with pytest.raises(LayerstoreError, match="no route"):
            request(d.cache_dir, "GET", "/nope")
        with pytest.raises(ConfigError):
            request(d.cache_dir, "POST", "/prefetch", {"blob": "not-a-digest"})
        with pytest.raises(NotFound):
            request(d.cache_dir, "POST", "/prefetch", {"blob": "b3:" + "2" * 64})
        res = request_json(d.cache_dir, "POST", "/prefetch", {"blob": layer.blob, "wait": True})
        assert res["queued"] == sum(r.metadata for r in layer.refs) and res["failed"] == 0
        _, text = request(d.cache_dir, "GET", "/metrics")
        assert b'layerstore_fuse_fetch_seconds_count{priority="prefetch"}' in text
        assert b"layerstore_fuse_cache_used_bytes" in text
