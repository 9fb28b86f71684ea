"""Daemon wiring: one function (`Daemon.serve`) builds the node cache, the fetcher, the FUSE
operations and the control socket from their parts, mounts, serves until told to stop, and
tears everything down in reverse order through one exit stack.

Shutdown (SIGTERM/SIGINT, `stop()`, or someone unmounting the mountpoint): stop the FUSE loop
(requests in progress get a grace period), wait for metadata pushes to the kernel, unmount, stop
the control socket, write the trace, commit the cache journal's last batch, close the index.
After kill -9 none of this runs: the mount is dead (ENOTCONN) and the next daemon lazily
unmounts it before mounting again; the cache needs no repair beyond what `NodeCache.recover` does
at every start.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import logging
import os
import resource
import signal
from dataclasses import dataclass
from pathlib import Path

import pyfuse3
import trio

from fuse_client import linux
from layerstore.errors import ConfigError, LayerstoreError

from .cache import NodeCache
from .cache_files import BlobFiles
from .cache_index import CacheIndex
from .control import ControlAPI, ControlServer, socket_path
from .eviction import DEFAULT_HIGH, DEFAULT_LOW, Budget
from .fetcher import DEFAULT_CONCURRENCY, DEFAULT_DEADLINE, ChunkSource, Fetcher
from .fs import DEFAULT_READAHEAD, BlobFS
from .stats import Stats
from .trace import TraceRecorder, write_trace

log = logging.getLogger("layerstore.fuse.daemon")

LOCK_NAME = "daemon.lock"
INDEX_DIR = "index"
TRACE_INTERVAL = 5.0
SHUTDOWN_GRACE = 5.0
# The kernel's readahead on our FUSE files (buffered readers, e.g. EROFS without `directio`):
# requests of up to 1 MiB (libfuse 3.14 negotiates max_pages = 256) instead of 128 KiB cut the
# requests per byte by 8, and a 4 MiB window keeps up to four of them in flight ahead of a
# sequential reader, so the daemon reads the next ones from its cache while the reader works
# (walk + hash of small files, warm: 0.84 -> 0.88 of EROFS on a local file, 16 paired rounds).
# Set after FUSE_INIT (see _after_fuse_init).
DEFAULT_KERNEL_READAHEAD_KB = 4096
INIT_WAIT = 10.0


class CacheBusy(LayerstoreError):
    """Another process (a daemon, or an offline cache command) holds the cache directory."""

    exit_code = 7


@dataclass
class DaemonConfig:
    cache_dir: Path
    mountpoint: Path
    cache_size: int | None = None
    high_watermark: float = DEFAULT_HIGH
    low_watermark: float = DEFAULT_LOW
    record_trace: Path | None = None
    trace_interval: float = TRACE_INTERVAL
    fetch_deadline: float = DEFAULT_DEADLINE
    fetch_concurrency: int = DEFAULT_CONCURRENCY
    readahead: int = DEFAULT_READAHEAD
    kernel_readahead_kb: int = DEFAULT_KERNEL_READAHEAD_KB
    allow_other: bool = True

    def budget(self) -> Budget | None:
        if self.cache_size is None:
            return None
        return Budget(self.cache_size, self.high_watermark, self.low_watermark)

    def fuse_options(self) -> set[str]:
        opts = set(pyfuse3.default_options) | {"fsname=layerstore", "subtype=layerstore", "ro"}
        if self.allow_other:
            opts.add("allow_other")  # sandboxes run as other users
        return opts


def lock_cache_dir(cache_dir: Path) -> int:
    """An exclusive, non-blocking flock on DIR/daemon.lock (the cache is node-local, so flock
    works). Returns the descriptor; closing it releases the lock."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(cache_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise CacheBusy(f"cache {cache_dir} is in use by another daemon or cache command") from None
        raise
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def open_cache(cache_dir: Path, budget: Budget | None, stack: contextlib.ExitStack) -> NodeCache:
    """Lock, open and recover the node cache (blocking); everything is closed by `stack`."""
    stack.callback(os.close, lock_cache_dir(cache_dir))
    index = CacheIndex(cache_dir / INDEX_DIR)
    stack.callback(index.close)
    cache = NodeCache.recover(cache_dir, BlobFiles(cache_dir), index, budget=budget)
    stack.callback(cache.close)
    return cache


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


async def _after_fuse_init(mountpoint: Path) -> None:
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


def raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


