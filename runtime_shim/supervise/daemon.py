"""Supervision of the node daemon (`layerctl daemon`): start it detached when it is not running,
reuse it when it is, and tell a live daemon from a dead one.

The daemon is identified by pid *and* start time (/proc/<pid>/stat field 22), so a reused pid is
never mistaken for it; it is healthy when its FUSE mountpoint answers (after kill -9 every access
fails with ENOTCONN). It runs in its own session with its output in NODE/daemon.log, so it
outlives the `layerctl` that started it. Only the recorded pid is ever signalled.

The daemon gets the shim's environment without the service manager's variables (`$NOTIFY_SOCKET`,
`$FDSTORE`, `$LISTEN_*`): those name the shim's own unit, which does not keep the daemon's
fanotify group across the daemon's restarts, so with the default data path (`auto`) a daemon the
shim starts serves FUSE. A daemon run as its own unit (fuse_client/contrib) has them.

On every data path a small **watch** process (`python -m runtime_shim.supervise.daemon watch
NODE_DIR`, NODE/watch.pid; none with LAYERSTORE_DAEMON_WATCH=0) waits on pidfds of the daemon and
of the fanotify holder between shim calls: when the daemon dies it adopts a daemon that answers
in its place (an upgrade) or starts a new one at once. On the FUSE data path the dead daemon's
mount and every layer mount that read through it are dead for good: under the node lock, it
first marks the sandboxes stacked on them lost and takes those layer mounts down (`death.sever`;
docs/daemon-death.md), then detaches the dead FUSE mount and starts the
new daemon; the next shim call mounts the layers again on it. On the fanotify data path
(docs/fanotify.md, "Every process of ours killed") reads on attached layers wait meanwhile; when
the holder died too, it first makes a new group with every attached file marked again
(`regroup`), which ends the time holes could read as zeros, and only then starts the daemon. It
exits when the shim stops the daemon (it is stopped first), the record is gone, or the daemon
was stopped on request rather than killed (it notes that: `fanotify.upgrade.note_clean_stop`).
Where the operator opted in to the fanotify keeper, it also starts a keeper that died alone while a
fanotify daemon runs (`keeper_watch`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from layerstore import linux
from layerstore.errors import LayerstoreError

from ..errors import DaemonError
from ..nodestate.lock import NodeLock
from ..nodestate.paths import NodePaths
from ..nodestate.state import DaemonRecord, NodeState
from .death import sever

log = logging.getLogger("layerstore.shim.watch")

READY_TIMEOUT = 60.0
STOP_TIMEOUT = 20.0
WATCH_INTERVAL = 1.0  # seconds between the watch's looks at the record (pidfds wake it at once)
WATCH_ENV = "LAYERSTORE_DAEMON_WATCH"  # "0": no watch process

DaemonCommand = Callable[[str, Path, Path], list[str]]


def default_command(store: str, cache: Path, mountpoint: Path) -> list[str]:
    """The node daemon as a module of this interpreter (`fuse_client.daemon`), not through the CLI."""
    return [sys.executable, "-m", "fuse_client.daemon", "--store", store, "--cache", str(cache),
            "--mountpoint", str(mountpoint)]


def proc_start_time(pid: int) -> int | None:
    """The start time of a live (non-zombie) process, else None (a zombie child of this process,
    a daemon it started, is reaped)."""
    start = linux.proc_start_time(pid)
    if start is None:
        _reap(pid)
    return start


def _reap(pid: int) -> None:
    # A daemon this very process started is its child until reaped; other pids are not ours.
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def is_alive(rec: DaemonRecord) -> bool:
    return proc_start_time(rec.pid) == rec.start_time


@dataclass(frozen=True)
class DaemonHealth:
    alive: bool  # the recorded process runs
    mounted: bool  # its mountpoint is a mount
    responsive: bool  # and answers (not ENOTCONN)

    @property
    def healthy(self) -> bool:
        return self.alive and self.mounted and self.responsive


class DaemonSupervisor:
    """Starts, checks and stops the node daemon. Callers hold the node lock."""

    def __init__(self, paths: NodePaths, command: DaemonCommand = default_command) -> None:
        self.paths = paths
        self.command = command
        self.watching_self = False  # this object is the watch process's own

    # -- the watch (module doc) --------------------------------------------------------------
    @property
    def watch_file(self) -> Path:
        return self.paths.root / "watch.pid"

    def watch_pid(self) -> int | None:
        """The live watch process of this node, else None."""
        try:
            pid, start = (int(x) for x in self.watch_file.read_text().split())
        except (OSError, ValueError):
            return None
        return pid if proc_start_time(pid) == start else None

    def ensure_watch(self) -> None:
        """Start the watch process unless it runs, this is it, or LAYERSTORE_DAEMON_WATCH=0."""
        if self.watching_self or os.environ.get(WATCH_ENV) == "0" or self.watch_pid() is not None:
            return
        argv = [sys.executable, "-m", "runtime_shim.supervise.daemon", "watch", str(self.paths.root)]
        log_fd = os.open(self.paths.daemon_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        try:
            pid = os.posix_spawn(argv[0], argv, os.environ, setsid=True, file_actions=[
                (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                (os.POSIX_SPAWN_DUP2, log_fd, 1),
                (os.POSIX_SPAWN_DUP2, log_fd, 2),
            ])
        except OSError:
            return  # (the shim's own calls still restart the daemon)
        finally:
            os.close(log_fd)
        start = None
        while start is None and linux.proc_start_time(pid) is not None:
            start = proc_start_time(pid)
        if start is not None:
            tmp = self.watch_file.with_suffix(".tmp")
            tmp.write_text(f"{pid} {start}\n")
            os.replace(tmp, self.watch_file)

    def stop_watch(self) -> None:
        pid = self.watch_pid()
        if pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT
        while proc_start_time(pid) is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        with contextlib.suppress(OSError):
            self.watch_file.unlink()

    def adopt(self, rec: DaemonRecord) -> DaemonRecord | None:
        """The record of a healthy daemon that answers on this node's control socket in place of
        the recorded one (`layerctl daemon-upgrade` started it), else None."""
        from fuse_client.control import request_json  # (imports no trio)

        try:
            pid = int(request_json(self.paths.cache, "GET", "/stats", timeout=5)["pid"])
        except (LayerstoreError, OSError, KeyError, TypeError, ValueError):
            return None
        start = proc_start_time(pid)
        if start is None or not linux.is_mount(self.paths.fuse) or linux.is_dead(self.paths.fuse):
            return None
        try:
            argv = [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
        except OSError:
            argv = list(rec.argv)
        return DaemonRecord(pid, start, rec.store, rec.mountpoint, rec.cache, argv)

    def health(self, rec: DaemonRecord | None) -> DaemonHealth:
        alive = rec is not None and is_alive(rec)
        mounted = linux.is_mount(self.paths.fuse)
        responsive = mounted and not linux.is_dead(self.paths.fuse)
        return DaemonHealth(alive, mounted, responsive)

    def start(self, store: str, argv: list[str] | None = None) -> DaemonRecord:
        """Start a daemon for `store` (with `argv`, e.g. a dead one's, else this supervisor's
        command) and wait until its mount answers. A dead mount left by a killed daemon is
        detached first (a new FUSE mount cannot go over it usefully)."""
        from fuse_client.control import socket_path  # (imports trio: only when a daemon starts)
        from fuse_client.fanotify import keeper

        sock = socket_path(self.paths.cache)
        if len(os.fsencode(sock)) >= 108:
            # The daemon would mount its FUSE file system and then die binding the socket: say why
            # here, instead of failing later on a blob that cannot be found.
            raise DaemonError(f"the node directory's path is too long: the daemon's control socket {sock} must fit "
                              f"a Unix socket address (107 bytes); use a shorter --node-dir")
        self.clear_dead_mount()
        self.paths.fuse.mkdir(mode=0o700, exist_ok=True)
        self.paths.cache.mkdir(mode=0o700, exist_ok=True)
        keeper.ensure(self.paths.cache)  # (opt-in, before the daemon chooses its data path: docs/fanotify.md)
        argv = list(argv) if argv else self.command(store, self.paths.cache, self.paths.fuse)
        log_fd = os.open(self.paths.daemon_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        try:
            os.write(log_fd, f"--- {time.strftime('%Y-%m-%dT%H:%M:%S')} starting: {' '.join(argv)}\n".encode())
            pid = os.posix_spawn(argv[0], argv, daemon_environment(os.environ), setsid=True, file_actions=[
                (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                (os.POSIX_SPAWN_DUP2, log_fd, 1),
                (os.POSIX_SPAWN_DUP2, log_fd, 2),
            ])
        except OSError as e:
            raise DaemonError(f"cannot start the node daemon ({argv[0]}): {os.strerror(e.errno or 0)}") from None
        finally:
            os.close(log_fd)
        start_time = None
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            if start_time is None:
                start_time = proc_start_time(pid)
            if start_time is None or proc_start_time(pid) != start_time:
                _reap(pid)
                raise DaemonError(f"the node daemon exited during start-up; see {self.paths.daemon_log}: "
                                  f"{self.log_tail()}")
            if linux.is_mount(self.paths.fuse) and not linux.is_dead(self.paths.fuse):
                self.ensure_watch()
                return DaemonRecord(pid, start_time, store, str(self.paths.fuse), str(self.paths.cache), argv)
            time.sleep(0.01)
        self.stop(DaemonRecord(pid, start_time or 0, store, str(self.paths.fuse), str(self.paths.cache), argv))
        raise DaemonError(f"the node daemon did not mount {self.paths.fuse} within {READY_TIMEOUT:.0f} s")

    def stop(self, rec: DaemonRecord | None, *, watch: bool = True) -> None:
        """SIGTERM the recorded daemon (SIGKILL if it lingers) and detach its mount; the watch
        first (it would start the daemon again), unless `watch` is False (a dead daemon's mount is
        cleared and the watch, if one runs, is to start the next)."""
        if watch and not self.watching_self:
            self.stop_watch()
        if rec is not None and is_alive(rec):
            with contextlib.suppress(ProcessLookupError):
                os.kill(rec.pid, signal.SIGTERM)
            deadline = time.monotonic() + STOP_TIMEOUT
            while is_alive(rec) and time.monotonic() < deadline:
                time.sleep(0.01)
            if is_alive(rec):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(rec.pid, signal.SIGKILL)
                while is_alive(rec):
                    time.sleep(0.01)
        if linux.is_mount(self.paths.fuse):
            with contextlib.suppress(linux.MountError):
                linux.umount(self.paths.fuse, lazy=True)

    def clear_dead_mount(self) -> bool:
        """Detach whatever is mounted at the FUSE mountpoint when no recorded daemon owns it: a
        dead mount of a killed daemon, or the mount of a daemon whose record was lost (which then
        sees its mount go and exits)."""
        if linux.is_mount(self.paths.fuse):
            linux.umount(self.paths.fuse, lazy=True)
            return True
        return False

    def log_tail(self, lines: int = 3) -> str:
        try:
            text = self.paths.daemon_log.read_text(errors="replace")
        except OSError:
            return "(no log)"
        tail = [ln for ln in text.splitlines() if ln.strip()][-lines:]
        return " | ".join(tail) or "(empty log)"


def _pidfd(pid: int, start: int | None) -> int | None:
    """A pidfd of the live process (pid, start time), None if it is gone."""
    if start is None:
        return None
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return None
    if proc_start_time(pid) != start:
        os.close(fd)
        return None
    return fd


SERVICE_MANAGER_ENV = ("NOTIFY_SOCKET", "FDSTORE", "LISTEN_FDS", "LISTEN_FDNAMES", "LISTEN_PID", "WATCHDOG_PID",
                       "WATCHDOG_USEC")


def daemon_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The environment of a daemon the shim starts: the shim's, less its service manager's
    variables (module doc)."""
    return {k: v for k, v in env.items() if k not in SERVICE_MANAGER_ENV}


