"""The warm mount path's shortcuts (docs/shim-scale.md, "The warm path") keep crash safety: a
record set as an attribute of the sandbox's directory, without fsync, is what recovery rebuilds
from after kill -9 of the mounting process and a lost database; a kill between the directory and
its record leaves no sandbox behind; the NODE/roots mount is recorded in the state and a bind mount
removed behind the shim's back is seen by the start-up check; the node lock's descriptor, kept
open between acquisitions, is never shared with a forked child; a long-lived shim that found the
daemon healthy still sees it die (kill -9) at its next mount."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from testkit.shim_support import (
    add_blob,
    busybox_rootfs,
    cleanup_node,
    mkfs,
    needs_busybox,
    needs_root,
    spec,
    store_shim,
    store_with_env,
)

from layerstore import linux
from runtime_shim.node.blobs import DirBlobs
from runtime_shim.node.request import MountRequest
from runtime_shim.node.shim import Shim
from runtime_shim.nodestate import records
from runtime_shim.nodestate.lock import NodeLock
from runtime_shim.nodestate.paths import NodePaths
from runtime_shim.nodestate.state import MOUNTED, NodeState

pytestmark = [needs_root, needs_busybox]


@pytest.fixture(scope="module")
def blobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("warm")
    base = busybox_rootfs(root / "base")
    (base / "etc" / "motd").write_text("warm\n")
    out = root / "blobs"
    return {"blobs": out, "base": add_blob(out, mkfs(base, root / "base.img"))}


@pytest.fixture
def node(tmp_path: Path):  # type: ignore[no-untyped-def]
    n = tmp_path / "node"
    try:
        yield n
    finally:
        cleanup_node(n, tmp_path)


def open_shim(node: Path, blobs: dict[str, object], **kw: object) -> Shim:
    return Shim(NodePaths(node), DirBlobs(blobs["blobs"]), **kw)  # type: ignore[arg-type]


# A process that mounts sandbox "victim" and is killed with SIGKILL: after the mount returned
# ("mounted"), or after the sandbox's directory was made but before its record was set on it
# ("record-write").
VICTIM = r"""
import json, os, signal, sys
from pathlib import Path
from runtime_shim.node.blobs import DirBlobs
from runtime_shim.resolve.environment import EnvSpec, LayerSpec
from runtime_shim.nodestate.paths import NodePaths
from runtime_shim.node.shim import Shim
from runtime_shim.node.request import MountRequest
node, blobs, blob, point = sys.argv[1:5]
spec = EnvSpec("", (LayerSpec(blob, 0, "base"),), {"cmd": ["/bin/sh"]}, "test")
s = Shim(NodePaths(Path(node)), DirBlobs(blobs))
if point == "record-write":
    def die(*a, **k):
        os.kill(os.getpid(), signal.SIGKILL)
    os.setxattr = die
