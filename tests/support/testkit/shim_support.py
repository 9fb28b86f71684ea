"""Helpers for the runtime shim tests (no tests here): a busybox rootfs, EROFS images made with
mkfs.erofs, and a node clean-up that unmounts and stops whatever a test left, even on failure."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from layerstore import digest as digestmod
from layerstore import linux
from runtime_shim.nodestate.state import NodeState
from runtime_shim.resolve.environment import EnvSpec, LayerSpec
from runtime_shim.supervise.daemon import is_alive

if TYPE_CHECKING:
    from runtime_shim.node.shim import Shim

BUSYBOX = shutil.which("busybox")
needs_root = pytest.mark.root  # the `root` mark under its older name (tests/conftest.py skips it without root)
needs_busybox = pytest.mark.skipif(BUSYBOX is None or not os.path.exists("/usr/share/doc/busybox-static"),
                                   reason="needs busybox-static (.ci/install-deps.sh)")
needs_runc = pytest.mark.skipif(shutil.which("runc") is None, reason="needs runc (.ci/install-deps.sh)")
APPLETS = ["sh", "echo", "cat", "ls", "mkdir", "rm", "touch", "stat", "id", "hostname", "ip", "test", "sleep",
           "wc", "mv", "find", "readlink", "true", "false", "seq", "head", "printf", "ps", "mount", "grep",
           "unshare"]
CONFIG = {"entrypoint": [], "cmd": ["/bin/sh"], "env": [], "workdir": "/", "user": ""}


def busybox_rootfs(root: Path) -> Path:
    """A tiny real userland: static busybox and the directories a container expects."""
    (root / "bin").mkdir(parents=True)
    shutil.copy(BUSYBOX or "/bin/busybox", root / "bin" / "busybox")
    for applet in APPLETS:
        os.symlink("busybox", root / "bin" / applet)
    for d in ("etc", "tmp", "proc", "sys", "dev", "root"):
        (root / d).mkdir()
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534::/:/bin/false\n")
    (root / "etc" / "group").write_text("root:x:0:\nnogroup:x:65534:\n")
    (root / "etc" / "motd").write_text("base motd\n")
    return root


def mkfs(src: Path, image: Path) -> Path:
    subprocess.run(["mkfs.erofs", "-T0", "--all-root", "-U", "6a1f2b5c-0000-4000-8000-000000000001",
                    str(image), str(src)], check=True, capture_output=True)
    return image


def add_blob(blobs: Path, image: Path) -> str:
    """File `image` in a DirBlobs directory under its digest."""
    d = digestmod.of(image.read_bytes())
    blobs.mkdir(exist_ok=True)
    shutil.copy(image, blobs / d)
    return d


def spec(*layers: tuple[str, str], config: dict | None = None) -> EnvSpec:
    return EnvSpec("", tuple(LayerSpec(b, 0, role) for b, role in layers), dict(config or CONFIG), "test")


def node_mounts(*roots: Path) -> list[linux.MountEntry]:
    """Mounts at or below any of `roots`, or overlays whose upper lives there."""
    prefixes = [str(r) for r in roots]
    out = []
    for m in linux.read_mounts().values():
        if any(m.mountpoint == p or m.mountpoint.startswith(p + "/") or f"upperdir={p}/" in m.options
               for p in prefixes):
            out.append(m)
    return out


def loops_under(*roots: Path) -> list[str]:
    """Loop devices whose backing file lives at or below any of `roots` (a kept sandbox's upper image)."""
    out = []
    for dev in sorted(Path("/sys/block").glob("loop*")):
        try:
            backing = (dev / "loop" / "backing_file").read_text().strip().removesuffix(" (deleted)")
        except OSError:
            continue
        if any(backing == str(r) or backing.startswith(f"{r}/") for r in roots):
            out.append(f"/dev/{dev.name}")
    return out


def no_loops_left(*roots: Path, timeout: float = 20.0) -> bool:
    """Whether every loop device backed by a file under `roots` is gone, waiting up to `timeout`.
    An unmounted image's loop device is autocleared when its filesystem is released, and that
    can be a moment after umount(2) returns: a mount namespace another process created in the
    meantime (runc, unshare; the other test shard) holds a copy of the mount until it goes."""
    deadline = time.monotonic() + timeout
    while loops_under(*roots):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def stop_watch(node: Path) -> None:
    """Stop the shim's watch of the node (NODE/watch.pid, by pid and start time) and wait for it
    to end: it must not start a daemon again while a test's clean-up stops the daemon. A watch
    in the middle of a start finishes it first (it is then stopped with the daemon)."""
    from runtime_shim.supervise.daemon import proc_start_time

    try:
        pid, start = (int(x) for x in (node / "watch.pid").read_text().split())
    except (OSError, ValueError):
        return
    if proc_start_time(pid) != start:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 70  # (its start-up of a daemon waits up to 60 s)
    while proc_start_time(pid) == start and time.monotonic() < deadline:
        time.sleep(0.02)
    if proc_start_time(pid) == start:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def cleanup_node(node: Path, *extra_roots: Path) -> None:
    """Stop the watch, delete leftover containers, unmount everything (deepest first), stop the
    node daemon by pid, detach loop devices left on the node's files."""
    stop_watch(node)
    pids: list[tuple[int, int]] = []
    ids: list[str] = []
    if (node / "state").exists():
        with contextlib.suppress(Exception), NodeState(node / "state") as st, st.read() as t:
            rec = t.daemon()
            if rec is not None and is_alive(rec):
                pids.append((rec.pid, rec.start_time))
            ids = [sb.id for sb in t.sandboxes()]
    for rt in ("runc", "crun"):
        for sid in ids:
            if shutil.which(rt):
                subprocess.run([rt, "--root", str(node / "oci" / rt), "delete", "--force", sid],
                               capture_output=True)
    for m in sorted(node_mounts(node, *extra_roots), key=lambda m: m.mountpoint.count("/"), reverse=True):
        if m.mountpoint == str(node / "fuse"):
            continue
        with contextlib.suppress(linux.MountError):
            linux.umount(m.mountpoint, lazy=True)
    for pid, _ in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 20
    for pid, start in pids:
        from runtime_shim.nodestate.state import DaemonRecord

        rec = DaemonRecord(pid, start, "", "", "")
        while is_alive(rec) and time.monotonic() < deadline:
            time.sleep(0.02)
        if is_alive(rec):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)
    if linux.is_mount(node / "fuse"):
        with contextlib.suppress(linux.MountError):
            linux.umount(node / "fuse", lazy=True)
    for dev in loops_under(node, *extra_roots):  # (autocleared once unmounted: only a failed test's)
        subprocess.run(["losetup", "-d", dev], capture_output=True)
    assert not node_mounts(node, *extra_roots), "mounts left behind"


