"""A stand-in service manager for the node daemon (docs/fanotify.md, "Every process of ours
killed", layer 1): what systemd does for fuse_client/contrib/layerstore-daemon.service, reduced to
the parts the fanotify data path relies on, so that tests and bench/daemon_restart.py can kill
every process of ours while something plays PID 1.

- It owns the notify socket (`$NOTIFY_SOCKET`, a datagram socket) and keeps every fd sent with
  `FDSTORE=1` under its `FDNAME` (a second one of the same name replaces the first), drops one on
  `FDSTOREREMOVE=1`, and ignores other messages.
- It starts `layerctl daemon` with `$FDSTORE` (the store's slots) and `$NOTIFY_SOCKET` set and no
  `$LAYERSTORE_DATA_PATH` (the daemon's own default choice decides), and the stored fds at 3..
  with `$LISTEN_FDS`, `$LISTEN_FDNAMES` and `$LISTEN_PID` (the daemon's pid), as systemd passes a
  unit its fd store.
- A daemon that exits without being asked to stop is started again after `restart_sec` (systemd's
  `Restart=on-failure`, `RestartSec=100ms` by default). It starts no shim watch and no holder.

It lives in the process that creates it (threads: one receives, one supervises): that process
must never be killed by the test, as PID 1 is never killed on a node. It does not read any mount.
"""

from __future__ import annotations

import array
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from fuse_client.control import DaemonNotRunning, request_json

from .fuse_helpers import LAYERCTL, READY_TIMEOUT, force_unmount

SLOTS = 4  # FileDescriptorStoreMax= of the shipped unit
RESTART_SEC = 0.1  # systemd's default RestartSec=

# Runs `layerctl daemon` with the stored fds moved to 3.. (first out of the way, above 64, so that
# no move overwrites an fd still to be moved) and LISTEN_PID naming itself (exec keeps the pid).
_LISTEN_WRAPPER = (
    "import fcntl, os, sys\n"
    "src = [int(x) for x in sys.argv[1].split(',') if x]\n"
    "high = [fcntl.fcntl(f, fcntl.F_DUPFD, 64) for f in src]\n"
    "for f in src:\n"
    "    os.close(f)\n"
    "for k, h in enumerate(high):\n"
    "    os.dup2(h, 3 + k)\n"
    "    os.close(h)\n"
    "if src:\n"
    "    os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS=str(len(src)), LISTEN_FDNAMES=sys.argv[2])\n"
    "os.execv(sys.argv[3], sys.argv[3:])\n")


def parse_notify(msg: bytes) -> dict[str, str]:
    """The `KEY=value` lines of an sd_notify datagram (pure)."""
    return dict(line.split("=", 1) for line in msg.decode(errors="replace").splitlines() if "=" in line)