s.mount(MountRequest(spec, sandbox="victim"))
os.kill(os.getpid(), signal.SIGKILL)
"""


def victim(node: Path, blobs: dict[str, object], point: str) -> None:
    p = subprocess.run([sys.executable, "-c", VICTIM, str(node), str(blobs["blobs"]), str(blobs["base"]), point],
                       capture_output=True, text=True)
    assert p.returncode == -signal.SIGKILL, p.stderr


def test_a_record_written_without_fsync_rebuilds_the_sandbox_after_kill9_and_a_lost_database(
        node: Path, blobs: dict[str, object]) -> None:
    victim(node, blobs, "mounted")
    rec = json.loads(records.load(NodePaths(node).sandbox_dir("victim")) or b"")
    assert rec["id"] == "victim" and rec["status"] == MOUNTED
    target = rec["target"]
    linux.umount(target, lazy=True)  # the database and the root gone: only the record is left
    for f in (node / "state").iterdir():
        f.unlink()
    with open_shim(node, blobs, auto_recover=False) as shim:
        rep = shim.recover()
        assert rep.adopted == ["victim"] and rep.remounted_sandboxes == ["victim"]
        assert shim.check("victim").ok, shim.check("victim").problems
        assert (Path(target) / "etc" / "motd").read_text() == "warm\n"
        shim.unmount("victim")
        assert shim.sandboxes() == [] and not linux.is_mount_root(node / "roots")


def test_kill9_between_the_sandboxs_directory_and_its_record_leaves_no_sandbox(node: Path,
                                                                             blobs: dict[str, object]) -> None:
    victim(node, blobs, "record-write")
    sdir = NodePaths(node).sandbox_dir("victim")
    assert sdir.is_dir() and records.load(sdir) is None  # made, not recorded
    with open_shim(node, blobs, auto_recover=False) as shim:
        rep = shim.recover_if_needed()
        assert rep is not None and rep.rolled_back == ["victim"]
        assert not NodePaths(node).sandbox_dir("victim").exists()
        again = shim.mount(MountRequest(spec((blobs["base"], "base")), sandbox="victim"))  # type: ignore[arg-type]
        assert (Path(again.target) / "etc" / "motd").read_text() == "warm\n"
        shim.unmount("victim")


def test_the_roots_mount_is_recorded_and_a_removed_one_is_seen_at_start(node: Path, blobs: dict[str, object]) -> None:
    env = spec((blobs["base"], "base"))  # type: ignore[arg-type]
    roots = node / "roots"
    with open_shim(node, blobs) as shim:
        shim.mount(MountRequest(env, sandbox="a"))
        with shim.state.read() as t:
            assert t.roots_mounted() and linux.is_mount_root(roots)
        b = shim.mount(MountRequest(env, sandbox="b"))  # (the record says it is there: the kernel is not asked)
        assert linux.mount_id(b.target) != linux.mount_id(roots) and Path(b.target).parent == roots
        linux.umount(roots, lazy=True)  # behind the shim's back: the roots on it go with it
    with open_shim(node, blobs, auto_recover=False) as shim:
        assert "roots" in shim.recovery_reason()
        rep = shim.recover_if_needed()
        assert rep is not None and sorted(rep.remounted_sandboxes) == ["a", "b"]
        assert linux.is_mount_root(roots) and shim.check("a").ok and shim.check("b").ok
        with shim.state.read() as t:
            assert t.roots_mounted()
        assert shim.recover_if_needed() is None
        shim.unmount("a")
        shim.unmount("b")
        with shim.state.read() as t:
            assert not t.roots_mounted()
        assert not linux.is_mount_root(roots)
        # made but not recorded (a crash between the two): the next mount finds and records it
        roots.mkdir(exist_ok=True)
        linux.bind_private(roots)
        c = shim.mount(MountRequest(env, sandbox="c"))
        with shim.state.read() as t:
            assert t.roots_mounted()
        assert linux.mount_id(c.target) != linux.mount_id(roots)
        shim.unmount("c")
        assert not linux.is_mount_root(roots)


def test_the_node_locks_descriptor_is_not_shared_with_a_forked_child(tmp_path: Path) -> None:
    lock = NodeLock(tmp_path / "lock")
    with lock:
        pass  # (the thread's descriptor is open from here on)
    with lock:
        pid = os.fork()
        if pid == 0:  # the child must wait for the parent's flock, not share it
            code = 1
            try:
                signal.signal(signal.SIGALRM, lambda *a: os._exit(0))
                signal.alarm(1)
                with lock:
                    code = 2  # took a lock its parent holds
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    with lock:  # and the parent's own descriptor still works after the child exited
        assert lock.held
    lock.close()


def test_a_long_lived_shim_sees_its_daemon_killed_at_the_next_mount(tmp_path: Path) -> None:
    url = store_with_env(tmp_path, busybox_rootfs(tmp_path / "src"))
    with store_shim(tmp_path, url) as shim:
        a = shim.mount(MountRequest("bb:1", sandbox="a"))
        shim.mount(MountRequest("bb:1", sandbox="b"))  # (the daemon is known healthy: the cheap check)
        with NodeState(shim.paths.state) as state, state.read() as t:
            rec = t.daemon()
        assert rec is not None
        os.kill(rec.pid, signal.SIGKILL)
        os.waitpid(rec.pid, 0)  # (our child: the shim started it)
        c = shim.mount(MountRequest("bb:1", sandbox="c"))  # sees the dead daemon: recovery, a new daemon
        with shim.state.read() as t:
            now = t.daemon()
        assert now is not None and now.pid != rec.pid
        for sb in (a, c):
            assert shim.check(sb.id).ok, shim.check(sb.id).problems
            assert (Path(sb.target) / "bin" / "busybox").exists()
        for sid in ("a", "b", "c"):
            shim.unmount(sid)
