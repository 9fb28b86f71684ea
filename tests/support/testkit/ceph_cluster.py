"""A real single-node Ceph (16.2) on loopback, for tests and benchmarks.

One `CephCluster(workdir)` owns everything under `workdir`: the config, every daemon's data, logs,
admin sockets and pid files, and the ceph-fuse mount points. Nothing is written anywhere else and
nothing listens on anything but 127.0.0.1. Daemons: one mon, one mgr, one memstore OSD, radosgw (S3
on a free loopback port), one mds with a CephFS filesystem, and ceph-fuse clients. Every daemon runs
in the foreground (`-f`) as our child and is tracked by PID; `state.json` in `workdir` records the
PIDs and mounts so that another process (`python -m testkit.ceph_cluster stop DIR`) can tear it down.

The shell entry point, with the project's Python (mounts go through the project's `layerstore.linux`):

    python -m testkit.ceph_cluster start DIR    # prints endpoint, keys and mount as JSON, leaves it running
    python -m testkit.ceph_cluster stop DIR

See docs/ceph-test-cluster.md for the design notes.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from layerstore import linux

STATE_FILE = "state.json"
CONF_FILE = "ceph.conf"
S3_USER = "layerstore"
FS_NAME = "cephfs"



class CephError(RuntimeError):
    """The cluster could not be started or a command against it failed."""


@dataclass
class Daemon:
    name: str  # e.g. "mon.a", "rgw", "fuse.admin"
    pid: int
    popen: subprocess.Popen[bytes] | None = None  # None when adopted from a state file


def _free_port() -> int:
    """A free loopback port below the kernel's ephemeral range, so that no outgoing connection
    can take it between this check and the daemon's bind."""
    low = 20000
    try:
        low_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low_ephemeral = 32768
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(low, max(low_ephemeral, low + 1000))
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def _mountpoints() -> set[str]:
    return set(linux.read_mounts())