class FdStoreManager:
    """The stand-in manager of one node daemon (module doc). `start()` starts the first daemon and
    returns once it answers; `close()` stops it for good and lets every stored fd go."""

    def __init__(self, store_url: str, cache_dir: Path, mountpoint: Path, workdir: Path, *,
                 slots: int = SLOTS, restart_sec: float = RESTART_SEC) -> None:
        self.store_url = store_url
        self.cache_dir = Path(cache_dir)
        self.mountpoint = Path(mountpoint)
        self.workdir = Path(workdir)
        self.slots = slots
        self.restart_sec = restart_sec
        self.log = self.workdir / "managed-daemon.log"
        self.socket_path = self.workdir / "notify.sock"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self.sock.bind(os.fspath(self.socket_path))
        self.sock.settimeout(0.2)
        self.lock = threading.Lock()
        self.stored: dict[str, int] = {}  # FDNAME -> fd, in the order stored
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts: list[tuple[float, int, int]] = []  # (monotonic time, pid, fds passed)
        self.exits: list[tuple[float, int, int]] = []  # (monotonic time, pid, returncode)
        self.messages: list[dict[str, str]] = []
        self.spawn_errors: list[str] = []
        self.closing = threading.Event()
        self.threads: list[threading.Thread] = []

    # -- the fd store -----------------------------------------------------------------------

    def _receive_loop(self) -> None:
        while not self.closing.is_set():
            fds = array.array("i")
            try:
                msg, anc, _flags, _addr = self.sock.recvmsg(4096, socket.CMSG_SPACE(16 * fds.itemsize))
            except TimeoutError:
                continue
            except OSError:
                return
            for level, kind, data in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
            self.take(parse_notify(msg), list(fds))

    def take(self, fields: dict[str, str], fds: list[int]) -> None:
        """One notify message: store, replace or remove fds as systemd's fd store would."""
        keep: list[int] = []
        with self.lock:
            self.messages.append(fields)
            name = fields.get("FDNAME", "stored")
            if fields.get("FDSTORE") == "1" and fds:
                old = self.stored.pop(name, None)
                if old is not None:
                    os.close(old)
                if len(self.stored) < self.slots:
                    self.stored[name] = keep_fd = fds[0]
                    keep.append(keep_fd)
            elif fields.get("FDSTOREREMOVE") == "1":
                old = self.stored.pop(name, None)
                if old is not None:
                    os.close(old)
        for fd in fds:
            if fd not in keep:
                os.close(fd)

    def stored_names(self) -> list[str]:
        with self.lock:
            return list(self.stored)

    def wait_stored(self, prefix: str = "fanotify-", timeout: float = 30.0) -> str:
        """The name of a stored fd starting with `prefix`, once there is one."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for name in self.stored_names():
                if name.startswith(prefix):
                    return name
            time.sleep(0.01)
        raise AssertionError(f"nothing named {prefix}* in the fd store within {timeout} s: {self.messages}")

    # -- the daemon -------------------------------------------------------------------------

    def _spawn(self) -> subprocess.Popen[bytes]:
        with self.lock:
            names, fds = list(self.stored), list(self.stored.values())
            env = {k: v for k, v in os.environ.items()
                   if k not in ("LAYERSTORE_DATA_PATH", "LAYERSTORE_STORE", "LISTEN_FDS", "LISTEN_PID",
                                "LISTEN_FDNAMES")}
            env.update(FDSTORE=str(self.slots), NOTIFY_SOCKET=os.fspath(self.socket_path))
            with open(self.log, "ab") as logf:
                proc = subprocess.Popen(
                    [sys.executable, "-c", _LISTEN_WRAPPER, ",".join(map(str, fds)), ":".join(names), LAYERCTL,
                     "daemon", "--store", self.store_url, "--cache", str(self.cache_dir),
                     "--mountpoint", str(self.mountpoint)],
                    stdout=logf, stderr=subprocess.STDOUT, env=env, pass_fds=tuple(fds))
            self.proc = proc
            self.starts.append((time.monotonic(), proc.pid, len(fds)))
        return proc

    def _supervise(self, proc: subprocess.Popen[bytes]) -> None:
        while True:
            rc = proc.wait()
            self.exits.append((time.monotonic(), proc.pid, rc))
            if self.closing.is_set() or rc == 0:
                return  # (Restart=on-failure: a clean exit is not restarted)
            while True:
                if self.closing.wait(self.restart_sec):
                    return
                try:
                    proc = self._spawn()
                    break
                except OSError as e:  # (systemd retries too; seen here in `spawn_errors`)
                    self.spawn_errors.append(repr(e))

    def start(self) -> int:
        """Start receiving and the first daemon; its pid once it answers."""
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        receiver = threading.Thread(target=self._receive_loop, name="fdstore-receive", daemon=True)
        receiver.start()
        self.threads.append(receiver)
        proc = self._spawn()
        supervisor = threading.Thread(target=self._supervise, args=(proc,), name="fdstore-supervise", daemon=True)
        supervisor.start()
        self.threads.append(supervisor)
        return self.wait_answering()

    def pid(self) -> int | None:
        with self.lock:
            return None if self.proc is None else self.proc.pid

    def wait_answering(self, not_pid: int | None = None, timeout: float = READY_TIMEOUT) -> int:
        """The pid of the current daemon once it answers on the control socket (and is not
        `not_pid`: the one just killed)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            pid = self.pid()
            if pid is not None and pid != not_pid:
                with contextlib.suppress(OSError, DaemonNotRunning, KeyError, ValueError):
                    if request_json(self.cache_dir, "GET", "/stats", timeout=2)["pid"] == pid:
                        return pid
            time.sleep(0.005)
        raise AssertionError(f"no managed daemon answered within {timeout} s:\n{self.log_text()[-4000:]}")

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def close(self, timeout: float = 30.0) -> None:
        """Stop the daemon (SIGTERM, then SIGKILL), stop restarting, let every stored fd go,
        and clear the daemon's mount. Whatever is mounted on a stored group should be gone first."""
        self.closing.set()
        for _ in range(2):  # (again if the supervision started one as this began)
            proc = self.proc
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            for t in self.threads:
                t.join(5)
        with self.lock:
            for fd in self.stored.values():
                with contextlib.suppress(OSError):
                    os.close(fd)
            self.stored.clear()
        self.sock.close()
        force_unmount(self.mountpoint)

    def __enter__(self) -> FdStoreManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

