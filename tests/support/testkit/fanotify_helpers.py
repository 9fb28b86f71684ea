"""Helpers for the tests over both data paths (FUSE, fanotify: docs/fanotify.md): a node daemon
as a subprocess with its data path forced, the image file a layer is mounted from on each path,
and cleanup of the fanotify holder (started by the daemon) even when a test fails.

The daemon runs in another process: on the fanotify path the daemon allows its own process's
accesses without a fill, so whatever reads a mount must not be the daemon.
"""

from __future__ import annotations

import array
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from fuse_client.control import DaemonNotRunning, attach, detach, request_json
from fuse_client.fanotify import abi, handover, kernel
from fuse_client.fanotify.frontend import FanotifyFrontEnd
from layerstore.linux import MountError, mount_erofs, umount

from .fuse_helpers import LAYERCTL, READY_TIMEOUT, DaemonProcess, force_unmount, wait_until

if TYPE_CHECKING:
    from runtime_shim.nodestate.paths import NodePaths
    from runtime_shim.nodestate.state import DaemonRecord, NodeState
    from runtime_shim.supervise.daemon import DaemonSupervisor

FANOTIFY_WHY = kernel.probe("/var/tmp") if os.geteuid() == 0 else "not root"
needs_fanotify = pytest.mark.skipif(FANOTIFY_WHY is not None, reason=f"no fanotify pre-content events: {FANOTIFY_WHY}")
DATA_PATHS = ["fuse", pytest.param("fanotify", marks=needs_fanotify)]


def unmount_and_detach(cache_dir: Path, blob: str, holder: str, target: Path) -> None:
    """Undo an attached mount a test or bench made by hand: the EROFS mount at `target` (lazily),
    then the attachment; either may be gone already."""
    with contextlib.suppress(OSError, MountError):  # (detached already: a read deadline)
        umount(target, lazy=True)
    with contextlib.suppress(Exception):
        detach(cache_dir, blob, holder)


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
        with contextlib.suppress(OSError, MountError):  # (detached already: a read deadline)
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


def process_marks(pid: int | None) -> int:
    """The marks of the fanotify group process `pid` holds (read from its fdinfo), -1 if none."""
    if pid is None:
        return -1
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:[fanotify]":
                    with open(f"/proc/{pid}/fdinfo/{fd}", "rb") as f:
                        return abi.count_marks(f.read())
    return -1


def holder_marks(cache_dir: Path) -> int:
    """The marks of the group the cache's live holder keeps, -1 if none."""
    ident = handover.read_identity(cache_dir)
    return -1 if ident is None else process_marks(ident[0])


class NotifySocket:
    """A stand-in for systemd's notify socket (a datagram socket the daemon's `$NOTIFY_SOCKET` names):
    receives `FDSTORE=1` messages and keeps the fds they carry, as the manager's fd store would."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(os.fspath(path))
        self.stored: dict[str, int] = {}  # FDNAME -> fd

    def receive(self, timeout: float = 30.0) -> tuple[str, int]:
        """The next stored fd: (its name, the fd)."""
        self.sock.settimeout(timeout)
        fds = array.array("i")
        msg, anc, _flags, _addr = self.sock.recvmsg(4096, socket.CMSG_SPACE(4 * fds.itemsize))
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
        fields = dict(line.split("=", 1) for line in msg.decode().splitlines() if "=" in line)
        assert fields.get("FDSTORE") == "1" and len(fds) == 1, (msg, list(fds))
        name = fields["FDNAME"]
        self.stored[name] = fds[0]
        return name, fds[0]

    def close(self) -> None:
        for fd in self.stored.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.sock.close()


# Runs `layerctl daemon` the way systemd starts a unit with a non-empty fd store: the stored fd at 3,
# LISTEN_FDS / LISTEN_FDNAMES / LISTEN_PID (= the daemon's own pid) in its environment.
_LISTEN_WRAPPER = (
    "import os, sys\n"
    "fd = int(sys.argv[1])\n"
    "if fd != 3:\n"
    "    os.dup2(fd, 3)\n"
    "os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS='1', LISTEN_FDNAMES=sys.argv[2])\n"
    "os.execv(sys.argv[3], sys.argv[3:])\n")


def start_daemon_from_fd_store(store_url: str, cache_dir: Path, mountpoint: Path, fd: int, name: str,
                               log: Path) -> subprocess.Popen[bytes]:
    """A fanotify daemon handed the stored group `fd` as systemd would; returns once it answers."""
    env = {**os.environ, "LAYERSTORE_DATA_PATH": "fanotify"}
    env.pop("LAYERSTORE_STORE", None)
    with open(log, "ab") as logf:
        proc = subprocess.Popen(
            [sys.executable, "-c", _LISTEN_WRAPPER, str(fd), name, LAYERCTL, "daemon", "--store", store_url,
             "--cache", str(cache_dir), "--mountpoint", str(mountpoint)],
            stdout=logf, stderr=subprocess.STDOUT, env=env, pass_fds=(fd,))

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"daemon exited with {proc.returncode}:\n{log.read_text(errors='replace')}")
        with contextlib.suppress(OSError, DaemonNotRunning):
            return request_json(cache_dir, "GET", "/stats", timeout=5)["pid"] == proc.pid
        return False

    wait_until(ready, READY_TIMEOUT, "the daemon to answer")
    return proc


@contextlib.contextmanager
def front_on_a_pipe(cache_dir: Path) -> Iterator[tuple[FanotifyFrontEnd, int]]:
    """A fanotify front end on `cache_dir` whose "group" is a pipe's write end (no kernel group:
    unit tests); yields it and the read end, where its answers arrive (`pipe_answers`)."""
    r, w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    fe = FanotifyFrontEnd(cache_dir, data_file=lambda b: cache_dir / b, acquire=lambda: (w, "g", True))
    fe.open_group(w, "g", True)
    try:
        yield fe, r
    finally:
        fe.group = None  # (the pipe is closed here, not by close())
        fe.close()
        os.close(r)
        os.close(w)


def pipe_answers(r: int) -> list[tuple[int, bool, int]]:
    """The answers (fd, allowed, errno) a `front_on_a_pipe` front end wrote so far."""
    try:
        data = os.read(r, 65536)
    except BlockingIOError:
        return []
    return [abi.decode_response(data[k:k + abi.RESPONSE.size]) for k in range(0, len(data), abi.RESPONSE.size)]


def shim_node(tmp: Path, monkeypatch: pytest.MonkeyPatch,
              data_path: str) -> tuple[NodePaths, DaemonSupervisor, NodeState]:
    """A node directory `tmp/node` whose daemon the shim's supervisor starts on `data_path`, with
    its watch (LAYERSTORE_DAEMON_WATCH unset): (paths, supervisor, state); the caller closes the
    state."""
    from runtime_shim.nodestate.paths import NodePaths
    from runtime_shim.nodestate.state import NodeState
    from runtime_shim.supervise.daemon import DaemonSupervisor

    monkeypatch.setenv("LAYERSTORE_DATA_PATH", data_path)
    monkeypatch.delenv("LAYERSTORE_DAEMON_WATCH", raising=False)
    paths = NodePaths(tmp / "node")
    paths.root.mkdir()
    return paths, DaemonSupervisor(paths), NodeState(paths.state)


def start_recorded(sup: DaemonSupervisor, state: NodeState, store_url: str) -> DaemonRecord:
    """Start a daemon and record it in the node's state, as the shim does (the watch reads it)."""
    rec = sup.start(store_url)
    with state.write() as t:
        t.put_daemon(rec)
    return rec