def _umount(path: str, *, lazy: bool = False) -> bool:
    return linux.umount2(path, linux.MNT_DETACH if lazy else 0) == 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie child of ours counts as gone
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class CephCluster:
    """A single-node Ceph under `workdir`. Use as a context manager or call `start()`/`stop()`.

    `die_with_parent` starts a small reaper process that watches this process and runs `stop()`
    from the state file if it dies without stopping the cluster (a test run killed outright), so
    no daemon or mount outlives it. The shell entry point turns it off: leaving the cluster running
    is its whole point. (PR_SET_PDEATHSIG would not do: every daemon would get its signal at once,
    the mon would die first, and the MDS, OSD and ceph-fuse would then wait for it forever.)"""

    def __init__(self, workdir: str | os.PathLike[str], *, memstore_mib: int = 4096,
                 die_with_parent: bool = True, verbose: bool = False) -> None:
        self.workdir = Path(workdir).absolute()
        self.conf = self.workdir / CONF_FILE
        self.memstore_mib = memstore_mib
        self.die_with_parent = die_with_parent
        self.verbose = verbose
        self.fsid = str(uuid.uuid4())
        self.mon_port = 0
        self.rgw_port = 0
        self.access_key = ""
        self.secret_key = ""
        self.daemons: dict[str, Daemon] = {}
        self.reaper: Daemon | None = None
        self.mounts: dict[str, str] = {}  # ceph-fuse client id -> mount path
        self.timings: dict[str, float] = {}
        self._lock = threading.RLock()
        self._t0 = 0.0

    # -- public facts --------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.rgw_port}"

    @property
    def mount_path(self) -> Path:
        """The CephFS mount of the first ceph-fuse client."""
        if "admin" not in self.mounts:
            raise CephError("CephFS is not mounted")
        return Path(self.mounts["admin"])

    def info(self) -> dict[str, object]:
        return {
            "workdir": str(self.workdir),
            "conf": str(self.conf),
            "fsid": self.fsid,
            "endpoint": self.endpoint if self.rgw_port else None,
            "access_key": self.access_key,
            "secret_key": self.secret_key,
            "region": "us-east-1",
            "mount": self.mounts.get("admin"),
            "mounts": dict(self.mounts),
            "pids": {name: d.pid for name, d in self.daemons.items()},
            "reaper": self.reaper.pid if self.reaper else None,
            "timings": dict(self.timings),
        }

    def s3_env(self) -> dict[str, str]:
        """The standard boto3 environment variables for the S3 user."""
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_DEFAULT_REGION": "us-east-1"}

    # -- lifecycle -----------------------------------------------------------------------
    def __enter__(self) -> CephCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, *, cephfs: bool = True, timeout: float = 90.0) -> None:
        """Bring the cluster up: S3-ready on return, and CephFS mounted if `cephfs`. On any
        failure everything started so far is stopped again before the error propagates."""
        try:
            self._start(cephfs=cephfs, timeout=timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, *, cephfs: bool, timeout: float) -> None:
        if shutil.which("ceph-mon") is None:
            raise CephError("ceph-mon not found: install ceph-mon ceph-mgr ceph-osd radosgw ceph-mds ceph-fuse")
        self._t0 = time.monotonic()
        deadline = self._t0 + timeout
        self._cleanup_stale()
        for sub in ("mon/a", "mgr/x", "osd/0", "mds/a", "run", "log", "mnt", "crash"):
            (self.workdir / sub).mkdir(parents=True, exist_ok=True)
        self.mon_port = _free_port()
        self.rgw_port = _free_port()
        self.access_key = "LS" + secrets.token_hex(9).upper()
        self.secret_key = secrets.token_urlsafe(30)
        self._write_conf()
        self._save_state()
        if self.die_with_parent:
            self._start_reaper()

        self._run(["monmaptool", "--create", "--clobber", "--fsid", self.fsid,
                   "--addv", "a", f"[v2:127.0.0.1:{self.mon_port}]", str(self.workdir / "monmap")])
        self._run(["ceph-mon", "-c", str(self.conf), "--mkfs", "-i", "a",
                   "--monmap", str(self.workdir / "monmap")])
        mon = self._spawn("mon.a", ["ceph-mon", "-f", "-i", "a"])

        def mon_up() -> bool:
            if not _alive(mon.pid):
                raise CephError(f"ceph-mon exited during start-up; see {self.workdir}/log/mon.a.log")
            return _port_open(self.mon_port)

        self._wait(mon_up, deadline, "the monitor to listen")
        self._mark("mon")

        osd_uuid = str(uuid.uuid4())
        # One CLI process for all the map changes: each `ceph` start costs ~0.3 s of Python.
        commands = [f"osd new {osd_uuid} 0"]
        if cephfs:
            commands += ["osd pool create cephfs_metadata 8", "osd pool create cephfs_data 8",
                         f"fs new {FS_NAME} cephfs_metadata cephfs_data"]
        self.ceph_batch(commands, timeout=max(deadline - time.monotonic(), 1))
        self._mark("maps")

        self._run(["ceph-osd", "-c", str(self.conf), "--mkfs", "-i", "0", "--osd-uuid", osd_uuid])
        self._spawn("osd.0", ["ceph-osd", "-f", "-i", "0"])
        self._spawn("mgr.x", ["ceph-mgr", "-f", "-i", "x"])
        self.start_rgw(wait=False)
        if cephfs:
            self._spawn("mds.a", ["ceph-mds", "-f", "-i", "a"])
        self._wait_rgw(deadline)
        self._mark("rgw")
        self.radosgw_admin("user", "create", f"--uid={S3_USER}", f"--display-name={S3_USER}",
                           f"--access-key={self.access_key}", f"--secret-key={self.secret_key}",
                           timeout=max(deadline - time.monotonic(), 1))
        self._save_state()
        self._mark("s3_ready")
        if cephfs:
            self.mount_client("admin", timeout=max(deadline - time.monotonic(), 1))
            self._mark("cephfs_mounted")

    def stop(self) -> None:
        """Unmount every ceph-fuse mount, then stop every daemon by PID (SIGTERM, SIGKILL after a
        timeout). Idempotent; never raises for a daemon that is already gone."""
        with self._lock:
            reaper, self.reaper = self.reaper, None
            if reaper is not None and reaper.pid != os.getpid():
                self._terminate([reaper], timeout=2.0)
            for cid in list(self.mounts):
                t = time.monotonic()
                with contextlib.suppress(Exception):
                    self.unmount_client(cid)
                if self.verbose:
                    print(f"ceph: unmounted {cid} in {time.monotonic() - t:.2f}s", file=sys.stderr)
            # Clients of the cluster first, the mon last: an OSD or MDS that loses its mon early
            # only waits for it, which would cost the whole SIGTERM timeout.
            # The MDS's orderly shutdown spends seconds on a goodbye to the mon that nobody needs
            # here (its state lives in the memstore OSD, which is about to go away anyway).
            order = (("fuse.", 5.0), ("rgw", 10.0), ("mds.", 1.0), ("mgr.", 10.0), ("osd.", 5.0), ("mon.", 10.0))
            for group, timeout in order:
                names = [n for n in self.daemons if n.startswith(group)]
                t = time.monotonic()
                self._terminate([self.daemons[n] for n in names], timeout=timeout)
                if self.verbose and names:
                    print(f"ceph: stopped {' '.join(names)} in {time.monotonic() - t:.2f}s", file=sys.stderr)
                for n in names:
                    self.daemons.pop(n, None)
            for name in list(self.daemons):  # anything not in a known group
                self._terminate([self.daemons.pop(name)])
            # A mount of a ceph-fuse that died on its own, or one left by a killed run.
            for path in _mountpoints():
                if path.startswith(str(self.workdir / "mnt") + "/"):
                    _umount(path) or _umount(path, lazy=True)
            self.mounts.clear()
            if self.workdir.is_dir():
                self._save_state()

    # -- radosgw -------------------------------------------------------------------------
    def start_rgw(self, *, wait: bool = True, timeout: float = 30.0) -> None:
        """Start radosgw on the same port as before (so existing clients see it come back)."""
        with self._lock:
            if "rgw" in self.daemons and _alive(self.daemons["rgw"].pid):
                return
            self._spawn("rgw", ["radosgw", "-f", "-n", "client.rgw.gw"])
        if wait:
            self._wait_rgw(time.monotonic() + timeout)

    def stop_rgw(self, *, timeout: float = 10.0) -> None:
        """Stop radosgw (the S3 store "goes down"); `start_rgw()` brings it back."""
        with self._lock:
            d = self.daemons.pop("rgw", None)
            if d is not None:
                self._terminate([d], timeout=timeout)
            self._save_state()
        end = time.monotonic() + timeout
        while _port_open(self.rgw_port) and time.monotonic() < end:
            time.sleep(0.05)

    def _wait_rgw(self, deadline: float) -> None:
        def ready() -> bool:
            d = self.daemons.get("rgw")
            if d is None or not _alive(d.pid):
                raise CephError(f"radosgw exited during start-up; see {self.workdir}/log/client.rgw.gw.log")
            return _port_open(self.rgw_port)

        self._wait(ready, deadline, "radosgw to listen")

    # -- CephFS clients ------------------------------------------------------------------
    def mount_client(self, client_id: str, *, timeout: float = 30.0) -> Path:
        """Mount CephFS with a new ceph-fuse client `client.<client_id>` (its own session, cache
        and caps: a separate node, for cross-client tests). Returns the mount path."""
        if not client_id.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"bad client id {client_id!r}")
        with self._lock:
            if client_id in self.mounts:
                return Path(self.mounts[client_id])
            path = self.workdir / "mnt" / client_id
            path.mkdir(parents=True, exist_ok=True)
            name = f"fuse.{client_id}"
            self._spawn(name, ["ceph-fuse", "-f", "--id", client_id, str(path)])
            self.mounts[client_id] = str(path)
            self._save_state()
        deadline = time.monotonic() + timeout

        def mounted() -> bool:
            d = self.daemons.get(name)
            if d is None or not _alive(d.pid):
                raise CephError(f"ceph-fuse --id {client_id} exited; see {self.workdir}/log/client.{client_id}.log")
            return str(path) in _mountpoints()

        try:
            self._wait(mounted, deadline, f"ceph-fuse --id {client_id} to mount")
            # the mount point appears before the first MDS session is up; a stat waits for it
            os.stat(path)
        except BaseException:
            with contextlib.suppress(Exception):
                self.unmount_client(client_id)
            raise
        return path

    def unmount_client(self, client_id: str, *, timeout: float = 10.0) -> None:
        """Unmount a ceph-fuse client and wait for its process to exit. If the mount is busy or
        the process does not exit, the mount is detached and the process killed."""
        with self._lock:
            path = self.mounts.pop(client_id, None)
            d = self.daemons.pop(f"fuse.{client_id}", None)
            alive = d is not None and self._owned(d)
            clean = False
            if path is not None and path in _mountpoints():
                # A dead client's mount (ENOTCONN) or a busy one can only be detached; a detached
                # mount keeps its client busy while files stay open, so the client is then killed.
                clean = alive and _umount(path)
                if not clean:
                    _umount(path, lazy=True)
            if d is not None and not self._wait_exit(d, timeout if clean else 0.2):
                self._terminate([d], timeout=2.0)
            if path is not None and path in _mountpoints():
                _umount(path, lazy=True)
            self._save_state()

    # -- running Ceph commands -----------------------------------------------------------
    def ceph(self, *args: str, timeout: float = 30.0) -> str:
        """Run the `ceph` CLI against this cluster; returns its stdout."""
        return self._run(["ceph", "-c", str(self.conf), "--connect-timeout", str(int(timeout) or 1), *args],
                         timeout=timeout)

    def radosgw_admin(self, *args: str, timeout: float = 30.0) -> str:
        """Run `radosgw-admin` against this cluster; returns its stdout."""
        return self._run(["radosgw-admin", "-c", str(self.conf), *args], timeout=timeout)

    def create_s3_user(self, uid: str) -> tuple[str, str]:
        """Another S3 user (no access to the main user's buckets); returns (access, secret)."""
        access, secret = "LS" + secrets.token_hex(9).upper(), secrets.token_urlsafe(30)
        self.radosgw_admin("user", "create", f"--uid={uid}", f"--display-name={uid}",
                           f"--access-key={access}", f"--secret-key={secret}")
        return access, secret

    def ceph_batch(self, commands: list[str], *, timeout: float = 30.0) -> str:
        """Run several `ceph` commands in one CLI process (its interactive mode reads stdin)."""
        out = self._run(["ceph", "-c", str(self.conf), "--connect-timeout", str(int(timeout) or 1)],
                        timeout=timeout, stdin="\n".join(commands) + "\n")
        return out

    def _run(self, argv: list[str], *, timeout: float = 30.0, stdin: str | None = None) -> str:
        if self.verbose:
            print("+", " ".join(argv), file=sys.stderr)
        try:
            p = subprocess.run(argv, input=stdin.encode() if stdin is not None else None,
                               capture_output=True, timeout=timeout, cwd=self.workdir, check=False)
        except subprocess.TimeoutExpired:
            raise CephError(f"{' '.join(argv[:4])}: timed out after {timeout:.0f}s") from None
        except FileNotFoundError:
            raise CephError(f"{argv[0]} not found: are the Ceph packages installed?") from None
        err = p.stderr.decode(errors="replace")
        # the interactive CLI reports failures on stderr but still exits 0
        if p.returncode != 0 or (stdin is not None and "Error" in err):
            raise CephError(f"{' '.join(argv[:4])} failed (exit {p.returncode}): {err.strip()[-2000:]}")
        return p.stdout.decode(errors="replace")

    # -- process tracking ----------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str]) -> Daemon:
        argv = [argv[0], "-c", str(self.conf), *argv[1:]]
        if self.verbose:
            print("+", " ".join(argv), "&", file=sys.stderr)
        log = open(self.workdir / "log" / f"{name}.out", "ab")  # noqa: SIM115 - handed to the child
        try:
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                 cwd=self.workdir, start_new_session=True)
        except FileNotFoundError:
            raise CephError(f"{argv[0]} not found: are the Ceph packages installed?") from None
        finally:
            log.close()
        d = Daemon(name, p.pid, p)
        with self._lock:
            self.daemons[name] = d
            self._save_state()
        return d

    def _start_reaper(self) -> None:
        argv = [sys.executable, os.path.abspath(__file__), "reap", str(os.getpid()), str(self.workdir)]
        with open(self.workdir / "log" / "reaper.out", "ab") as log:
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                 cwd=self.workdir, start_new_session=True)
        self.reaper = Daemon("reaper", p.pid, p)
        self._save_state()

    def _wait_exit(self, d: Daemon, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if d.popen is not None:
                if d.popen.poll() is not None:
                    return True
            elif not _alive(d.pid):
                return True
            time.sleep(0.02)
        return False

    def _terminate(self, daemons: list[Daemon], timeout: float = 10.0) -> None:
        live = [d for d in daemons if self._owned(d)]
        for d in live:
            with contextlib.suppress(ProcessLookupError):
                os.kill(d.pid, signal.SIGTERM)
        end = time.monotonic() + timeout
        for d in live:
            if not self._wait_exit(d, max(end - time.monotonic(), 0)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(d.pid, signal.SIGKILL)
                self._wait_exit(d, 5)
        for d in daemons:
            if d.popen is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    d.popen.wait(timeout=1)

    def _owned(self, d: Daemon) -> bool:
        """Is `d.pid` still the daemon we started? A PID from a state file may have been reused."""
        if d.popen is not None:
            return d.popen.poll() is None
        try:
            with open(f"/proc/{d.pid}/cmdline", "rb") as f:
                cmdline = f.read().split(b"\0")
        except OSError:
            return False
        mine = os.fsencode(self.conf) in cmdline or (d.name == "reaper" and os.fsencode(self.workdir) in cmdline)
        return mine and _alive(d.pid)

    def _wait(self, cond: object, deadline: float, what: str) -> None:
        assert callable(cond)
        while not cond():
            if time.monotonic() > deadline:
                raise CephError(f"timed out waiting for {what}; logs in {self.workdir}/log")
            time.sleep(0.02)

    def _mark(self, step: str) -> None:
        self.timings[step] = round(time.monotonic() - self._t0, 3)
        if self.verbose:
            print(f"ceph: {step} after {self.timings[step]:.2f}s", file=sys.stderr)

    # -- state on disk -------------------------------------------------------------------
    def _save_state(self) -> None:
        tmp = self.workdir / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(self.info(), indent=2) + "\n")
        os.replace(tmp, self.workdir / STATE_FILE)

    @classmethod
    def adopt(cls, workdir: str | os.PathLike[str], *, verbose: bool = False) -> CephCluster:
        """A handle on a cluster started by another process, from its state file."""
        c = cls(workdir, die_with_parent=False, verbose=verbose)
        try:
            state = json.loads((c.workdir / STATE_FILE).read_text())
        except (OSError, ValueError) as e:
            raise CephError(f"no cluster state in {c.workdir}: {e}") from None
        c.fsid = state["fsid"]
        c.access_key, c.secret_key = state["access_key"], state["secret_key"]
        if state.get("endpoint"):
            c.rgw_port = int(state["endpoint"].rsplit(":", 1)[1])
        c.daemons = {n: Daemon(n, int(pid)) for n, pid in state["pids"].items()}
        if state.get("reaper"):
            c.reaper = Daemon("reaper", int(state["reaper"]))
        c.mounts = dict(state["mounts"])
        return c

    def _cleanup_stale(self) -> None:
        """A previous run in the same directory that was killed: stop what it left."""
        if (self.workdir / STATE_FILE).exists():
            with contextlib.suppress(CephError, KeyError, ValueError):
                CephCluster.adopt(self.workdir).stop()
        for sub in ("mon", "mgr", "osd", "mds", "run"):
            shutil.rmtree(self.workdir / sub, ignore_errors=True)

    def _write_conf(self) -> None:
        d = self.workdir
        self.conf.write_text(f"""\
# Generated by tests/support/testkit/ceph_cluster.py: a throw-away single-node cluster on loopback.
[global]
fsid = {self.fsid}
mon host = v2:127.0.0.1:{self.mon_port}
public addr = 127.0.0.1
cluster addr = 127.0.0.1
ms bind msgr1 = false
ms bind ipv6 = false
# auth none; the mon client mode must then be crc, or radosgw loops on error -13
auth cluster required = none
auth service required = none
auth client required = none
ms mon client mode = crc
keyring = {d}/keyring
run dir = {d}/run
admin socket = {d}/run/$name.$pid.asok
pid file = {d}/run/$name.$pid.pid
crash dir = {d}/crash
log to stderr = false
err to stderr = false
log to syslog = false
mon cluster log file = {d}/log/cluster.log
# one OSD: pools of size 1, few PGs
osd pool default size = 1
osd pool default min size = 1
mon allow pool size one = true
mon warn on pool no redundancy = false
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
mon max pg per osd = 1000
osd crush chooseleaf type = 0
# without this, every map change (pool creation) waits ~1 s
paxos propose interval = 0.05
mon data avail crit = 1
mon data avail warn = 2
osd objectstore = memstore
memstore device bytes = {self.memstore_mib * 1024 * 1024}
osd op num shards = 2
osd op num threads per shard = 2
client mount timeout = 30
rados mon op timeout = 30

[mon]
mon data = {d}/mon/$id
log file = {d}/log/$name.log

[mgr]
mgr data = {d}/mgr/$id
log file = {d}/log/$name.log

[osd]
osd data = {d}/osd/$id
log file = {d}/log/$name.log

[mds]
mds data = {d}/mds/$id
log file = {d}/log/$name.log
# cross-client visibility: caps are revoked and sessions ticked quickly
mds tick interval = 0.2

[client]
log file = {d}/log/$name.log

[client.rgw.gw]
# tcp_nodelay: without it a small response waits ~40 ms for the client's delayed ACK (Nagle)
rgw frontends = beast endpoint=127.0.0.1:{self.rgw_port} tcp_nodelay=1
rgw dns name = 127.0.0.1
rgw enable usage log = false
rgw dynamic resharding = false
""")
        (d / "keyring").touch()


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    verbose = "-v" in args
    args = [a for a in args if a != "-v"]
    if len(args) == 3 and args[0] == "reap":
        return _reap(int(args[1]), args[2])
    if len(args) != 2 or args[0] not in ("start", "stop"):
        print("usage: ceph_cluster.py [-v] start|stop DIR", file=sys.stderr)
        return 2
    cmd, workdir = args
    if cmd == "start":
        Path(workdir).mkdir(parents=True, exist_ok=True)
        c = CephCluster(workdir, die_with_parent=False, verbose=verbose)
        try:
            c.start()
        except CephError as e:
            print(f"ceph_cluster: {e}", file=sys.stderr)
            return 1
        print(json.dumps(c.info(), indent=2))
        return 0
    try:
        CephCluster.adopt(workdir, verbose=verbose).stop()
    except CephError as e:
        print(f"ceph_cluster: {e}", file=sys.stderr)
        return 1
    return 0


def _reap(owner: int, workdir: str) -> int:
    """The reaper: wait for `owner` to die, then stop what it left running."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while _alive(owner):
        time.sleep(0.5)
    try:
        CephCluster.adopt(workdir).stop()
    except CephError as e:
        print(f"ceph_cluster reaper: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
