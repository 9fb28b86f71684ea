"""Real kernel, both data paths (FUSE: EROFS on the daemon's file; fanotify: EROFS on the node
cache's sparse file, filled on pre-content events; docs/fanotify.md): every file equal, laziness,
single-flight, a corrupt chunk and a store outage are EIO (never zeros), an evicted range is
fetched again; on fanotify, kill -9 of the daemon while sandboxes read: reads wait and complete."""

from __future__ import annotations

import errno
import os
import random
import threading
from pathlib import Path

import pytest
from testkit.erofs_helpers import assert_trees_equal, snapshot_tree
from testkit.fanotify_cycles import remount_cold
from testkit.fanotify_helpers import (
    DATA_PATHS,
    mounted_layer,
    needs_fanotify,
    node_daemon,
    read_uncached,
    start_daemon,
    stop_holder,
)
from testkit.fanotify_readers import reading_in_child, verify_in_child
from testkit.fuse_helpers import CountingBackend, make_tree

from erofs_builder.build import BuiltLayer
from fuse_client.control import request_json
from fuse_client.fanotify import handover
from fuse_client.nodecache.files import BlobFiles
from layerstore import keys

pytestmark = pytest.mark.root


@pytest.fixture
def src(tmp_path: Path) -> Path:
    return make_tree(tmp_path / "src", small=60, big=(3 << 20,))


def _unique_bytes(layer: BuiltLayer) -> int:
    return sum({r.digest: r.length for r in layer.refs}.values())


def _files(src: Path) -> list[Path]:
    return sorted(p.relative_to(src) for p in src.rglob("*") if p.is_file() and not p.is_symlink())


@pytest.mark.parametrize("data_path", DATA_PATHS)
def test_lazy_then_every_file_equal(backend: CountingBackend, src: Path, layer: BuiltLayer, tmp_path: Path,
                                    data_path: str) -> None:
    meta = sum(r.length for r in layer.refs if r.metadata)
    max_chunk = max(r.length for r in layer.refs if not r.metadata)
    with node_daemon(backend.url, tmp_path, data_path) as ds, mounted_layer(ds[-1], layer.blob, data_path,
                                                                            tmp_path) as mnt:
        assert (mnt / "d1" / "small1.txt").read_bytes() == (src / "d1" / "small1.txt").read_bytes()
        st = ds[-1].stats()
        assert st["data_path"] == data_path and st["data_path_reason"].startswith(data_path), st
        assert st["blobs"][layer.blob]["fetched_bytes"] <= meta + max_chunk  # metadata and one file
        assert_trees_equal(snapshot_tree(src, root_meta=False), snapshot_tree(mnt, root_meta=False))
        assert ds[-1].stats()["blobs"][layer.blob]["fetched_bytes"] <= _unique_bytes(layer)


@pytest.mark.parametrize("data_path", DATA_PATHS)
def test_single_flight_under_16_concurrent_readers(backend: CountingBackend, src: Path, layer: BuiltLayer,
                                                    tmp_path: Path, data_path: str) -> None:
    files = _files(src)
    errors: list[BaseException] = []
    barrier = threading.Barrier(16)
    with node_daemon(backend.url, tmp_path, data_path) as ds, mounted_layer(ds[-1], layer.blob, data_path,
                                                                            tmp_path) as mnt:
        def reader(k: int) -> None:
            try:
                order = files[:]
                random.Random(k).shuffle(order)
                barrier.wait()
                for rel in order:
                    assert (mnt / rel).read_bytes() == (src / rel).read_bytes(), rel
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=reader, args=(k,)) for k in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors[:3]
        # Each distinct chunk fetched once: a second fetch of any would add its length again.
        assert ds[-1].stats()["blobs"][layer.blob]["fetched_bytes"] == _unique_bytes(layer)


@pytest.mark.parametrize("data_path", DATA_PATHS)
def test_a_corrupt_chunk_is_eio_never_served(backend: CountingBackend, src: Path, layer: BuiltLayer,
                                             tmp_path: Path, data_path: str) -> None:
    ref = next(r for r in layer.refs if not r.metadata and r.offset >= 1 << 20 and r.length > 8192)
    obj = backend.inner.root / keys.object_key("chunks", ref.digest)  # type: ignore[attr-defined]
    good = obj.read_bytes()
    with node_daemon(backend.url, tmp_path, data_path) as ds, mounted_layer(ds[-1], layer.blob, data_path,
                                                                            tmp_path) as mnt:
        obj.chmod(0o644)
        obj.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
        with pytest.raises(OSError) as ei:
            (mnt / "big0.bin").read_bytes()
        assert ei.value.errno == errno.EIO
        assert ds[-1].stats()["corrupt_chunks"] >= 1
        obj.write_bytes(good)
        assert read_uncached(mnt / "big0.bin") == (src / "big0.bin").read_bytes()