def _data_path(paths: NodePaths) -> str | None:
    from fuse_client.control import request_json  # (imports no trio)

    try:
        return str(request_json(paths.cache, "GET", "/stats", timeout=10).get("data_path"))
    except (LayerstoreError, OSError):
        return None


class _Restarter:
    """The watch's restart of a dead daemon, in a thread of its own (so that a fanotify holder
    that dies meanwhile is still noticed at once), under the node lock (module doc)."""

    def __init__(self, paths: NodePaths, sup: DaemonSupervisor, state: NodeState, interval: float) -> None:
        self.paths, self.sup, self.state, self.interval = paths, sup, state, interval
        self.done = threading.Event()  # the daemon was stopped on request: the watch ends
        self.holding = threading.Event()  # the node lock is held (a daemon may be half started)
        self.thread: threading.Thread | None = None

    def busy(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def begin(self) -> None:
        self.thread = threading.Thread(target=self.run, args=(time.monotonic(), time.time()), daemon=True)
        self.thread.start()

    def end(self) -> None:
        """On the watch's exit: wait for a start that holds the lock (its daemon must be
        recorded); one still waiting for the lock is dropped (the process holding the lock is
        the shim, stopping this watch: waiting for it would hold both up)."""
        if self.thread is not None and self.holding.is_set():
            self.thread.join(READY_TIMEOUT)

    def run(self, t0: float, died: float) -> None:
        try:
            with NodeLock(self.paths.lock):
                self.holding.set()
                try:
                    self._restart(t0, died)
                finally:
                    self.holding.clear()
        except DaemonError as e:
            log.error("the watch cannot start the node daemon: %s; trying again", e)
            time.sleep(5 * self.interval)

    def _restart(self, t0: float, died: float) -> None:
        from fuse_client.fanotify.upgrade import stopped_cleanly

        with self.state.read() as t:
            cur = t.daemon()
        if cur is None or is_alive(cur):
            return
        new = self.sup.adopt(cur)
        if new is None and stopped_cleanly(self.paths.cache, cur.pid, cur.start_time):
            log.info("node daemon %d was stopped, not killed: the watch ends", cur.pid)
            self.done.set()  # (the next shim call that needs a daemon starts one, and a watch)
            return
        if new is None:
            severed = sever(self.paths, self.state, died)  # before its FUSE mount is detached
            self.sup.stop(cur)
            offset = _log_size(self.paths.daemon_log)
            new = self.sup.start(cur.store, cur.argv)  # (its options: a bench's, a test's)
            # the daemon log's last line: what died, what went with it, what replaced it (after the
            # new daemon's own start-up line, which it writes as its mount appears)
            _await_line(self.paths.daemon_log, offset, SERVING_LINE, READY_LINE_TIMEOUT)
            log.warning("node daemon %d died: %s; started %d (%.2f s)", cur.pid, severed.summary(), new.pid,
                        time.monotonic() - t0)
        with self.state.write() as t:
            t.put_daemon(new)


SERVING_LINE = b"serving blobs at"  # (fuse_client.daemon: logged as its mount appears)
READY_LINE_TIMEOUT = 2.0


def _log_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _await_line(path: Path, offset: int, needle: bytes, timeout: float) -> bool:
    """Wait (at most `timeout`) until the log holds `needle` after `offset`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                if needle in f.read():
                    return True
        except OSError:
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)


def watch(root: Path, interval: float = WATCH_INTERVAL) -> int:
    """The watch process's loop (module doc). Returns when the shim stopped the daemon (no record)
    or the node directory is gone; SIGTERM ends it."""
    from fuse_client.fanotify import group, handover
    from fuse_client.fanotify.upgrade import upgrading
    from fuse_client.nodecache.files import BlobFiles

    from .keeper_watch import KeeperWatch

    paths = NodePaths(root)
    sup = DaemonSupervisor(paths)
    sup.watching_self = True
    state = NodeState(paths.state)
    data_file = BlobFiles(paths.cache).path
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    restarter = _Restarter(paths, sup, state, interval)
    keepers = KeeperWatch(paths.cache, os.environ)
    fanotify: bool | None = None  # the daemon's data path (None: not asked yet)
    try:
        while paths.root.is_dir() and not restarter.done.is_set():
            with state.read() as t:
                rec = t.daemon()
            if rec is None:
                return 0
            daemon_up = is_alive(rec)
            if daemon_up and fanotify is None:
                fanotify = _data_path(paths) != "fuse"
            if daemon_up and fanotify:
                keepers.tick(time.monotonic())  # (a keeper that died alone: started again)
            ident = handover.read_identity(paths.cache)
            if not daemon_up and ident is None and fanotify is not False:
                # Holder and daemon gone: the group died. Mark the attached files on a new one now,
                # not after the (slow) daemon start: that ends the time holes read as zeros.
                t0 = time.monotonic()
                gid = group.regroup(paths.cache, data_file)
                if gid is not None:
                    log.warning("holder and daemon dead: new fanotify group %s (attached files marked first), "
                                "its holder started %.3f s after", gid, time.monotonic() - t0)
                    ident = handover.read_identity(paths.cache)
            if not daemon_up and not restarter.busy() and not upgrading(paths.cache):
                restarter.begin()
            fds = [fd for fd in (_pidfd(rec.pid, rec.start_time) if daemon_up else None,
                                 _pidfd(ident[0], handover.proc_start_time(ident[0])) if ident else None)
                   if fd is not None]
            try:
                # A pidfd is readable once its process exited; while a daemon is down, look often.
                select.select(fds, [], [], interval if daemon_up else min(interval, 0.02))
            finally:
                for fd in fds:
                    os.close(fd)
    finally:
        restarter.end()
        state.close()
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "watch":
        logging.basicConfig(level=logging.INFO, format="%(asctime)s watch %(levelname)s %(message)s")
        sys.exit(watch(Path(sys.argv[2])))
    sys.exit("usage: python -m runtime_shim.supervise.daemon watch NODE_DIR")