def busybox_image(root: Path) -> tuple[Path, str]:
    """A directory of blobs holding one busybox rootfs image made with mkfs.erofs (for `DirBlobs`),
    and that image's name."""
    blobs = root / "blobs"
    return blobs, add_blob(blobs, mkfs(busybox_rootfs(root / "base"), root / "base.img"))


def store_with_env(root: Path, base: Path, *build_args: str, tag: str = "bb:1") -> str:
    """A local store under `root` holding `base` built and pushed as the one layer of environment
    `tag`; returns the store's URL."""
    from .cli_helpers import layerctl

    url = str(root / "store")
    assert layerctl("store", "init", "--store", url).code == 0
    r = layerctl("build", str(base), "--push", "--store", url, *build_args, "--json")
    assert r.code == 0, r.err
    assert layerctl("env", "create", "--store", url, "--base", r.json()["blob"], "-t", tag).code == 0
    return url


@contextlib.contextmanager
def store_shim(tmp_path: Path, store_url: str) -> Iterator[Shim]:
    """The production shim (`Shim.for_node`) on a fresh node under `tmp_path`; the node's mounts
    and processes are torn down afterwards, also on failure."""
    from runtime_shim.node.shim import Shim

    node = tmp_path / "node"
    try:
        with Shim.for_node(node, store_url) as s:
            yield s
    finally:
        cleanup_node(node, tmp_path)


@contextlib.contextmanager
def dir_shim(tmp_path: Path, blobs: Path) -> Iterator[Shim]:
    """A shim on a fresh node under `tmp_path` whose layers are the EROFS images in `blobs`
    (`DirBlobs`); the node's mounts and processes are torn down afterwards, also on failure."""
    from runtime_shim.node.blobs import DirBlobs
    from runtime_shim.node.shim import Shim
    from runtime_shim.nodestate.paths import NodePaths

    node = tmp_path / "node"
    try:
        with Shim(NodePaths(node), DirBlobs(blobs)) as s:
            yield s
    finally:
        cleanup_node(node, tmp_path)


def snapshot(root: Path, skip: tuple[str, ...] = ("proc", "sys", "dev", "tmp")) -> dict[str, tuple]:
    """path -> (type, mode, content or link target) for a composed tree."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        if rel_dir == ".":
            dirnames[:] = [d for d in dirnames if d not in skip]
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            rel = os.path.normpath(os.path.join(rel_dir, name))
            st = os.lstat(p)
            if os.path.islink(p):
                out[rel] = ("l", os.readlink(p))
            elif os.path.isdir(p):
                out[rel] = ("d", oct(st.st_mode & 0o7777))
            else:
                with open(p, "rb") as f:
                    out[rel] = ("f", oct(st.st_mode & 0o7777), digestmod.of(f.read()))
    return out


def in_background(fn: object, *args: object, name: str = "in-background",
                  **kw: object) -> tuple[threading.Thread, list[object]]:
    """Run fn(*args, **kw) in a daemon thread (a hang must not hold pytest); the list gets its
    result or the exception it raised."""
    result: list[object] = []

    def target() -> None:
        try:
            result.append(fn(*args, **kw))  # type: ignore[operator]
        except BaseException as e:  # noqa: BLE001 - handed to the test
            result.append(e)

    th = threading.Thread(target=target, name=name, daemon=True)
    th.start()
    return th, result