@pytest.mark.parametrize("data_path", DATA_PATHS)
def test_a_store_outage_is_eio_then_reads_recover(backend: CountingBackend, src: Path, layer: BuiltLayer,
                                                  tmp_path: Path, data_path: str) -> None:
    root: Path = backend.inner.root  # type: ignore[attr-defined]
    with node_daemon(backend.url, tmp_path, data_path, "--fetch-deadline", "1") as ds, \
            mounted_layer(ds[-1], layer.blob, data_path, tmp_path) as mnt:
        root.rename(root.with_name("away"))
        try:
            with pytest.raises(OSError) as ei:
                (mnt / "big0.bin").read_bytes()
            assert ei.value.errno == errno.EIO
        finally:
            root.with_name("away").rename(root)
        assert read_uncached(mnt / "big0.bin") == (src / "big0.bin").read_bytes()


@needs_fanotify
def test_an_evicted_range_raises_events_again(backend: CountingBackend, src: Path, layer: BuiltLayer,
                                              tmp_path: Path) -> None:
    """Window 7 (docs/fanotify.md): while attached, an eviction request punches nothing of the blob
    (a read the daemon allowed may still be copying); complete, its mark is dropped. Detached (the
    shim unmounted it), it is evicted; attached again, the evicted ranges raise events again and
    are filled (never zeros)."""
    files = BlobFiles(tmp_path / "cache")
    with node_daemon(backend.url, tmp_path, "fanotify") as ds:
        d = ds[-1]
        with mounted_layer(d, layer.blob, "fanotify", tmp_path) as mnt:
            assert_trees_equal(snapshot_tree(src, root_meta=False), snapshot_tree(mnt, root_meta=False))
            request_json(d.cache_dir, "POST", "/prefetch", {"blob": layer.blob, "all": True, "wait": True})
            assert read_uncached(mnt / "big0.bin") == (src / "big0.bin").read_bytes()  # (a fill completes it)
            fan = d.stats()["fanotify"]
            assert fan["attached"][layer.blob]["marked"] is False and fan["unmarks"] >= 1
            held = files.allocated_bytes(layer.blob)
            for ask in ({"all": True}, {"blob": layer.blob}, {"to_bytes": 0}):
                res = request_json(d.cache_dir, "POST", "/cache/evict", ask)
                assert res["evicted_bytes"] == 0 and res["protected_bytes"] == layer.size, (ask, res)
                assert ("blob" not in ask) or "protected" in res["skipped"]
            assert files.allocated_bytes(layer.blob) == held  # nothing punched under the mount
            assert d.stats()["fanotify"]["unevictable_attached_bytes"] == layer.size
            assert read_uncached(mnt / "big0.bin") == (src / "big0.bin").read_bytes()
        # detached (unmounted): evictable again
        res = request_json(d.cache_dir, "POST", "/cache/evict", {"all": True})
        assert res["evicted_bytes"] == layer.size and res["protected_bytes"] == 0, res
        assert files.allocated_bytes(layer.blob) < held
        fetched = d.stats()["blobs"][layer.blob]["fetched_bytes"]
        filled = d.stats()["fanotify"]["filled"]
        with mounted_layer(d, layer.blob, "fanotify", tmp_path) as mnt:  # attached again: marked again
            assert d.stats()["fanotify"]["attached"][layer.blob]["marked"] is True
            assert read_uncached(mnt / "big0.bin") == (src / "big0.bin").read_bytes()
            st = d.stats()
            assert st["blobs"][layer.blob]["fetched_bytes"] > fetched
            assert st["fanotify"]["filled"] > filled


