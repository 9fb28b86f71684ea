"""The snapshotter under a real containerd 1.6 (Debian's), started by the harness with its own
root, state, socket and namespace, and a local registry (Debian's docker-registry):

- a layerstore environment pushed as an image of layer pointers, pulled by `layerctl ctr pull` and
  run by `ctr run --snapshotter layerstore`: right output, nothing of the layers in containerd's
  content store, and the node daemon fetched metadata and the files read, not the rest;
- an ordinary multi-layer OCI image pushed to the registry, pulled by containerd's own `ctr` and
  by `layerctl ctr pull`, run through the same snapshotter;
- a container's writes, their Usage, and a commit of its upper;
- kill -9 of the snapshotter in the middle of a pull, then the pull again;
- restarts of containerd and of the snapshotter (SIGTERM and kill -9) with containers running;
  then removal of everything: containerd's garbage collection leaves nothing in the snapshotter
  (no record, directory or layer mount).

One containerd, registry, node and snapshotter for the module (each start costs seconds); the
tests run in file order and each leaves the containerd namespace as it found it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc
import pytest
from testkit.cli_helpers import LAYERCTL, layerctl
from testkit.containerd import Containerd, containerd, needs_containerd
from testkit.oci_registry import Registry, needs_registry, oci_registry
from testkit.registry_images import EXPECTED_OUTPUT, push_busybox
from testkit.shim_support import busybox_rootfs, cleanup_node, needs_busybox, needs_runc, store_with_env

from layerstore import linux
from snapshotter.client import ContainerdClient
from snapshotter.snapshots import CRASH_ENV, REMOTE_PREFIX
from snapshotter.stubs import snapshots_pb2 as pb
from snapshotter.stubs import snapshots_pb2_grpc as pbg

pytestmark = [pytest.mark.root, needs_containerd, needs_registry, needs_busybox, needs_runc]
T = TypeVar("T")
BIG = 8 << 20  # a toolkit file nobody reads


class SnapshotterProcess:
    """`layerctl snapshotter` for a node, started and stopped (or killed) by PID."""

    def __init__(self, node: Path, store: str, sock: Path, log: Path) -> None:
        self.node, self.store, self.sock, self.log = node, store, sock, log
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def root(self) -> Path:
        return self.node / "snapshotter"

    def start(self, crash: str = "") -> None:
        env = {k: v for k, v in os.environ.items() if k != CRASH_ENV}
        if crash:
            env[CRASH_ENV] = crash
        with contextlib.suppress(FileNotFoundError):
            self.sock.unlink()
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([LAYERCTL, "snapshotter", "--address", str(self.sock), "--node-dir",
                                          str(self.node), "--store", self.store], stdout=out, stderr=out,
                                         stdin=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + 30
        while not self.sock.exists():
            assert self.proc.poll() is None, f"the snapshotter died at start:\n{self.log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "the snapshotter did not start"
            time.sleep(0.02)

    def stop(self, sig: int = signal.SIGTERM) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait(10)
        self.proc = None
        return code

    def walk(self) -> dict[str, pb.Info]:
        with grpc.insecure_channel(f"unix://{self.sock}") as ch:
            stub = pbg.SnapshotsStub(ch)
            return {i.name: i for r in stub.List(pb.ListSnapshotsRequest(), timeout=30) for i in r.info}

    def layer_mounts(self) -> list[str]:
        """The node's layer mounts (the snapshotter's are the node's: NODE/layers)."""
        return [m.mountpoint for m in linux.mounts_under(linux.read_mounts(), str(self.node / "layers"))]


@dataclass
class World:
    ctd: Containerd
    reg: Registry
    snap: SnapshotterProcess
    store: str
    node: Path
    work: Path
    env_ref: str  # the environment pushed to the registry
    toolkit_blob: str