class Daemon:
    def __init__(self, config: DaemonConfig, store: ChunkSource) -> None:
        self.config = config
        self.store = store
        self.cache: NodeCache | None = None
        self.stats: Stats | None = None
        self.trace: TraceRecorder | None = None
        self._stop = trio.Event()
        self._token: trio.lowlevel.TrioToken | None = None

    def stop(self) -> None:
        """Ask the daemon to shut down (from the trio thread)."""
        self._stop.set()

    def stop_threadsafe(self) -> None:
        if self._token is not None:
            with contextlib.suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)

    async def serve(self, *, task_status: trio.TaskStatus[Daemon] = trio.TASK_STATUS_IGNORED) -> None:
        cfg = self.config
        self._token = trio.lowlevel.current_trio_token()
        cache_dir, mountpoint = Path(cfg.cache_dir).absolute(), Path(cfg.mountpoint).absolute()
        if not mountpoint.is_dir() and not linux.is_mount(mountpoint):
            raise ConfigError(f"mountpoint {mountpoint} is not a directory")
        with contextlib.ExitStack() as stack:
            cache = self.cache = await trio.to_thread.run_sync(
                functools.partial(open_cache, cache_dir, cfg.budget(), stack))
            stats = self.stats = Stats(gauges=functools.partial(_gauges, cache))
            trace = self.trace = TraceRecorder() if cfg.record_trace else None
            await trio.to_thread.run_sync(clear_dead_mount, mountpoint)
            async with trio.open_nursery() as service:
                await service.start(cache.run)
                fetcher = Fetcher(self.store, cache, stats, nursery=service, concurrency=cfg.fetch_concurrency,
                                  deadline=cfg.fetch_deadline)
                ops = BlobFS(fetcher, cache, stats, trace=trace, readahead=cfg.readahead, push_nursery=service)
                control = ControlServer(socket_path(cache_dir), ControlAPI(cache, fetcher, stats, nursery=service))
                try:
                    await self._serve_mounted(ops, mountpoint, control, task_status)
                finally:
                    with trio.CancelScope(shield=True):
                        if trace is not None and cfg.record_trace is not None:
                            await trio.to_thread.run_sync(write_trace, cfg.record_trace, trace.to_json())
                        await cache.shutdown_flush()
                    service.cancel_scope.cancel()
        log.info("daemon stopped")

    async def _serve_mounted(self, ops: BlobFS, mountpoint: Path, control: ControlServer,
                             task_status: trio.TaskStatus[Daemon]) -> None:
        pyfuse3.init(ops, os.fspath(mountpoint), self.config.fuse_options())
        try:
            async with trio.open_nursery() as front:
                fuse_done = trio.Event()

                async def fuse_main() -> None:
                    try:
                        await pyfuse3.main()
                    finally:
                        fuse_done.set()
                        self._stop.set()  # the mount went away (fusermount -u): stop too

                front.start_soon(fuse_main)
                if self.config.kernel_readahead_kb:
                    await _after_fuse_init(mountpoint)
                    set_kernel_readahead(mountpoint, self.config.kernel_readahead_kb)
                await front.start(control.serve)
                if self.trace is not None:
                    front.start_soon(self._trace_loop)
                log.info("serving blobs at %s/blobs (cache %s)", mountpoint, self.config.cache_dir)
                task_status.started(self)
                await self._stop.wait()
                if not fuse_done.is_set():
                    pyfuse3.terminate()
                    with trio.move_on_after(SHUTDOWN_GRACE):
                        await fuse_done.wait()
                front.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await ops.stop_pushes()
            with contextlib.suppress(Exception):
                pyfuse3.close(unmount=True)

    async def _trace_loop(self) -> None:
        assert self.trace is not None and self.config.record_trace is not None
        while True:
            await trio.sleep(self.config.trace_interval)
            if self.trace.dirty:
                self.trace.dirty = False
                try:
                    await trio.to_thread.run_sync(write_trace, self.config.record_trace, self.trace.to_json())
                except OSError as e:
                    log.error("cannot write the access trace %s: %s", self.config.record_trace, e)


def _gauges(cache: NodeCache) -> dict[str, float]:
    g: dict[str, float] = {
        "cache_used_bytes": cache.usage,
        "cache_blobs": len(cache.entries),
        "cache_busy_chunks": len(cache.busy),
        "cache_evicted_chunks": cache.evicted_chunks,
        "cache_evicted_bytes": cache.evicted_bytes,
    }
    if cache.budget is not None:
        g["cache_budget_bytes"] = cache.budget.size
        g["cache_high_watermark_bytes"] = cache.budget.high
        g["cache_low_watermark_bytes"] = cache.budget.low
    return g


def run(config: DaemonConfig, store: ChunkSource) -> None:
    """The foreground daemon of `layerctl daemon`: serve until SIGTERM or SIGINT."""
    raise_fd_limit()

    async def main() -> None:
        daemon = Daemon(config, store)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:

                async def watch() -> None:
                    async for sig in signals:
                        log.info("received %s, shutting down", signal.Signals(sig).name)
                        daemon.stop()

                nursery.start_soon(watch)
                try:
                    await daemon.serve()
                finally:
                    nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    except BaseExceptionGroup as eg:
        raise _sole_error(eg) from None


def _sole_error(eg: BaseExceptionGroup[BaseException]) -> BaseException:
    """The one expected error inside nested nursery groups, for the CLI's error edge (which
    prints one line for a `LayerstoreError`); anything else stays a group."""
    leaves: list[BaseException] = []

    def walk(e: BaseException) -> None:
        if isinstance(e, BaseExceptionGroup):
            for sub in e.exceptions:
                walk(sub)
        elif not isinstance(e, trio.Cancelled):
            leaves.append(e)

    walk(eg)
    if len(leaves) == 1 and isinstance(leaves[0], LayerstoreError | KeyboardInterrupt):
        return leaves[0]
    return eg
