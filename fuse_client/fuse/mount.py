"""The FUSE session of the daemon: mount `BlobFS` (pyfuse3 allows one per process), run its loop,
raise the kernel readahead of the mount once FUSE_INIT is done, stop with a grace period, wait
for metadata pushes, unmount. Also the clean-up of a dead mount left by a killed daemon.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

import pyfuse3
import trio

from layerstore import linux
from layerstore.errors import ConfigError

from .fs import BlobFS

log = logging.getLogger("layerstore.fuse.daemon")

SHUTDOWN_GRACE = 5.0
# The kernel's readahead on our FUSE files (buffered readers, e.g. EROFS without `directio`):
# requests of up to 1 MiB (libfuse 3.14 negotiates max_pages = 256) instead of 128 KiB cut the
# requests per byte by 8, and a 4 MiB window keeps up to four of them in flight ahead of a
# sequential reader, so the daemon reads the next ones from its cache while the reader works
# (walk + hash of small files, warm: 0.84 -> 0.88 of EROFS on a local file, 16 paired rounds).
# Set after FUSE_INIT (see `after_fuse_init`).
DEFAULT_KERNEL_READAHEAD_KB = 4096
INIT_WAIT = 10.0


def fuse_options(*, allow_other: bool = False) -> set[str]:
    """The mount options: read-only, the kernel checking the modes `BlobFS` gives
    (default_permissions); `allow_other` lets users other than the daemon's reach the mount at
    all (only for a control group's members: `DaemonConfig.fuse_options`)."""
    opts = set(pyfuse3.default_options) | {"fsname=layerstore", "subtype=layerstore", "ro", "default_permissions"}
    if allow_other:
        opts.add("allow_other")
    return opts


def clear_dead_mount(mountpoint: Path) -> None:
    """A daemon killed with -9 leaves its mount behind, answering ENOTCONN: detach it."""
    try:
        if linux.clear_dead_fuse(mountpoint):
            log.warning("%s: detached the dead FUSE mount of a previous daemon", mountpoint)
    except linux.MountError as e:
        raise ConfigError(str(e)) from None


def set_kernel_readahead(mountpoint: Path, kb: int) -> None:
    """Set read_ahead_kb of the FUSE mount's backing device info (best effort)."""
    try:
        path = linux.bdi_read_ahead_kb(mountpoint)
        if path is not None:
            Path(path).write_text(f"{kb}\n")
    except OSError as e:
        log.warning("cannot set the kernel readahead of %s to %d KiB: %s", mountpoint, kb, e)


async def after_fuse_init(mountpoint: Path) -> None:
    """Return once the kernel has processed our answer to FUSE_INIT. That answer sets the
    mount's readahead to min(read_ahead_kb, max_readahead), and the kernel offers the bdi's
    value at the time of mounting (128 KiB) as max_readahead: a larger value written before
    INIT is undone by it. A statfs from a worker thread waits until INIT is done and is then
    answered by our own loop (the trio thread is free while we wait)."""
    with trio.move_on_after(INIT_WAIT):
        try:
            await trio.to_thread.run_sync(os.statvfs, mountpoint, abandon_on_cancel=True)
        except OSError as e:
            log.warning("statfs on %s after mounting: %s", mountpoint, e)


class FuseMount:
    """One FUSE session: `open` mounts, `run` serves until unmounted (from outside, or after
    `terminate`), `close` waits for metadata pushes and unmounts (always call it)."""

    def __init__(self, ops: BlobFS, mountpoint: Path, options: set[str]) -> None:
        self.ops = ops
        self.mountpoint = Path(mountpoint)
        self.options = options
        self.done = trio.Event()

    def open(self) -> None:
        pyfuse3.init(self.ops, os.fspath(self.mountpoint), self.options)

    async def run(self, on_exit: Callable[[], None]) -> None:
        """The FUSE loop; `on_exit` is called when it ends (e.g. someone ran fusermount -u)."""
        try:
            await pyfuse3.main()
        finally:
            self.done.set()
            on_exit()

    async def set_readahead(self, kb: int) -> None:
        """Raise the kernel readahead of the mount to `kb` KiB, once FUSE_INIT is done (with
        `run` running)."""
        await after_fuse_init(self.mountpoint)
        set_kernel_readahead(self.mountpoint, kb)

    async def terminate(self, grace: float = SHUTDOWN_GRACE) -> None:
        """End the loop; requests in progress get `grace` seconds."""
        if not self.done.is_set():
            pyfuse3.terminate()
            with trio.move_on_after(grace):
                await self.done.wait()

    async def close(self) -> None:
        with trio.CancelScope(shield=True):
            await self.ops.stop_pushes()
        with contextlib.suppress(Exception):
            pyfuse3.close(unmount=True)
