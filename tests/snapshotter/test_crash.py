"""kill -9 at each step of each change, then a restart: the records, the directories, the node's
layer references and its layer mounts agree again, and the change either happened whole or not at
all.

The server runs in a child process (layers from a directory of EROFS images); the step to die at
is named by $LAYERSTORE_SNAPSHOTTER_CRASH (the process SIGKILLs itself there)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from testkit.shim_support import busybox_image, needs_busybox

from layerstore import linux
from snapshotter.snapshots import CRASH_ENV, LABEL_BLOB, LABEL_REF, REMOTE_PREFIX
from snapshotter.stubs import snapshots_pb2 as pb
from snapshotter.stubs import snapshots_pb2_grpc as pbg

from .conftest import detach_under

SERVE = """
import sys
from pathlib import Path
from runtime_shim.node.blobs import DirBlobs
from snapshotter.layers import RemoteLayers
from snapshotter.server import serve
from snapshotter.snapshots import Snapshotter
root, blobs, sock = map(Path, sys.argv[1:4])
serve(Snapshotter(root, RemoteLayers.with_blobs(root, root.parent / "node", DirBlobs(blobs))), sock)
"""
REMOTE = {LABEL_REF: "sha256:chain1"}


class Child:
    def __init__(self, tmp: Path) -> None:
        self.root, self.blobs, self.sock = tmp / "snap", tmp / "blobs", tmp / "snap.sock"
        self.node = tmp / "node"
        self.proc: subprocess.Popen[bytes] | None = None
        self.channel: grpc.Channel | None = None

    def start(self, crash: str = "") -> pbg.SnapshotsStub:
        env = {k: v for k, v in os.environ.items() if k != CRASH_ENV}
        if crash:
            env[CRASH_ENV] = crash
        with contextlib.suppress(FileNotFoundError):
            self.sock.unlink()
        self.proc = subprocess.Popen([sys.executable, "-c", SERVE, str(self.root), str(self.blobs), str(self.sock)],
                                     env=env, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while not self.sock.exists():
            assert self.proc.poll() is None, "the snapshotter died at start"
            assert time.monotonic() < deadline, "the snapshotter did not start"
            time.sleep(0.02)
        self.channel = grpc.insecure_channel(f"unix://{self.sock}")
        stub = pbg.SnapshotsStub(self.channel)
        list(stub.List(pb.ListSnapshotsRequest(), timeout=10))
        return stub

    def died_by_sigkill(self) -> bool:
        assert self.proc is not None
        return self.proc.wait(30) == -signal.SIGKILL

    def stop(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None


@pytest.fixture
def child(tmp_path: Path) -> Iterator[Child]:
    c = Child(tmp_path)
    c.blobs.mkdir()
    try:
        yield c
    finally:
        c.stop()
        detach_under(tmp_path)


def walk(stub: pbg.SnapshotsStub) -> dict[str, pb.Info]:
    return {i.name: i for r in stub.List(pb.ListSnapshotsRequest()) for i in r.info}


def check_agreement(c: Child, stub: pbg.SnapshotsStub) -> dict[str, pb.Info]:
    """Every local record has its directory and every directory a record; the snapshotter holds
    (through the node's shim) only layers its records name; the node's layer references match its
    sandboxes (holds included: nothing leaked) and its layer mounts match its layer records."""
    snaps = walk(stub)
    from runtime_shim.nodestate.state import NodeState
    from snapshotter.metadata import Metadata

    dirs = set(os.listdir(c.root / "snapshots"))
    # the records as the running server sees them: read-only peeks at its LMDB and the node's
    meta = Metadata(c.root / "metadata")
    try:
        with meta.read() as t:
            recs = list(t.all())
    finally:
        meta.close()
    with NodeState(c.node / "state") as state, state.read() as t:
        sandboxes, layers = t.sandboxes(), t.layers()
    assert {r.key for r in recs} == set(snaps)
    assert dirs == {str(r.id) for r in recs if not r.blob}
    held = {sb.layers[0] for sb in sandboxes if sb.id.startswith("ctrd.")}
    assert held <= {r.blob for r in recs if r.blob}
    users = {b for sb in sandboxes for b in sb.layers}
    assert {lm.blob: lm.refs for lm in layers} == {b: sum(b in sb.layers for sb in sandboxes) for b in users}
    mounted = {m.mountpoint for m in linux.mounts_under(linux.read_mounts(), str(c.node / "layers"))}
    assert mounted == {lm.mountpoint for lm in layers}
    assert not linux.mounts_under(linux.read_mounts(), str(c.root))  # (no layer mount of its own)
    return snaps


LOCAL_STEPS = ["create:dirs", "create:recorded", "commit:recorded", "remove:recorded"]
REMOTE_STEPS = ["remote:mounted", "remote:recorded"]


def _setup(stub: pbg.SnapshotsStub, step: str) -> None:
    stub.Prepare(pb.PrepareSnapshotRequest(key="a"))
    stub.Commit(pb.CommitSnapshotRequest(name="A", key="a"))
    if step in ("commit:recorded", "remove:recorded"):
        stub.Prepare(pb.PrepareSnapshotRequest(key="b", parent="A"))


def _op(stub: pbg.SnapshotsStub, step: str, blob: str) -> None:
    if step.startswith("create"):
        stub.Prepare(pb.PrepareSnapshotRequest(key="b", parent="A"))
    elif step == "commit:recorded":
        stub.Commit(pb.CommitSnapshotRequest(name="B", key="b"))
    elif step == "remove:recorded":
        stub.Remove(pb.RemoveSnapshotRequest(key="b"))
    else:
        stub.Prepare(pb.PrepareSnapshotRequest(key="ns/9/extract sha256:chain1",
                                               labels={**REMOTE, LABEL_BLOB: blob}))


def _crash_and_check(c: Child, step: str, blob: str = "") -> None:
    stub = c.start()
    _setup(stub, step)
    c.stop()
    stub = c.start(crash=step)
    with pytest.raises(grpc.RpcError) as ei:
        _op(stub, step, blob)
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
    assert c.died_by_sigkill()
    c.stop()
    stub = c.start()
    snaps = check_agreement(c, stub)
    # the change happened whole, or not at all
    if step == "create:dirs":
        assert "b" not in snaps
    elif step == "create:recorded":
        assert snaps["b"].kind == pb.ACTIVE
        [m] = stub.Mounts(pb.MountsRequest(key="b")).mounts
        assert all(os.path.isdir(o.split("=", 1)[1]) for o in m.options if o.startswith(("upperdir", "workdir")))
    elif step == "commit:recorded":
        assert snaps["B"].kind == pb.COMMITTED and "b" not in snaps
    elif step == "remove:recorded":
        assert "b" not in snaps
    elif step == "remote:mounted":
        assert REMOTE_PREFIX + "sha256:chain1" not in snaps
    elif step == "remote:recorded":
        assert snaps[REMOTE_PREFIX + "sha256:chain1"].kind == pb.COMMITTED
    # and the snapshotter goes on: the interrupted call can be made again, or its next step made
    if step in ("create:dirs", "remove:recorded"):
        _op(stub, "create:dirs", blob)
    if step.startswith("remote"):
        with pytest.raises(grpc.RpcError) as ei:
            _op(stub, step, blob)
        assert ei.value.code() == grpc.StatusCode.ALREADY_EXISTS
        [m] = stub.Prepare(pb.PrepareSnapshotRequest(key="ctr", parent=REMOTE_PREFIX + "sha256:chain1")).mounts
        lower = dict(o.split("=", 1) for o in m.options if "=" in o)["lowerdir"]
        assert linux.fs_type(lower) == linux.EROFS_MAGIC
    check_agreement(c, stub)


@pytest.mark.parametrize("step", LOCAL_STEPS)
def test_kill_at_each_step_of_a_local_change(child: Child, step: str) -> None:
    _crash_and_check(child, step)


@pytest.mark.root
@needs_busybox
@pytest.mark.parametrize("step", REMOTE_STEPS)
def test_kill_at_each_step_of_a_remote_layer(child: Child, step: str, tmp_path: Path) -> None:
    _blobs, blob = busybox_image(tmp_path / "img")
    os.rename(tmp_path / "img" / "blobs" / blob, child.blobs / blob)
    _crash_and_check(child, step, blob)


@pytest.mark.root
@needs_busybox
def test_kill_while_a_shim_sandbox_shares_the_layer(child: Child, tmp_path: Path) -> None:
    """kill -9 of the snapshotter holding a layer a shim sandbox also stacks: after the restart the
    snapshotter's reference is gone (the crash came before its record), the sandbox's stays, the
    layer is mounted once until the sandbox goes too."""
    from runtime_shim.node.blobs import DirBlobs
    from runtime_shim.node.request import MountRequest
    from runtime_shim.node.shim import Shim
    from runtime_shim.nodestate.paths import NodePaths
    from runtime_shim.resolve.environment import EnvSpec, LayerSpec

    _blobs, blob = busybox_image(tmp_path / "img")
    os.rename(tmp_path / "img" / "blobs" / blob, child.blobs / blob)
    stub = child.start(crash="remote:mounted")
    shim = Shim(NodePaths(child.node), DirBlobs(child.blobs), backends={})
    try:
        sb = shim.mount(MountRequest(EnvSpec("", (LayerSpec(blob, 0, "base"),)), tmp_path / "sb-root"))
        with pytest.raises(grpc.RpcError) as ei:
            _op(stub, "remote:mounted", blob)
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE and child.died_by_sigkill()
        assert shim.layer_refs() == {blob: 2}  # the dead snapshotter's hold, not recorded by it
        child.stop()
        stub = child.start()
        check_agreement(child, stub)
        assert shim.layer_refs() == {blob: 1}
        assert (tmp_path / "sb-root" / "etc" / "motd").read_text() == "base motd\n"
        shim.unmount(sb.id)
        assert shim.layer_refs() == {} and not linux.is_mount(shim.paths.layer_mount(blob))
    finally:
        shim.close()
