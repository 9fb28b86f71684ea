"""Daemon wiring: one function (`Daemon.serve`) builds the node cache (`fuse_client.nodecache`),
its FUSE front end (`fuse_client.fuse`) and the control socket (`fuse_client.control.server`)
from their parts, mounts, serves until told to stop, and tears everything down in reverse order
through one exit stack.

Shutdown (SIGTERM/SIGINT, `stop()`, or someone unmounting the mountpoint): stop the FUSE loop
(requests in progress get a grace period), wait for metadata pushes to the kernel, unmount, stop
the control socket, write the trace, commit the cache journal's last batch, release the node
lease (`nodecache.inuse`: what the node reports to the store's collector), close the index.
After kill -9 none of this runs: the mount is dead (ENOTCONN) and the next daemon lazily
unmounts it before mounting again; the cache needs no repair beyond what `recovery.recover` does
at every start; the node lease expires on its own.

Data path (docs/fanotify.md, "Which data path"): `LAYERSTORE_DATA_PATH=auto` (the default) takes
fanotify only where it is sound whatever dies: the kernel gives pre-content events *and* a service
manager keeps a copy of the group (systemd's fd store: `$FDSTORE` > 0 beside `$NOTIFY_SOCKET`), so
that no kill of our processes can leave holes readable as zeros, or the operator opted in to our
keeper process (`LAYERSTORE_FANOTIFY_KEEPER=1`: a kill that includes it can); FUSE everywhere else (it fails
closed: a dead daemon is ENOTCONN). `fanotify` asks for it regardless (refused where the kernel
lacks the events; without an fd store the every-process-killed window applies), `fuse` for FUSE.
The choice and its reason are in `/stats` (`data_path`, `data_path_reason`). On the fanotify path the daemon
also serves FUSE (health checks, complete-blob pins), takes the fanotify group from its holder
(or makes one and a holder), marks the attached blobs again *before* the cache is opened, and
answers what a killed predecessor left before it serves new events.
"""

from __future__ import annotations

import contextlib
import functools
import grp
import logging
import os
import resource
import signal
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import trio

from layerstore import linux
from layerstore.backends import Backend
from layerstore.errors import ConfigError, LayerstoreError
from layerstore.fileio import private_dir
from layerstore.metrics_listen import NODE_ENV, MetricsListener, wanted

from .control.client import socket_path
from .control.server import ControlAPI, ControlServer
from .fanotify import fdstore
from .fanotify import group as fan_group
from .fanotify import keeper as fan_keeper
from .fanotify import kernel as fan_kernel
from .fanotify.frontend import FanotifyFrontEnd, load_attachments
from .fanotify.upgrade import note_clean_stop
from .fuse.fs import BlobFS
from .fuse.mount import DEFAULT_KERNEL_READAHEAD_KB, FuseMount, clear_dead_mount, fuse_options
from .nodecache import (
    DEFAULT_CONCURRENCY,
    DEFAULT_DEADLINE,
    DEFAULT_HIGH,
    DEFAULT_LOW,
    DEFAULT_READAHEAD,
    Budget,
    ChunkSource,
    LazyCache,
    NodeCache,
    Stats,
    TraceRecorder,
    open_cache,
    write_trace,
)
from .nodecache.cachedir import cache_format
from .nodecache.files import BlobFiles
from .nodecache.inuse import NodeLease, interval_from_env
from .nodecache.report import NodeReport, node_figures
from .nodecache.report import interval_from_env as report_interval_from_env

log = logging.getLogger("layerstore.fuse.daemon")

TRACE_INTERVAL = 5.0
DATA_PATH_ENV = "LAYERSTORE_DATA_PATH"
DEFAULT_DATA_PATH = "auto"  # fanotify only where the group survives every process of ours (module doc)
HOLDER_CHECK = 1.0  # seconds between checks that the fanotify holder lives


def choose_data_path(where: Path, wanted: str | None = None, fmt: str = "plain") -> str:
    """"fanotify" or "fuse" (`data_path_choice` without its reason)."""
    return data_path_choice(where, wanted, fmt)[0]


