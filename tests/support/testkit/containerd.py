"""A real containerd (Debian's 1.6) for tests: its own root, state, sockets and namespace, the cri
plugin disabled, optional `proxy_plugins` snapshotters; stopped by PID and cleaned up even when a
test fails (tasks killed and deleted, leftover shims of THIS containerd killed by PID, mounts under
its directories detached, the empty cgroups containerd leaves removed).

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
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

CONTAINERD = shutil.which("containerd") or "/usr/bin/containerd"
CTR = shutil.which("ctr") or "/usr/bin/ctr"
START_TIMEOUT = 20.0
CGROUP_ROOT = Path("/sys/fs/cgroup")
needs_containerd = pytest.mark.containerd  # skipped by tests/conftest.py where containerd_missing() says why


def containerd_missing() -> str:
    """Why containerd tests cannot run here ("" if they can)."""
    ok = os.path.exists(CONTAINERD) and os.path.exists(CTR)
    return "" if ok else "needs containerd and ctr (.ci/install-deps.sh)"


def config_toml(root: Path, snapshotters: dict[str, str]) -> str:
    lines = ["version = 2", f'root = "{root / "root"}"', f'state = "{root / "state"}"',
             'disabled_plugins = ["io.containerd.grpc.v1.cri"]', "",
             "[grpc]", f'  address = "{root / "containerd.sock"}"', "",
             "[ttrpc]", f'  address = "{root / "containerd.sock.ttrpc"}"', "",
             "[debug]", '  level = "info"', "",
             '[plugins."io.containerd.internal.v1.opt"]', f'  path = "{root / "opt"}"', ""]
    for name, address in snapshotters.items():
        lines += [f"[proxy_plugins.{name}]", '  type = "snapshot"', f'  address = "{address}"', ""]
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
               namespace: str | None = None) -> Iterator[Containerd]:
    """A running containerd under `root` (default: a fresh short directory under /run)."""
    own_root = root is None
    root = root or Path(f"/run/ls-ctd-{secrets.token_hex(4)}")
    root.mkdir(mode=0o711, parents=True, exist_ok=True)
    (root / "opt").mkdir(exist_ok=True)
    (root / "config.toml").write_text(config_toml(root, snapshotters or {}))
    ctd = Containerd(root, namespace or f"lstest-{secrets.token_hex(3)}", dict(snapshotters or {}))
    ctd.namespaces.add(ctd.namespace)
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