def retry(fn: Callable[[], T], timeout: float = 30.0) -> T:
    """containerd reconnects to a restarted snapshotter with a backoff (at most 3 s apart)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return fn()
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    work = tmp_path_factory.mktemp("snapshotter-ctd")
    node = work / "node"
    base = busybox_rootfs(work / "base")
    tool = work / "tool"
    (tool / "opt").mkdir(parents=True)
    (tool / "opt" / "hello").write_text("#!/bin/sh\necho hello from layerstore \"$@\"\n")
    os.chmod(tool / "opt" / "hello", 0o755)
    (tool / "opt" / "big").write_bytes(os.urandom(BIG))
    store = store_with_env(work, base, tag="bb:1")
    r = layerctl("build", str(tool), "--push", "--store", store, "--json")
    assert r.code == 0, r.err
    toolkit = r.json()["blob"]
    base_blob = layerctl("env", "show", "--store", store, "bb:1", "--json").json()["environment"]["layers"][0]["blob"]
    r = layerctl("env", "create", "--store", store, "--base", base_blob, "--toolkit", toolkit, "-t", "bb:2")
    assert r.code == 0, r.err
    sock = Path(f"/run/ls-snap-{os.getpid()}.sock")
    snap = SnapshotterProcess(node, store, sock, work / "snapshotter.log")
    try:
        snap.start()
        with oci_registry(work / "registry") as reg, containerd(snapshotters={"layerstore": str(sock)}) as ctd:
            env_ref = reg.ref("envs/bb", "2")
            r = layerctl("ctr", "push", "--store", store, "bb:2", env_ref, "--json")
            assert r.code == 0, r.err
            yield World(ctd, reg, snap, store, node, work, env_ref, toolkit)
    finally:
        snap.stop()
        cleanup_node(node, work)
        with contextlib.suppress(FileNotFoundError):
            sock.unlink()


def reachable(w: World) -> None:
    """Wait until containerd reaches a (re)started snapshotter. Until it has reconnected (its gRPC
    client backs off up to ~3 s), containerd fails a proxied call at once with the last dial error
    ("connection refused"); a Prepare and a Remove of a probe key go through once it has."""
    def probe() -> None:
        key = f"probe-{secrets.token_hex(4)}"
        w.ctd.ctr("snapshots", "--snapshotter", "layerstore", "prepare", key)
        w.ctd.ctr("snapshots", "--snapshotter", "layerstore", "rm", key)

    retry(probe)


def ctr_pull(w: World, ref: str, namespace: str | None = None) -> dict:
    r = layerctl("ctr", "pull", "--address", w.ctd.address, "-n", namespace or w.ctd.namespace, ref, "--json")
    assert r.code == 0, f"{r.err}\n{w.snap.log.read_text()[-2000:]}"
    return r.json()  # type: ignore[no-any-return]


def stats(w: World) -> dict:
    r = layerctl("stats", "--cache", str(w.node / "cache"), "--json")
    assert r.code == 0, r.err
    return r.json()  # type: ignore[no-any-return]


def test_layerstore_environment_pull_and_run(world: World) -> None:
    w = world
    rep = ctr_pull(w, w.env_ref)
    assert len(rep["remote_layers"]) == 2 and rep["unpacked_layers"] == []
    assert rep["bytes_fetched"] < 8192  # a manifest and a config, no layer
    out = w.ctd.ctr("run", "--rm", "--snapshotter", "layerstore", w.env_ref, "c-env", "/opt/hello", "x").stdout
    assert out == "hello from layerstore x\n"
    # containerd holds the manifest and the config, nothing of the layers
    content = w.ctd.ctr("content", "ls", "-q").stdout.split()
    assert len(content) == 2
    # the node daemon fetched the toolkit's metadata and the one small file read, not the big one
    tool = stats(w)["blobs"][w.toolkit_blob]
    assert tool["size"] > BIG and tool["fetched_bytes"] < BIG // 8
    # the layers are the node's EROFS mounts, one per blob, shared by every container
    assert len(w.snap.layer_mounts()) == 2
    w.ctd.ctr("run", "--rm", "--snapshotter", "layerstore", w.env_ref, "c-env2", "/opt/hello", "y")
    assert len(w.snap.layer_mounts()) == 2
    # a second pull finds everything present
    assert len(ctr_pull(w, w.env_ref)["present_layers"]) == 2


def test_ordinary_oci_image_through_the_same_snapshotter(world: World) -> None:
    w = world
    push_busybox(w.work / "busybox", w.reg.host, "test/busybox", "1")
    ref = w.reg.ref("test/busybox", "1")
    w.ctd.ctr("images", "pull", "--plain-http", "--snapshotter", "layerstore", ref)  # containerd's own client
    out = w.ctd.ctr("run", "--rm", "--snapshotter", "layerstore", ref, "c-oci").stdout
    assert out == EXPECTED_OUTPUT
    ours = w.snap.walk()
    assert sum(1 for i in ours.values() if i.kind == pb.COMMITTED and not i.name.startswith(REMOTE_PREFIX)) >= 3
    # our client too, in another namespace: fetched, written to the content store, unpacked by containerd
    ns2 = w.ctd.namespace + "-2"
    rep = ctr_pull(w, ref, ns2)
    assert len(rep["unpacked_layers"]) == 3 and rep["bytes_fetched"] > 500_000  # the layers (gzip, zstd, plain)
    out = w.ctd.ctr("run", "--rm", "--snapshotter", "layerstore", ref, "c-oci2", namespace=ns2).stdout
    assert out == EXPECTED_OUTPUT
    w.ctd.ctr("images", "rm", "--sync", ref, namespace=ns2)


def test_kill_snapshotter_mid_pull_then_pull_again(world: World) -> None:
    w = world
    ref = w.reg.ref("envs/bb", "crash")
    assert layerctl("ctr", "push", "--store", w.store, "bb:1", ref).code == 0
    w.ctd.ctr("images", "rm", "--sync", w.env_ref)  # the base layer's remote snapshot goes: Prepare runs again
    assert REMOTE_PREFIX not in "".join(w.snap.walk())
    w.snap.stop()
    w.snap.start(crash="remote:recorded")
    try:
        reachable(w)  # else the pull's Prepare may fail fast in containerd's reconnect backoff, before the crash
        r = layerctl("ctr", "pull", "--address", w.ctd.address, "-n", w.ctd.namespace, ref)
        assert r.code != 0
        assert w.snap.stop() == -signal.SIGKILL, f"pull failed before the crash point: {r.err}"
    finally:  # whatever happened, the next tests get a running snapshotter
        w.snap.stop()
        w.snap.start()
    retry(lambda: ctr_pull(w, ref))
    out = w.ctd.ctr("run", "--rm", "--snapshotter", "layerstore", ref, "c-crash", "cat", "/etc/motd").stdout
    assert out == "base motd\n"
    w.ctd.ctr("images", "rm", "--sync", ref)


def test_restarts_with_running_containers_then_nothing_leaks(world: World) -> None:
    w = world
    ctr_pull(w, w.env_ref)
    w.ctd.ctr("run", "-d", "--snapshotter", "layerstore", w.env_ref, "c-long", "sleep", "600")

    def exec_hello(tag: str) -> None:
        res = w.ctd.ctr("tasks", "exec", "--exec-id", f"e-{tag}", "c-long", "/opt/hello", tag)
        assert res.stdout == f"hello from layerstore {tag}\n"

    exec_hello("before")
    w.ctd.restart()
    assert "RUNNING" in w.ctd.ctr("tasks", "ls").stdout
    exec_hello("after-containerd")
    w.snap.stop()
    w.snap.start()
    exec_hello("after-snapshotter")
    w.snap.stop(signal.SIGKILL)
    w.snap.start()
    exec_hello("after-kill")
    retry(lambda: w.ctd.ctr("run", "--rm", "--snapshotter", "layerstore", w.env_ref, "c-new", "/opt/hello", "n"))
    # the end of everything: containerd's garbage collection removes the snapshotter's snapshots
    w.ctd.ctr("tasks", "kill", "-s", "SIGKILL", "c-long")
    retry(lambda: w.ctd.ctr("tasks", "delete", "c-long"))
    w.ctd.ctr("containers", "delete", "c-long")
    for ref in w.ctd.ctr("images", "ls", "-q").stdout.split():
        w.ctd.ctr("images", "rm", "--sync", ref)
    assert w.ctd.ctr("snapshots", "--snapshotter", "layerstore", "ls").stdout.splitlines()[1:] == []
    assert w.snap.walk() == {}
    assert w.snap.layer_mounts() == []
    assert os.listdir(w.snap.root / "snapshots") == []


def test_pull_of_a_blob_the_store_lacks_fails_cleanly(world: World) -> None:
    from erofs_builder.sources.registry import RegistryClient
    from snapshotter.image import image_of_environment

    w = world
    img = image_of_environment("", [("b3:" + "0" * 64, 4096, "base")], {"cmd": ["/bin/sh"]})
    with RegistryClient(w.reg.host) as reg:
        for blob in [*img.layers, img.config]:
            reg.push_blob("envs/missing", blob.data, blob.digest)
        reg.put_manifest("envs/missing", "1", img.manifest.data, img.manifest.media_type)
    before = set(w.snap.walk())
    r = layerctl("ctr", "pull", "--address", w.ctd.address, "-n", w.ctd.namespace, w.reg.ref("envs/missing", "1"))
    assert r.code != 0 and "Traceback" not in r.err and len(r.err.strip().splitlines()) == 1, r.err
    assert set(w.snap.walk()) == before
    assert not any("0" * 64 in m for m in w.snap.layer_mounts())
    assert w.ctd.ctr("images", "ls", "-q").stdout.split() == []


def test_container_writes_usage_and_commit(world: World, tmp_path: Path) -> None:
    w = world
    ctr_pull(w, w.env_ref)  # (the test before removed every image)
    w.ctd.ctr("run", "--snapshotter", "layerstore", w.env_ref, "c-write", "sh", "-c",
              "head -c 300000 /dev/zero > /written && echo more >> /written")
    usage = w.ctd.ctr("snapshots", "--snapshotter", "layerstore", "usage", "c-write").stdout
    size_line = usage.splitlines()[1].split()
    assert size_line[0] == "c-write"
    units = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    used = float(size_line[1]) * units[size_line[2]]
    assert 300_000 <= used < 400_000  # the upper's bytes only, not the lazily loaded layers'
    # Once its container is deleted, nothing references the kept snapshot: containerd's garbage
    # collector takes it at its next run unless a lease holds it (as containerd's own clients do
    # around such a delete + commit). A collection is forced in between to show the lease holds.
    with ContainerdClient(w.ctd.address, w.ctd.namespace) as c, c.leased():
        c.lease_snapshot("layerstore", "c-write")
        w.ctd.ctr("containers", "delete", "--keep-snapshot", "c-write")
        c.collect_garbage()
        assert c.stat("layerstore", "c-write")
        c.commit("layerstore", "c-write-committed", "c-write", {})
        mounts = c.prepare("layerstore", "check-commit", "c-write-committed", {})
        target = tmp_path / "root"
        target.mkdir()
        [m] = mounts
        linux.mount("overlay", target, "overlay", 0, ",".join(m.options))
        try:
            assert (target / "written").stat().st_size == 300005
            assert (target / "opt" / "hello").exists()  # over the environment's layers
        finally:
            linux.umount(target)
        c.remove("layerstore", "check-commit")
        c.remove("layerstore", "c-write-committed")
    w.ctd.ctr("images", "rm", "--sync", w.env_ref)  # (--sync: a collection, which removes our snapshots)
    assert w.snap.walk() == {} and w.snap.layer_mounts() == []
