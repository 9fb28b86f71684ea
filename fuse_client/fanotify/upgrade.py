"""Replace the running node daemon of a cache directory by a new process (a new version, the same
arguments) without failing any read (docs/fanotify.md, "Restart and upgrade"): SIGTERM the old
one (it stops reading events, answers what it can within its grace period, leaves the rest in the
in-flight journal, exits; the holder keeps the group, so reads of unfilled ranges wait), start
the new one with the old one's arguments and environment, wait until it answers. Blocking; no trio.

On the FUSE data path the same sequence works, but the old daemon's FUSE mount dies with it:
layers mounted on it fail with ENOTCONN until the runtime shim remounts them (docs/fanotify.md,
"The FUSE fallback across restarts").
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

from fuse_client.control import DaemonNotRunning, request_json

from .handover import proc_start_time

STOP_TIMEOUT = 60.0
START_TIMEOUT = 60.0
MARKER_NAME = "daemon-upgrade"  # "pid start_time" of an upgrade in progress (the shim's watch waits)
STOPPED_NAME = "daemon.stopped"  # "pid start_time" of the last daemon that stopped because it was asked to


def note_clean_stop(cache_dir: Path) -> None:
    """Called by a daemon that stops because it was asked to (SIGTERM, SIGINT, its mount gone):
    the shim's watch restarts daemons that die, not daemons that were stopped."""
    with contextlib.suppress(OSError):
        tmp = Path(cache_dir) / (STOPPED_NAME + ".tmp")
        tmp.write_text(f"{os.getpid()} {proc_start_time(os.getpid())}\n")
        os.replace(tmp, Path(cache_dir) / STOPPED_NAME)


def stopped_cleanly(cache_dir: Path, pid: int, start_time: int) -> bool:
    """Whether the daemon (pid, start time) stopped because it was asked to."""
    try:
        return (Path(cache_dir) / STOPPED_NAME).read_text().split() == [str(pid), str(start_time)]
    except OSError:
        return False


def upgrading(cache_dir: Path) -> bool:
    """Whether a live `upgrade` is replacing this cache's daemon (its marker names a live process)."""
    try:
        pid, start = (int(x) for x in (Path(cache_dir) / MARKER_NAME).read_text().split())
    except (OSError, ValueError):
        return False
    return proc_start_time(pid) == start


def _proc_list(pid: int, name: str) -> list[bytes]:
    with open(f"/proc/{pid}/{name}", "rb") as f:
        return [x for x in f.read().split(b"\0") if x]


def upgrade(cache_dir: Path, *, log: Path | None = None, argv: list[str] | None = None) -> dict[str, Any]:
    """Stop the daemon of `cache_dir` and start it again (with `argv`, default: the old one's).
    Returns {old_pid, new_pid, data_path, gap_seconds}."""
    old = request_json(cache_dir, "GET", "/stats")
    pid = int(old["pid"])
    start = proc_start_time(pid)
    if argv is None:
        argv = [os.fsdecode(a) for a in _proc_list(pid, "cmdline")]
    env = dict(os.fsdecode(e).split("=", 1) for e in _proc_list(pid, "environ") if b"=" in e)
    if log is None:
        target = os.readlink(f"/proc/{pid}/fd/2")
        log = Path(target) if target.startswith("/") and Path(target).is_file() else Path(os.devnull)
    marker = Path(cache_dir) / MARKER_NAME
    marker.write_text(f"{os.getpid()} {proc_start_time(os.getpid())}\n")
    try:
        return _replace(cache_dir, pid, start, argv, env, log)
    finally:
        with contextlib.suppress(OSError):
            marker.unlink()


def _replace(cache_dir: Path, pid: int, start: int | None, argv: list[str], env: dict[str, str],
             log: Path) -> dict[str, Any]:
    t0 = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT
    while proc_start_time(pid) == start and start is not None:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    try:
        new_pid = os.posix_spawn(argv[0], argv, env, setsid=True, file_actions=[
            (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
            (os.POSIX_SPAWN_DUP2, out, 1),
            (os.POSIX_SPAWN_DUP2, out, 2),
        ])
    finally:
        os.close(out)
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        with contextlib.suppress(ChildProcessError):
            done, status = os.waitpid(new_pid, os.WNOHANG)
            if done:
                raise DaemonNotRunning(f"the new daemon exited at start ({status}); see {log}")
        try:
            got = request_json(cache_dir, "GET", "/stats", timeout=5)
            if int(got.get("pid", 0)) == new_pid:
                break
        except (DaemonNotRunning, OSError):
            pass
        if time.monotonic() > deadline:
            raise DaemonNotRunning(f"the new daemon did not answer within {START_TIMEOUT:.0f} s; see {log}")
        time.sleep(0.02)
    return {"old_pid": pid, "new_pid": new_pid, "data_path": got.get("data_path"),
            "gap_seconds": round(time.monotonic() - t0, 3)}