def group_keeper(env: Mapping[str, str], cache_dir: Path | None = None) -> str | None:
    """Who keeps a copy of the fanotify group when the daemon and the holder are killed; None
    when nobody does. systemd (>= 254) sets `$FDSTORE` to the unit's FileDescriptorStoreMax= and
    `$NOTIFY_SOCKET` where it accepts FDSTORE=1 messages (fuse_client/contrib/layerstore-daemon.service
    sets both up). Else the keeper of `cache_dir` (fanotify.keeper), if one runs: an opt-in, since
    unlike PID 1 it can be killed with the rest (docs/fanotify.md, "The keeper")."""
    try:
        slots = int(env.get("FDSTORE", "0"))
    except ValueError:
        slots = 0
    if slots > 0 and fdstore.notify_address(env.get("NOTIFY_SOCKET", "")) is not None:
        return f"the service manager's fd store ({slots} slots)"
    ident = None if cache_dir is None else fan_keeper.identity(cache_dir)
    if ident is not None:
        return f"the keeper process {ident[0]} ({ident[1]}; an opt-in: it can be killed with the rest)"
    return None


def data_path_choice(where: Path, wanted: str | None = None, fmt: str = "plain",
                     env: Mapping[str, str] | None = None) -> tuple[str, str]:
    """"fanotify" or "fuse", and why (reported by /stats as `data_path_reason`): `wanted`, else
    $LAYERSTORE_DATA_PATH, else auto (module doc). A cache of format `fmt` other than plain is
    always FUSE: the kernel would read its compressed data files as the image. "auto" takes
    fanotify only with a keeper of the group (`group_keeper`) and pre-content events on files in
    `where` (probed)."""
    env = os.environ if env is None else env
    asked = wanted or env.get(DATA_PATH_ENV)
    want = (asked or DEFAULT_DATA_PATH).strip().lower()
    if want not in ("auto", "fanotify", "fuse"):
        raise ConfigError(f"{DATA_PATH_ENV}={want!r}: expected auto, fanotify or fuse")
    said = f"{want} asked for" if asked else f"auto (the default: {DATA_PATH_ENV} unset)"
    if want == "fuse":
        return "fuse", said
    if fmt != "plain":
        log.warning("data path: FUSE, not fanotify: the node cache %s keeps chunks compressed (format %s), and "
                    "the fanotify path mounts its data files as plain images", where, fmt)
        return "fuse", (f"{said}, but the node cache keeps chunks compressed (format {fmt}): "
                        "the fanotify path mounts its data files as plain images")
    keeper = group_keeper(env, where)
    if want == "auto" and keeper is None:
        asked_keeper = (f" and no keeper runs ({fan_keeper.OPT_IN_ENV}=1 but it did not start: see "
                        f"{fan_keeper.LOG_NAME})" if fan_keeper.wanted(env) else "")
        return "fuse", (f"{said}; no service manager keeps the fanotify group (no $FDSTORE and $NOTIFY_SOCKET)"
                        f"{asked_keeper}, so a kill of every process of ours could leave holes readable as zeros: "
                        "FUSE")
    why = fan_kernel.probe(where)
    if why is None:
        if keeper is None:
            log.warning("data path: fanotify asked for without a keeper of the group: if every process of ours "
                        "is killed at once, holes of attached blobs read as zeros until a daemon starts again")
        return "fanotify", f"{said}; the kernel gives pre-content events; the group is kept by {keeper or 'nobody'}"
    if want == "fanotify":
        raise ConfigError(f"the fanotify data path is not available here: {why}")
    log.info("fanotify pre-content events not available (%s): FUSE data path", why)
    return "fuse", f"{said}; fanotify pre-content events not available: {why}"


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
    # Other users reach the FUSE mount at all (the kernel's allow_other)? None: only with a control
    # group, whose members then read blobs (0440); else only the daemon's user (root) does (0400):
    # the kernel's file-backed EROFS mounts and QEMU open the blobs as root.
    allow_other: bool | None = None
    control_group: str | None = None  # a group whose members may use the control socket and read blobs
    data_path: str | None = None  # "fanotify" | "fuse" | "auto"; None: $LAYERSTORE_DATA_PATH, else auto
    cache_format: str | None = None  # of a new cache: "plain" | "zstd"; None: $LAYERSTORE_CACHE_FORMAT, else plain
    lease_interval: float | None = None  # node lease rotation (s); None: $LAYERSTORE_NODE_LEASE_INTERVAL or 60
    metrics_listen: str | None = None  # HOST:PORT for Prometheus; None: $LAYERSTORE_NODE_METRICS_LISTEN, else none

    def budget(self) -> Budget:
        """--cache-size, else `Budget.default_for` the filesystem the cache directory is on (or
        will be: its nearest existing parent)."""
        if self.cache_size is not None:
            return Budget(self.cache_size, self.high_watermark, self.low_watermark, "--cache-size")
        where = Path(self.cache_dir).absolute()
        while not where.exists():
            where = where.parent
        return Budget.default_for(linux.fs_size(where), self.high_watermark, self.low_watermark)

    def check(self) -> None:
        """Refuse a configuration the daemon cannot serve, before anything is mounted (the
        options' names are the CLI's: `layerctl daemon` and `python -m fuse_client.daemon`)."""
        if self.fetch_deadline <= 0:
            raise ConfigError("--fetch-deadline must be positive")
        if self.fetch_concurrency < 1:
            raise ConfigError("--fetch-concurrency must be at least 1")
        if self.readahead < 0:
            raise ConfigError("--readahead must be >= 0")
        self.budget()
        self.control_gid()

    def control_gid(self) -> int | None:
        if self.control_group is None:
            return None
        try:
            return grp.getgrnam(self.control_group).gr_gid
        except KeyError:
            if self.control_group.isdigit():
                return int(self.control_group)
            raise ConfigError(f"--control-group: no group named {self.control_group!r}") from None

    def fuse_options(self) -> set[str]:
        allow = self.control_group is not None if self.allow_other is None else self.allow_other
        return fuse_options(allow_other=allow)


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
        self.node_lease: NodeLease | None = None
        self.fanotify: FanotifyFrontEnd | None = None
        self.data_path_reason = ""  # why this data path (`data_path_choice`), in /stats
        self._stop = trio.Event()
        self._token: trio.lowlevel.TrioToken | None = None

    def stop(self) -> None:
        """Ask the daemon to shut down (from the trio thread)."""
        self._stop.set()

    def stop_threadsafe(self) -> None:
        if self._token is not None:
            with contextlib.suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)

    def token(self) -> trio.lowlevel.TrioToken | None:
        """The daemon's trio token once it serves (to run code on its thread)."""
        return self._token

    async def serve(self, *, task_status: trio.TaskStatus[Daemon] = trio.TASK_STATUS_IGNORED) -> None:
        cfg = self.config
        self._token = trio.lowlevel.current_trio_token()
        cache_dir, mountpoint = Path(cfg.cache_dir).absolute(), Path(cfg.mountpoint).absolute()
        # (is_mount first: a predecessor killed with -9 left a dead FUSE mount here, whose stat
        # fails with ENOTCONN unless its attributes were cached; cleared below)
        if not linux.is_mount(mountpoint) and not mountpoint.is_dir():
            raise ConfigError(f"mountpoint {mountpoint} is not a directory")
        with contextlib.ExitStack() as stack:
            front = self.fanotify = await self._fanotify_start(cache_dir, stack)
            previous = load_attachments(cache_dir) if front is not None else {}
            if front is not None and front.group is None and previous:
                # Attachments but no holder: the group died with it; a new one marks the files
                # again (open EROFS backing files raise events to any group's marks).
                front.open_group(*await trio.to_thread.run_sync(front.acquire))
            if front is not None and front.group is not None:
                front.premark(list(previous))  # before recovery may punch anything
                front.start()  # our own accesses are answered from here on
            cache = self.cache = await trio.to_thread.run_sync(
                functools.partial(open_cache, cache_dir, cfg.budget(), stack, cache_format=cfg.cache_format))
            if front is not None and front.group is not None:
                # Data files opened now are opened after their marks: mapping them would raise
                # events under the GIL (docs/fanotify.md). Files opened before any mark never do.
                cache.disable_mapping()
            trace = self.trace = TraceRecorder() if cfg.record_trace else None
            await trio.to_thread.run_sync(clear_dead_mount, mountpoint)
            async with trio.open_nursery() as service:
                await service.start(cache.run)
                # What the node uses, reported to the store's collector (docs/gc.md, the node side).
                backend = getattr(self.store, "backend", None)
                inuse = self.node_lease = NodeLease(
                    cache, backend if isinstance(backend, Backend) else None,
                    name=f"{socket.gethostname()}:{cache_dir}",
                    interval=cfg.lease_interval if cfg.lease_interval is not None else interval_from_env())
                cache.forgetting.in_use = inuse.last_seen
                await service.start(inuse.run)
                lazy = LazyCache(cache, self.store, nursery=service, trace=trace, concurrency=cfg.fetch_concurrency,
                                 deadline=cfg.fetch_deadline, readahead=cfg.readahead, guard=inuse.guard)
                self.stats = lazy.stats
                report = NodeReport(lambda: inuse.lease, functools.partial(node_figures, cache, lazy.stats),
                                    name=inuse.name, interval=report_interval_from_env())
                service.start_soon(report.run)  # the node's figures for the status page
                # Pinned files may be mounted directly (no FUSE hop verifies their reads): re-hash
                # their recovered chunks now, in the background (docs/fuse-client.md).
                service.start_soon(lazy.verify_pinned)
                gid = cfg.control_gid()
                ops = BlobFS(lazy, push_nursery=service, uid=os.geteuid(),
                             gid=os.getegid() if gid is None else gid, group_read=gid is not None)
                if front is not None:
                    front.bind(lazy, service)
                    await front.restore(previous)
                    await front.release()  # the predecessor's leftovers answered; new events served
                    service.start_soon(self._holder_watch, front)
                api = ControlAPI(lazy, front, data_path_reason=self.data_path_reason)
                self._metrics_listener(stack, lazy.stats)
                control = ControlServer(socket_path(cache_dir), api, group=cfg.control_gid())
                try:
                    await self._serve_mounted(FuseMount(ops, mountpoint, cfg.fuse_options()), control, task_status)
                finally:
                    with trio.CancelScope(shield=True):
                        if front is not None:
                            await front.stop()
                            if front.group is not None and not front.attached:
                                # Nothing mounted on the group: nobody needs it kept.
                                await trio.to_thread.run_sync(fan_group.quit_holder, cache_dir, front.group_id)
                        if trace is not None and cfg.record_trace is not None:
                            await trio.to_thread.run_sync(write_trace, cfg.record_trace, trace.to_json())
                        await cache.shutdown_flush()
                        try:
                            await report.release()
                            await inuse.release()
                        except LayerstoreError as e:  # it expires on its own
                            log.warning("node lease: not released (%s); it expires on its own", e)
                    service.cancel_scope.cancel()
        log.info("daemon stopped")

    def _metrics_listener(self, stack: contextlib.ExitStack, stats: Stats) -> None:
        """The TCP `/metrics` listener if one is asked for (docs/metrics.md). Its thread asks this
        loop for the text: the counters are written here without locks, so they are read here too
        (one short callback per scrape, queued behind whatever the loop is doing)."""
        address = wanted(self.config.metrics_listen, NODE_ENV)
        if address is None:
            return
        token = trio.lowlevel.current_trio_token()

        def render() -> bytes:
            return trio.from_thread.run_sync(stats.prometheus, trio_token=token)

        stack.enter_context(MetricsListener(address, render))

    async def _fanotify_start(self, cache_dir: Path, stack: contextlib.ExitStack) -> FanotifyFrontEnd | None:
        """The fanotify front end if that is the data path; with the holder's group if a holder
        keeps one (a restart or an upgrade), else without a group yet (made on the first attach)."""
        # Its own, whatever its mode was: data files, index and socket (0710 with a control group,
        # whose members reach the socket by name).
        private_dir(cache_dir, gid=self.config.control_gid(), parents=True)
        path, self.data_path_reason = data_path_choice(
            cache_dir, self.config.data_path, cache_format(cache_dir, self.config.cache_format))
        if path != "fanotify":
            return None
        front = FanotifyFrontEnd(cache_dir, data_file=BlobFiles(cache_dir).path,
                                 acquire=functools.partial(fan_group.acquire, cache_dir))
        stack.callback(front.close)
        got = await trio.to_thread.run_sync(fan_group.take_over, cache_dir)
        if got is not None:
            front.open_group(*got)
        log.info("data path: fanotify (%s)", f"group {front.group_id} taken over" if got else "no group yet")
        return front

    async def _holder_watch(self, front: FanotifyFrontEnd) -> None:
        while True:
            await trio.sleep(HOLDER_CHECK)
            if front.group is None:
                continue
            try:
                await trio.to_thread.run_sync(front.keep_holder)  # (and this daemon's claim on it)
            except OSError as e:
                log.error("cannot start a new fanotify holder: %s", e)

    async def _serve_mounted(self, fuse: FuseMount, control: ControlServer,
                             task_status: trio.TaskStatus[Daemon]) -> None:
        async with trio.open_nursery() as sockets:
            # The control socket answers before the mount appears: whoever waits for the mount
            # (the runtime shim does) and then asks the daemon finds the socket there.
            await sockets.start(control.serve)
            fuse.open()
            try:
                async with trio.open_nursery() as front:
                    front.start_soon(fuse.run, self._stop.set)  # the mount went away (fusermount -u): stop too
                    if self.config.kernel_readahead_kb:
                        await fuse.set_readahead(self.config.kernel_readahead_kb)
                    if self.trace is not None:
                        front.start_soon(self._trace_loop)
                    log.info("serving blobs at %s/blobs (cache %s)", fuse.mountpoint, self.config.cache_dir)
                    task_status.started(self)
                    await self._stop.wait()
                    await fuse.terminate()
                    front.cancel_scope.cancel()
            finally:
                await fuse.close()
            sockets.cancel_scope.cancel()  # after the unmount

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
    note_clean_stop(config.cache_dir)  # (the shim's watch restarts daemons that die, not stopped ones)


