"""Helpers for the tests over both data paths (FUSE, fanotify: docs/fanotify.md): a node daemon
as a subprocess with its data path forced, the image file a layer is mounted from on each path,
and cleanup of the fanotify holder (started by the daemon) even when a test fails.

The daemon runs in another process: on the fanotify path the daemon allows its own process's
accesses without a fill, so whatever reads a mount must not be the daemon.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fuse_client.control import attach, detach
from fuse_client.fanotify import handover, kernel
from fuse_client.linux import mount_erofs, umount

from .fuse_helpers import DaemonProcess, force_unmount

FANOTIFY_WHY = kernel.probe("/var/tmp") if os.geteuid() == 0 else "not root"
needs_fanotify = pytest.mark.skipif(FANOTIFY_WHY is not None, reason=f"no fanotify pre-content events: {FANOTIFY_WHY}")
DATA_PATHS = ["fuse", pytest.param("fanotify", marks=needs_fanotify)]


def stop_holder(cache_dir: Path) -> None:
    """Quit the fanotify holder of `cache_dir` (SIGKILL by its recorded pid if it does not)."""
    ident = handover.read_identity(cache_dir)
    handover.quit_holder(cache_dir)
    if ident is None:
        return
    end = time.monotonic() + 5
    while handover.proc_start_time(ident[0]) is not None and time.monotonic() < end:
        time.sleep(0.02)
    if handover.proc_start_time(ident[0]) is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(ident[0], signal.SIGKILL)


def start_daemon(store_url: str, cache_dir: Path, mountpoint: Path, data_path: str, *extra: str) -> DaemonProcess:
    return DaemonProcess(store_url, cache_dir, mountpoint, *extra,
                         env={"LAYERSTORE_DATA_PATH": data_path}).start()


@contextlib.contextmanager
def node_daemon(store_url: str, tmp: Path, data_path: str, *extra: str) -> Iterator[list[DaemonProcess]]:
    """A daemon on `data_path`; yields a list whose last item is the current daemon (a test that
    restarts it appends the new one). Every daemon, mount under `tmp` and holder are cleaned up."""
    daemons: list[DaemonProcess] = []
    try:
        daemons.append(start_daemon(store_url, tmp / "cache", tmp / "mnt", data_path, *extra))
        yield daemons
    finally:
        for d in daemons:
            with contextlib.suppress(Exception):
                d.cleanup()
        stop_holder(tmp / "cache")
        force_unmount(tmp / "mnt")


def image_for(d: DaemonProcess, blob: str, data_path: str, holder: str = "test") -> Path:
    """What a layer is mounted from: the daemon's FUSE file, or the attached cache file."""
    if data_path == "fuse":
        return d.blob(blob)
    got = attach(d.cache_dir, blob, holder)
    assert got is not None and got["data_path"] == "fanotify", got
    return Path(got["path"])


@contextlib.contextmanager
def mounted_layer(d: DaemonProcess, blob: str, data_path: str, tmp: Path) -> Iterator[Path]:
    """EROFS mounted from the blob's image on `data_path` at tmp/layer (unmounted, and detached,
    even on failure)."""
    target = tmp / "layer"
    target.mkdir(exist_ok=True)
    image = image_for(d, blob, data_path)
    mount_erofs(image, target)
    try:
        yield target
    finally:
        with contextlib.suppress(OSError):
            umount(target, lazy=True)
        if data_path == "fanotify":
            with contextlib.suppress(Exception):
                detach(d.cache_dir, blob, "test")


def read_uncached(path: Path) -> bytes:
    """A file's bytes with its page cache dropped first (so the read reaches the data path)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        parts = []
        while b := os.read(fd, 1 << 20):
            parts.append(b)
        return b"".join(parts)
    finally:
        os.close(fd)
