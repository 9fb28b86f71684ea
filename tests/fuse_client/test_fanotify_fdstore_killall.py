"""The default data path under a service manager (docs/fanotify.md, "Every process of ours
killed", layer 1): a stand-in manager (`testkit.fdstore_manager`, playing PID 1: never killed)
keeps the group in its fd store and restarts the daemon on failure with the stored fd, as systemd
does for the shipped unit. With no `$LAYERSTORE_DATA_PATH` the daemon picks fanotify because of
the fd store; killing the daemon and the holder together with -9 while a read of an unfilled range
is due leaves that read waiting, and it completes with the right bytes (never zeros) once the
manager's next daemon has the group back."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from testkit.fanotify_helpers import needs_fanotify, read_uncached, stop_holder, unmount_and_detach
from testkit.fdstore_manager import FdStoreManager
from testkit.fuse_helpers import CountingBackend, make_tree, wait_until

from erofs_builder.build import BuiltLayer
from fuse_client.control import attach, request_json
from fuse_client.fanotify import handover
from layerstore.linux import mount_erofs

pytestmark = [pytest.mark.root, needs_fanotify]


@pytest.fixture
def src(tmp_path: Path) -> Path:
    return make_tree(tmp_path / "src", small=10, big=(3 << 20,))


def test_default_path_under_a_manager_a_read_in_the_kill_all_gap_waits_and_is_right(
        backend: CountingBackend, src: Path, layer: BuiltLayer, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LAYERSTORE_DATA_PATH", raising=False)
    cache, target = tmp_path / "cache", tmp_path / "layer"
    target.mkdir()
    # (a restart delay long enough that the read below surely starts while no daemon runs)
    mgr = FdStoreManager(backend.url, cache, tmp_path / "mnt", tmp_path, restart_sec=1.5)
    got: list[bytes | BaseException] = []
    reader = None
    try:
        first = mgr.start()
        stats = request_json(cache, "GET", "/stats")
        assert stats["data_path"] == "fanotify", stats["data_path_reason"]
        assert "fd store" in stats["data_path_reason"], stats["data_path_reason"]
        assert "LAYERSTORE_DATA_PATH unset" in stats["data_path_reason"]
        path = Path(attach(cache, layer.blob, "test")["path"])  # type: ignore[index]
        name = mgr.wait_stored()
        generation = handover.holder_generation(cache)
        assert generation == "fanotify:" + name.removeprefix("fanotify-")
        mount_erofs(path, target)  # (cold: only the metadata attached)
        ident = handover.read_identity(cache)
        assert ident is not None
        os.kill(first, 9)  # the daemon and the holder at once; the manager (this process) lives
        os.kill(ident[0], 9)
        wait_until(lambda: handover.proc_start_time(ident[0]) is None and len(mgr.exits) >= 1, 10,
                   "the daemon and the holder to die")
        assert mgr.pid() == first  # (no successor yet)

        def read() -> None:
            try:
                got.append(read_uncached(target / "big0.bin"))
            except BaseException as e:
                got.append(e)

        started = time.monotonic()
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        second = mgr.wait_answering(not_pid=first)
        assert mgr.starts[-1][0] > started  # the read began in the gap: no daemon, no holder
        reader.join(60)
        assert got and got[0] == (src / "big0.bin").read_bytes()
        assert mgr.starts[-1][2] == 1  # the stored group handed back at fd 3
        assert handover.holder_generation(cache) == generation  # the same group, a new holder
        stats = request_json(cache, "GET", "/stats")
        assert stats["pid"] == second and stats["data_path"] == "fanotify"
        assert stats["fanotify"]["filled"] >= 1  # (the successor filled what the read needed)
    finally:
        if reader is not None:
            reader.join(5)
        unmount_and_detach(cache, layer.blob, "test", target)
        mgr.close()
        stop_holder(cache)