@needs_fanotify
def test_kill9_of_the_daemon_while_16_readers_read(backend: CountingBackend, src: Path, layer: BuiltLayer,
                                                   tmp_path: Path) -> None:
    """The group lives on in the holder: reads in the gap wait, the next daemon answers what the
    dead one had read (its journal) and the rest; no read fails, none returns wrong bytes. Each
    cycle starts on a cold mount (detached, evicted, attached again: an attached blob is never
    evicted) so that the readers need fills across the kill."""
    files = _files(src)
    errors: list[str] = []
    with node_daemon(backend.url, tmp_path, "fanotify") as ds, mounted_layer(ds[-1], layer.blob, "fanotify",
                                                                            tmp_path) as mnt:
        generation = handover.holder_generation(tmp_path / "cache")
        for cycle in range(2):  # (bench/daemon_restart.py: 100)
            if cycle:
                assert remount_cold(tmp_path / "cache", layer.blob, mnt) > 0
            # (readers and verification in child processes with a deadline: a read that never
            # returns fails the test with the stuck stacks instead of hanging the suite)
            with reading_in_child(mnt, src, files) as readers:
                readers.wait_reads(16)
                ds[-1].kill9()
                ds.append(start_daemon(backend.url, tmp_path / "cache", tmp_path / "mnt", "fanotify"))
                readers.wait_reads(32)
                # Every file once more, whole, through the new daemon: what the dead one left unfilled
                # is filled now. (Whether the readers themselves still needed fills after the kill
                # depends on the machine's speed: bench/daemon_restart.py counts the successors' fills.)
                verify_in_child(mnt, src, files)
            errors += readers.errors
        assert not errors, errors[:3]
        assert handover.holder_generation(tmp_path / "cache") == generation  # the same group throughout
        assert ds[-1].stats()["fanotify"]["attached"][layer.blob]["holders"] == ["test"]


@needs_fanotify
def test_holder_and_daemon_killed_new_group_new_generation_right_bytes(backend: CountingBackend, src: Path,
                                                                       layer: BuiltLayer, tmp_path: Path) -> None:
    """Every process holding the group killed: the next daemon makes a new group (a new
    generation: the shim remounts those layers) and marks the attached files again before it
    serves, so the old mount's holes are filled on events again, not read as zeros."""
    with node_daemon(backend.url, tmp_path, "fanotify") as ds, mounted_layer(ds[-1], layer.blob, "fanotify",
                                                                            tmp_path) as mnt:
        cache = tmp_path / "cache"
        old = handover.holder_generation(cache)
        ident = handover.read_identity(cache)
        assert old and ident
        ds[-1].kill9()
        os.kill(ident[0], 9)
        while handover.proc_start_time(ident[0]) is not None:
            threading.Event().wait(0.01)
        ds.append(start_daemon(backend.url, cache, tmp_path / "mnt", "fanotify"))
        new = handover.holder_generation(cache)
        assert new and new != old
        verify_in_child(mnt, src, [Path("big0.bin")])
    stop_holder(tmp_path / "cache")


@needs_fanotify
def test_daemon_upgrade_while_16_readers_read(backend: CountingBackend, src: Path, layer: BuiltLayer,
                                              tmp_path: Path) -> None:
    """`layerctl daemon-upgrade` (`fanotify.upgrade`): SIGTERM, the same arguments started again;
    reads in the gap wait and complete, none fails, none is wrong. The readers start on a cold
    mount (only metadata attached), and after the upgrade on a cold one again (detached, evicted,
    attached: the new daemon fills it)."""
    from fuse_client.fanotify.upgrade import upgrade

    files = _files(src)
    errors: list[str] = []
    new_pid = None
    with node_daemon(backend.url, tmp_path, "fanotify") as ds, mounted_layer(ds[-1], layer.blob, "fanotify",
                                                                            tmp_path) as mnt:
        try:
            for cycle in range(2):
                if cycle:
                    assert remount_cold(tmp_path / "cache", layer.blob, mnt) > 0
                with reading_in_child(mnt, src, files) as readers:  # (a deadline: see the kill -9 test)
                    if not cycle:
                        res = upgrade(tmp_path / "cache", log=tmp_path / "upgraded.log")
                        new_pid = res["new_pid"]
                        assert res["old_pid"] == ds[-1].pid and res["data_path"] == "fanotify"
                    readers.wait_reads(32)
                errors += readers.errors
            fan = request_json(tmp_path / "cache", "GET", "/stats")["fanotify"]
            assert fan["filled"] >= 1  # (the new daemon filled the cold mount)
        finally:
            if new_pid is not None:
                os.kill(new_pid, 15)
                os.waitpid(new_pid, 0)
        assert not errors, errors[:3]
