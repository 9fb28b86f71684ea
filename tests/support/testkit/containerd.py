"""A real containerd (Debian's 1.6) for tests: its own root, state, sockets and namespace, the cri
plugin disabled (or enabled with `cri=Cri(...)`: testkit.cri speaks to it), optional
`proxy_plugins` snapshotters; stopped by PID and cleaned up even when a test fails (tasks killed
and deleted, leftover shims of THIS containerd killed by PID, mounts under its directories
detached, the empty cgroups containerd leaves removed).

    with containerd(Path("/run/ls-ctd-x"), snapshotters={"layerstore": "/run/x/snap.sock"}) as ctd:
        ctd.ctr("images", "ls")                       # ctr with --address and --namespace
        ctd.address, ctd.namespace, ctd.pid
        ctd.restart()                                 # SIGTERM + start again (tasks keep running)

Paths go under a short directory (unix socket paths are limited to 108 bytes). The module imports
nothing of the project.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

CONTAINERD = shutil.which("containerd") or "/usr/bin/containerd"
CTR = shutil.which("ctr") or "/usr/bin/ctr"
START_TIMEOUT = 20.0
CGROUP_ROOT = Path("/sys/fs/cgroup")
CRI_PLUGIN = "io.containerd.grpc.v1.cri"
CRI_NAMESPACE = "k8s.io"  # the CRI plugin's containerd namespace
CNI_BIN = "/usr/lib/cni"  # Debian's containernetworking-plugins
needs_containerd = pytest.mark.containerd  # skipped by tests/conftest.py where containerd_missing() says why


def containerd_missing() -> str:
    """Why containerd tests cannot run here ("" if they can)."""
    ok = os.path.exists(CONTAINERD) and os.path.exists(CTR)
    return "" if ok else "needs containerd and ctr (.ci/install-deps.sh)"


@dataclass(frozen=True)
class Cri:
    """The CRI plugin's settings for a test containerd: the shipped config's CRI section
    (snapshotter/contrib/containerd-cri.toml: snapshotter, snapshot annotations, runtime) with the
    pause image, the plain-HTTP registries and the CNI directories of the test."""
    sandbox_image: str
    plain_http: tuple[str, ...] = ()  # registry hosts reached over HTTP
    snapshotter: str = ""  # instead of the shipped one (e.g. "overlayfs", for the ordinary path)
    contrib: Path = Path(__file__).resolve().parents[3] / "snapshotter" / "contrib" / "containerd-cri.toml"

    def section(self, root: Path) -> list[str]:
        with open(self.contrib, "rb") as f:
            shipped = tomllib.load(f)["plugins"][CRI_PLUGIN]
        c = shipped["containerd"]
        cri = f'[plugins."{CRI_PLUGIN}"]'
        lines = [cri, f'  sandbox_image = "{self.sandbox_image}"',
                 # a private stream server port: several test containerds may run at once
                 '  stream_server_address = "127.0.0.1"', '  stream_server_port = "0"',
                 # this machine may not lower oom_score_adj (pods ask for -998): cap at our own
                 "  restrict_oom_score_adj = true",
                 f'[plugins."{CRI_PLUGIN}".containerd]', f'  snapshotter = "{self.snapshotter or c["snapshotter"]}"',
                 f'  disable_snapshot_annotations = {str(c["disable_snapshot_annotations"]).lower()}',
                 f'  discard_unpacked_layers = {str(c["discard_unpacked_layers"]).lower()}',
                 f'  default_runtime_name = "{c["default_runtime_name"]}"']
        for name, rt in c["runtimes"].items():
            lines += [f'[plugins."{CRI_PLUGIN}".containerd.runtimes.{name}]',
                      f'  runtime_type = "{rt["runtime_type"]}"']
        lines += [f'[plugins."{CRI_PLUGIN}".cni]', f'  bin_dir = "{CNI_BIN}"', f'  conf_dir = "{root / "cni"}"']
        for host in self.plain_http:
            lines += [f'[plugins."{CRI_PLUGIN}".registry.mirrors."{host}"]', f'  endpoint = ["http://{host}"]']
        return [*lines, ""]


def config_toml(root: Path, snapshotters: dict[str, str], cri: Cri | None = None) -> str:
    lines = ["version = 2", f'root = "{root / "root"}"', f'state = "{root / "state"}"',
             *([] if cri else [f'disabled_plugins = ["{CRI_PLUGIN}"]']), "",
             "[grpc]", f'  address = "{root / "containerd.sock"}"', "",
             "[ttrpc]", f'  address = "{root / "containerd.sock.ttrpc"}"', "",
             "[debug]", '  level = "info"', "",
             '[plugins."io.containerd.internal.v1.opt"]', f'  path = "{root / "opt"}"', ""]
    for name, address in snapshotters.items():
        lines += [f"[proxy_plugins.{name}]", '  type = "snapshot"', f'  address = "{address}"', ""]
    if cri:
        lines += cri.section(root)
    return "\n".join(lines)


@dataclass
class Containerd:
    root: Path
    namespace: str
    snapshotters: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    started: list[int] = field(default_factory=list)
    namespaces: set[str] = field(default_factory=set)  # every namespace used (cleaned up at the end)

    @property
    def address(self) -> str:
        return str(self.root / "containerd.sock")

    @property
    def cri_address(self) -> str:
        """The CRI plugin's socket (containerd's gRPC socket: it serves runtime.v1 as well)."""
        return self.address

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def log(self) -> Path:
        return self.root / "containerd.log"

    def ctr(self, *args: str, check: bool = True, timeout: float = 120, input: bytes | None = None,
            namespace: str | None = None) -> subprocess.CompletedProcess[str]:
        """ctr in our namespace (or another one, cleaned up at the end as well)."""
        ns = namespace or self.namespace
        self.namespaces.add(ns)
        cmd = [CTR, "--address", self.address, "--namespace", ns, *args]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                             input=input.decode() if input is not None else None)
        if check and res.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} -> {res.returncode}\n{res.stdout}\n{res.stderr}\n"
                                 f"containerd log:\n{self.log_tail()}")
        return res

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([CONTAINERD, "--config", str(self.root / "config.toml")], stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.started.append(self.proc.pid)
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"containerd exited with {self.proc.returncode}:\n{self.log_tail()}")
            if os.path.exists(self.address):
                res = subprocess.run([CTR, "--address", self.address, "version"], capture_output=True, timeout=10)
                if res.returncode == 0:
                    return
            time.sleep(0.05)
        raise RuntimeError(f"containerd did not answer within {START_TIMEOUT}s:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM (then SIGKILL) the containerd we started; running tasks' shims stay."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def shim_pids(self) -> list[int]:
        """Shims started by this containerd (their command line names its address)."""
        out = []
        needle = self.address.encode()
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            if b"containerd-shim" in cmd and needle in cmd:
                out.append(int(entry))
        return out

    def remove_all(self, namespace: str | None = None) -> None:
        """Kill and delete every task and container of a namespace (best effort)."""
        if self.proc is None:
            return
        ns = namespace or self.namespace
        res = self.ctr("tasks", "ls", "-q", check=False, timeout=30, namespace=ns)
        for task in res.stdout.split():
            self.ctr("tasks", "kill", "-s", "SIGKILL", task, check=False, timeout=30, namespace=ns)
        for task in res.stdout.split():
            for _ in range(50):
                if self.ctr("tasks", "delete", "-f", task, check=False, timeout=30, namespace=ns).returncode == 0:
                    break
                time.sleep(0.1)
        res = self.ctr("containers", "ls", "-q", check=False, timeout=30, namespace=ns)
        for c in res.stdout.split():
            self.ctr("containers", "delete", c, check=False, timeout=30, namespace=ns)


def _detach_under(root: Path) -> None:
    from layerstore import linux

    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    prefix = str(root) + "/"
    for mp in sorted((p for p in points if p.startswith(prefix)), key=lambda p: p.count("/"), reverse=True):
        linux.umount2(linux.unescape(mp), linux.MNT_DETACH)  # the errno, if any, is ignored


def remove_cgroups(namespace: str) -> None:
    """containerd (runc) leaves empty cgroups named after the namespace: remove them, deepest first."""
    for base in [CGROUP_ROOT, *[p for p in CGROUP_ROOT.iterdir() if p.is_dir()]] if CGROUP_ROOT.exists() else []:
        top = base / namespace
        if not top.is_dir():
            continue
        for dirpath, _dirs, _files in sorted(os.walk(top), key=lambda w: w[0].count("/"), reverse=True):
            with contextlib.suppress(OSError):
                os.rmdir(dirpath)


@contextlib.contextmanager
def containerd(root: Path | None = None, *, snapshotters: dict[str, str] | None = None,
               namespace: str | None = None, cri: Cri | None = None) -> Iterator[Containerd]:
    """A running containerd under `root` (default: a fresh short directory under /run); with `cri`,
    its CRI plugin enabled (pods and containers in namespace k8s.io, removed at the end too)."""
    own_root = root is None
    root = root or Path(f"/run/ls-ctd-{secrets.token_hex(4)}")
    root.mkdir(mode=0o711, parents=True, exist_ok=True)
    (root / "opt").mkdir(exist_ok=True)
    (root / "cni").mkdir(exist_ok=True)
    (root / "config.toml").write_text(config_toml(root, snapshotters or {}, cri))
    ctd = Containerd(root, namespace or f"lstest-{secrets.token_hex(3)}", dict(snapshotters or {}))
    ctd.namespaces.add(ctd.namespace)
    if cri:
        ctd.namespaces.add(CRI_NAMESPACE)
    try:
        ctd.start()
        yield ctd
    finally:
        for ns in sorted(ctd.namespaces):
            with contextlib.suppress(Exception):
                ctd.remove_all(ns)
        ctd.stop()
        for pid in ctd.shim_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _detach_under(root)
        for ns in ctd.namespaces:
            remove_cgroups(ns)
            with contextlib.suppress(OSError):
                shutil.rmtree(Path("/run/containerd/runc") / ns)
        if own_root:
            shutil.rmtree(root, ignore_errors=True)