def serve(config: DaemonConfig, store_url: str | None) -> None:
    """Check `config`, open the store and serve until SIGTERM or SIGINT (the store may be
    unreachable now: the daemon still starts and serves what is cached)."""
    from layerstore.store import Store

    config.check()  # before mounting
    with Store.open(store_url) as store:
        run(config, store)


def main(argv: list[str] | None = None) -> int:
    """`python -m fuse_client.daemon --store URL --cache DIR --mountpoint DIR`: the node daemon as
    the shim starts it (the full set of options is `layerctl daemon`'s). A `LayerstoreError` is one
    line on stderr and its exit code."""
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m fuse_client.daemon")
    ap.add_argument("--store", default=None)
    ap.add_argument("--cache", required=True, type=Path)
    ap.add_argument("--mountpoint", required=True, type=Path)
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    ap.add_argument("--metrics-listen", default=None, metavar="HOST:PORT",
                    help="serve Prometheus text at http://HOST:PORT/metrics (default $LAYERSTORE_NODE_METRICS_LISTEN)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        serve(DaemonConfig(cache_dir=args.cache, mountpoint=args.mountpoint, metrics_listen=args.metrics_listen),
              args.store)
    except LayerstoreError as e:
        print(f"fuse_client.daemon: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    return 0


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


if __name__ == "__main__":
    import sys

    from fuse_client.daemon import main as entry  # (the module under its own name, not a second copy)

    sys.exit(entry())
