"""The fanotify data path when its processes die (docs/fanotify.md, "Every process of ours killed",
"Attach failures", "Who holds what"): an attach failure is loud; a restart re-hashes the
recovered metadata before the attach answers again; the shim's watch makes a new group with the
attached files marked when holder and daemon are both killed, then a daemon, and reads return the
right bytes; the service manager's fd store keeps the group through every process of ours; an
unclaimed holder with nothing marked or attached exits on its own."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

import pytest
from testkit.erofs_helpers import assert_trees_equal, snapshot_tree
from testkit.fanotify_cycles import remount_cold
from testkit.fanotify_helpers import (
    NotifySocket,
    holder_marks,
    mounted_layer,
    needs_fanotify,
    node_daemon,
    read_uncached,
    shim_node,
    start_daemon,
    start_daemon_from_fd_store,
    start_recorded,
    stop_holder,
)
from testkit.fanotify_readers import verify_in_child
from testkit.fuse_helpers import CountingBackend, DaemonProcess, force_unmount, make_tree, wait_until

from erofs_builder.build import BuiltLayer
from fuse_client.control import attach, detach, request_json
from fuse_client.fanotify import handover
from fuse_client.nodecache.files import BlobFiles
from layerstore.errors import LayerstoreError
from layerstore.linux import MountError, mount_erofs, umount

pytestmark = [pytest.mark.root, needs_fanotify]


@pytest.fixture
def src(tmp_path: Path) -> Path:
    return make_tree(tmp_path / "src", small=30, big=(3 << 20,))


def _record(state):  # type: ignore[no-untyped-def]
    with state.read() as t:
        return t.daemon()


def _holder_gone(cache: Path, pid: int) -> bool:
    return handover.proc_start_time(pid) is None


def test_an_attach_failure_is_loud_and_an_idle_holder_exits(backend: CountingBackend, layer: BuiltLayer,
                                                            tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAYERSTORE_FANOTIFY_HOLDER_IDLE", "1")
    missing = "b3:" + "ab" * 32  # (well formed, not in the store)
    with node_daemon(backend.url, tmp_path, "fanotify") as ds:
        d = ds[-1]
        with pytest.raises(LayerstoreError):
            attach(d.cache_dir, missing, "test")
        fan = d.stats()["fanotify"]
        assert fan["attach_failures"] == 1 and missing in fan["attach_failed"], fan
        assert "served over FUSE" in d.log_text()
        assert attach(d.cache_dir, layer.blob, "test") is not None
        ident = handover.read_identity(d.cache_dir)
        assert ident is not None
        assert holder_marks(d.cache_dir) == 1
        detach(d.cache_dir, layer.blob, "test")
        assert holder_marks(d.cache_dir) == 0
        d.kill9()  # (a clean stop would tell it to quit: here nobody does)
        wait_until(lambda: _holder_gone(d.cache_dir, ident[0]), 20, "the unclaimed holder to exit")


def test_a_restart_rehashes_recovered_metadata_before_attaching(backend: CountingBackend, src: Path,
                                                                 layer: BuiltLayer, tmp_path: Path) -> None:
    """Bytes of a metadata chunk changed on disk while attached (EROFS reads metadata with no
    event): the next daemon re-hashes every recovered chunk of an attached blob before its attach
    answers, finds it, and writes the verified bytes back."""
    meta = next(r for r in layer.refs if r.metadata)
    good = (tmp_path / "image.erofs").read_bytes()[meta.offset:meta.offset + meta.length]
    with node_daemon(backend.url, tmp_path, "fanotify") as ds:
        cache = ds[-1].cache_dir
        attach(cache, layer.blob, "test")
        data = BlobFiles(cache).path(layer.blob)
        fd = os.open(data, os.O_WRONLY)  # (raises an event: the daemon allows it, the chunk is present)
        try:
            os.pwrite(fd, bytes([good[100] ^ 0xFF]), meta.offset + 100)
        finally:
            os.close(fd)
        ds[-1].kill9()
        ds.append(start_daemon(backend.url, cache, tmp_path / "mnt", "fanotify"))
        assert request_json(cache, "GET", "/cache")["corrupt_cached_chunks"] >= 1
        with open(data, "rb") as f:
            assert f.read()[meta.offset:meta.offset + meta.length] == good
        with mounted_layer(ds[-1], layer.blob, "fanotify", tmp_path) as mnt:
            assert_trees_equal(snapshot_tree(src, root_meta=False), snapshot_tree(mnt, root_meta=False))


def test_the_watch_regroups_then_restarts_after_holder_and_daemon_killed(
        backend: CountingBackend, src: Path, layer: BuiltLayer, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The shim's watch (runtime_shim.supervise.daemon) sees both pidfds end: a new group with the attached
    file marked (before any daemon runs), then a daemon; the old mount's reads return the right
    bytes (filled on the new group's events, never zeros). Then `daemon-upgrade` replaces the
    daemon: the watch adopts the new one into the shim's record instead of starting another."""
    from fuse_client.fanotify.upgrade import upgrade
    from runtime_shim.supervise.daemon import is_alive

    paths, sup, state = shim_node(tmp_path, monkeypatch, "fanotify")
    rec = None
    target = tmp_path / "layer"
    target.mkdir()
    try:
        rec = start_recorded(sup, state, backend.url)
        assert sup.watch_pid() is not None
        got = attach(paths.cache, layer.blob, "test")
        assert got is not None
        mount_erofs(Path(got["path"]), target)  # (cold: only the metadata attached)
        old = handover.read_identity(paths.cache)
        assert old is not None
        os.kill(rec.pid, 9)
        os.kill(old[0], 9)

        def restarted() -> bool:
            with state.read() as t:
                cur = t.daemon()
            ident = handover.read_identity(paths.cache)
            return cur is not None and cur.pid != rec.pid and ident is not None and ident[1] != old[1]

        wait_until(restarted, 60, "the watch to make a new group and start a daemon")
        assert holder_marks(paths.cache) >= 1  # the attached file marked on the new group
        verify_in_child(target, src, [Path("big0.bin")])  # (a deadline: a stuck read fails the test)
        # An upgrade replaces the daemon behind the shim's back: the watch adopts the new one.
        wait_until(lambda: (cur := _record(state)) is not None and is_alive(cur), 60, "the new record")
        new_pid = upgrade(paths.cache, log=tmp_path / "upgraded.log")["new_pid"]
        wait_until(lambda: (cur := _record(state)) is not None and cur.pid == new_pid, 30, "the watch to adopt it")
        # An attached blob is never evicted (window 7): detached, evicted, attached again, and the
        # new daemon fills it.
        assert remount_cold(paths.cache, layer.blob, target) > 0
        verify_in_child(target, src, [Path("big0.bin")])  # (a deadline: a stuck read fails the test)
        assert request_json(paths.cache, "GET", "/stats")["fanotify"]["filled"] >= 1
        rec = _record(state)
    finally:
        with contextlib.suppress(OSError, MountError):  # (detached already: a read deadline)
            umount(target, lazy=True)
        with contextlib.suppress(Exception):
            detach(paths.cache, layer.blob, "test")
        sup.stop(rec)
        stop_holder(paths.cache)
        state.close()
        force_unmount(paths.fuse)


