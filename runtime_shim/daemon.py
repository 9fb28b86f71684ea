"""Supervision of the node daemon (`layerctl daemon`): start it detached when it is not running,
reuse it when it is, and tell a live daemon from a dead one.

The daemon is identified by pid *and* start time (/proc/<pid>/stat field 22), so a reused pid is
never mistaken for it; it is healthy when its FUSE mountpoint answers (after kill -9 every access
fails with ENOTCONN). It runs in its own session with its output in NODE/daemon.log, so it
outlives the `layerctl` that started it. Only the recorded pid is ever signalled.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fuse_client import linux

from .errors import DaemonError
from .paths import NodePaths
from .state import DaemonRecord

READY_TIMEOUT = 60.0
STOP_TIMEOUT = 20.0

DaemonCommand = Callable[[str, Path, Path], list[str]]


def layerctl_argv() -> list[str]:
    """How to run this installation's `layerctl`: the script beside the interpreter when there is one."""
    script = Path(sys.executable).with_name("layerctl")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "from layerctl.main import main; main()"]


def default_command(store: str, cache: Path, mountpoint: Path) -> list[str]:
    return [*layerctl_argv(), "daemon", "--store", store, "--cache", str(cache), "--mountpoint", str(mountpoint)]


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

    def health(self, rec: DaemonRecord | None) -> DaemonHealth:
        alive = rec is not None and is_alive(rec)
        mounted = linux.is_mount(self.paths.fuse)
        responsive = mounted and not linux.is_dead(self.paths.fuse)
        return DaemonHealth(alive, mounted, responsive)

    def start(self, store: str) -> DaemonRecord:
        """Start a daemon for `store` and wait until its mount answers. A dead mount left by a
        killed daemon is detached first (a new FUSE mount cannot go over it usefully)."""
        from fuse_client.control import socket_path  # (imports trio: only when a daemon starts)

        sock = socket_path(self.paths.cache)
        if len(os.fsencode(sock)) >= 108:
            # The daemon would mount its FUSE file system and then die binding the socket: say why
            # here, instead of failing later on a blob that cannot be found.
            raise DaemonError(f"the node directory's path is too long: the daemon's control socket {sock} must fit "
                              f"a Unix socket address (107 bytes); use a shorter --node-dir")
        self.clear_dead_mount()
        self.paths.fuse.mkdir(mode=0o700, exist_ok=True)
        self.paths.cache.mkdir(mode=0o700, exist_ok=True)
        argv = self.command(store, self.paths.cache, self.paths.fuse)
        log_fd = os.open(self.paths.daemon_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        try:
            os.write(log_fd, f"--- {time.strftime('%Y-%m-%dT%H:%M:%S')} starting: {' '.join(argv)}\n".encode())
            pid = os.posix_spawn(argv[0], argv, os.environ, setsid=True, file_actions=[
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
                return DaemonRecord(pid, start_time, store, str(self.paths.fuse), str(self.paths.cache), argv)
            time.sleep(0.01)
        self.stop(DaemonRecord(pid, start_time or 0, store, str(self.paths.fuse), str(self.paths.cache), argv))
        raise DaemonError(f"the node daemon did not mount {self.paths.fuse} within {READY_TIMEOUT:.0f} s")

    def stop(self, rec: DaemonRecord | None) -> None:
        """SIGTERM the recorded daemon (SIGKILL if it lingers) and detach its mount."""
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