def test_the_fd_store_keeps_the_group_through_every_process_killed(backend: CountingBackend, src: Path,
                                                                   layer: BuiltLayer, tmp_path: Path) -> None:
    """With a service manager's fd store (a stand-in socket here; PID 1 on a systemd node) holding
    a copy, killing the daemon and the holder leaves the group alive: a read in the gap waits (no
    zeros), the next daemon gets the group back (the same generation) and the read completes."""
    cache, target = tmp_path / "cache", tmp_path / "layer"
    target.mkdir()
    notify = NotifySocket(tmp_path / "notify.sock")
    d = DaemonProcess(backend.url, cache, tmp_path / "mnt",
                      env={"LAYERSTORE_DATA_PATH": "fanotify", "NOTIFY_SOCKET": str(notify.path)})
    proc = None
    got: list[bytes | BaseException] = []
    reader = None
    try:
        d.start()
        path = Path(attach(cache, layer.blob, "test")["path"])  # type: ignore[index]
        name, stored = notify.receive()
        generation = handover.holder_generation(cache)
        assert generation == "fanotify:" + name.removeprefix("fanotify-")
        mount_erofs(path, target)  # (cold: only the metadata attached)
        ident = handover.read_identity(cache)
        assert ident is not None
        d.kill9()
        os.kill(ident[0], 9)
        wait_until(lambda: _holder_gone(cache, ident[0]), 10, "the holder to die")

        def read() -> None:
            try:
                got.append(read_uncached(target / "big0.bin"))
            except BaseException as e:
                got.append(e)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()  # (waits in the kernel: the group lives in the fd store only)
        proc = start_daemon_from_fd_store(backend.url, cache, tmp_path / "mnt", stored, name, tmp_path / "d2.log")
        reader.join(60)
        assert got and got[0] == (src / "big0.bin").read_bytes()
        assert handover.holder_generation(cache) == generation  # the same group, a new holder
    finally:
        if reader is not None:
            reader.join(5)
        with contextlib.suppress(OSError, MountError):  # (detached already: a read deadline)
            umount(target, lazy=True)
        if proc is not None:
            with contextlib.suppress(Exception):
                detach(cache, layer.blob, "test")
            proc.terminate()
            proc.wait(30)
        d.cleanup()
        stop_holder(cache)
        notify.close()
        force_unmount(tmp_path / "mnt")
