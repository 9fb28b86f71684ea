"""SandboxLifecycle on its own: the state transitions of a teardown and of an undone mount, the
roots mount, with stand-in layer mounts (no layer is mounted: the steps that detach call
umount2 on plain directories, which needs root)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from testkit.shim_support import needs_root

from layerstore import linux
from runtime_shim.errors import SandboxExists, SandboxNotFound
from runtime_shim.node.layers import LayerMounts
from runtime_shim.node.lifecycle import SandboxLifecycle
from runtime_shim.nodestate import records
from runtime_shim.nodestate.lock import NodeLock
from runtime_shim.nodestate.paths import NodePaths
from runtime_shim.nodestate.state import MOUNTED, MOUNTING, UNMOUNTING, LayerMount, NodeState, Sandbox

A, B = "b3:" + "a" * 64, "b3:" + "b" * 64


class FakeLayers(LayerMounts):
    """The real reference counting of LayerMounts, with the unmount recorded instead of made."""

    def __init__(self, paths: NodePaths) -> None:
        super().__init__(paths, None)  # type: ignore[arg-type]  (no blob source: nothing is mounted)
        self.unmounted: list[str] = []

    def unmount(self, lm: LayerMount) -> None:
        self.unmounted.append(lm.blob)


@pytest.fixture
def life(tmp_path: Path) -> Iterator[tuple[SandboxLifecycle, FakeLayers]]:
    paths = NodePaths(tmp_path / "node")
    paths.create()
    layers = FakeLayers(paths)
    with NodeState(paths.state) as state:
        yield SandboxLifecycle(paths, state, NodeLock(paths.lock), layers), layers  # type: ignore[arg-type]


def add(life: SandboxLifecycle, sid: str, *, owned: bool = True, status: str = MOUNTED,
        layers: tuple[str, ...] = (A, B), upper: Path | None = None) -> Sandbox:
    paths = life.paths
    sdir = paths.sandbox_dir(sid)
    sdir.mkdir()
    up = sdir / "upper" if owned else upper
    assert up is not None
    up.mkdir(exist_ok=True)
    work = sdir / "work" if owned else up.parent / f".{up.name}.work"
    work.mkdir()
    target = paths.rootfs(sid)
    target.parent.mkdir(exist_ok=True)
    target.mkdir()
    sb = Sandbox(id=sid, env="e:1", manifest="m", layers=list(layers), config={}, target=str(target),
                 upper=str(up), work=str(work), owned=owned, status=status)
    records.save(paths, sb)
    with life.state.write() as t:
        t.put_sandbox(sb, old=None)
        for blob in layers:
            lm = t.layer(blob) or LayerMount(blob, str(paths.layer_mount(blob)), "src", 0, "dir")
            lm.refs += 1
            t.put_layer(lm)
    return sb


def refs(life: SandboxLifecycle) -> dict[str, int]:
    with life.state.read() as t:
        return {lm.blob: lm.refs for lm in t.layers()}


def test_under_roots(life: tuple[SandboxLifecycle, FakeLayers]) -> None:
    lc, _ = life
    assert lc.under_roots(str(lc.paths.rootfs("x")))
    assert not lc.under_roots(str(lc.paths.rootfs("x") / "deeper"))
    assert not lc.under_roots("/run/sbx/1/rootfs")


def test_forget_drops_the_record_its_refs_and_its_pending_entry(life: tuple[SandboxLifecycle, FakeLayers]) -> None:
    lc, layers = life
    add(lc, "a")
    add(lc, "b", layers=(A,))
    with lc.state.write() as t:
        t.put_pending("a", "mount")
    lc.forget("a", only=MOUNTING)  # not in that status: only the pending entry goes
    with lc.state.read() as t:
        assert t.sandbox("a") is not None and t.pending() == {}
    assert refs(lc) == {A: 2, B: 1}
    lc.forget("a")
    assert refs(lc) == {A: 1} and layers.unmounted == [B]  # the last user unmounts a layer
    lc.forget("b")
    assert refs(lc) == {} and layers.unmounted == [B, A]
    with lc.state.read() as t:
        assert t.sandboxes() == []


def test_begin_teardown(life: tuple[SandboxLifecycle, FakeLayers]) -> None:
    lc, _ = life
    sb = add(lc, "a")
    with lc.lock:
        cur = lc.begin_teardown(sb)
        assert cur.status == UNMOUNTING
        with lc.state.read() as t:
            assert t.sandbox("a").status == UNMOUNTING  # type: ignore[union-attr]
            assert t.pending()["a"]["op"] == "unmount"
        # a live process (this one) is tearing it down: refused, unless forced (recovery)
        with pytest.raises(SandboxExists, match="being unmounted"):
            lc.begin_teardown(sb)
        assert lc.begin_teardown(sb, force=True).status == UNMOUNTING
        ghost = Sandbox(id="ghost", env="", manifest="", layers=[], config={}, target="/t", upper="/u",
                        work="/w", owned=True)
        with pytest.raises(SandboxNotFound):
            lc.begin_teardown(ghost)
        assert lc.begin_teardown(ghost, force=True) is ghost


@needs_root
def test_teardown_of_an_owned_sandbox(life: tuple[SandboxLifecycle, FakeLayers]) -> None:
    lc, layers = life
    sb = add(lc, "a")
    add(lc, "b")
    with lc.lock:
        trashed = lc.teardown(sb)
    assert trashed is not None and trashed.parent == lc.paths.sandboxes / ".trash"
    assert (trashed / "upper").is_dir() and not lc.paths.sandbox_dir("a").exists()
    assert not Path(sb.target).exists()
    with lc.state.read() as t:
        assert [s.id for s in t.sandboxes()] == ["b"] and t.pending() == {}
    assert refs(lc) == {A: 1, B: 1} and layers.unmounted == []


@needs_root
def test_teardown_of_a_caller_upper_sandbox_keeps_the_upper(life: tuple[SandboxLifecycle, FakeLayers],
                                                            tmp_path: Path) -> None:
    lc, layers = life
    upper = tmp_path / "mine"
    upper.mkdir()
    (upper / "keep.txt").write_text("data\n")
    sb = add(lc, "a", owned=False, upper=upper)
    with lc.lock:
        began = lc.begin_teardown(sb)
    lc.detach_root(began)
    with lc.lock:
        assert lc.end_teardown(began) is None
    assert (upper / "keep.txt").read_text() == "data\n"
    assert not Path(sb.work).exists() and not lc.paths.sandbox_dir("a").exists()
    assert refs(lc) == {} and sorted(layers.unmounted) == [A, B]


@needs_root
@pytest.mark.parametrize("created_dir", [True, False])
def test_undo_mount(life: tuple[SandboxLifecycle, FakeLayers], created_dir: bool) -> None:
    lc, layers = life
    sb = add(lc, "a", status=MOUNTING)
    with lc.state.write() as t:
        t.put_pending("a", "mount")
    lc.undo_mount(sb, overlay=False, created_dir=created_dir)  # takes the lock itself
    with lc.state.read() as t:
        assert t.sandboxes() == [] and t.pending() == {}
    assert refs(lc) == {} and sorted(layers.unmounted) == [A, B]
    # a directory this mount did not create is not its to remove
    assert lc.paths.sandbox_dir("a").exists() is not created_dir
    trash = lc.paths.sandboxes / ".trash"
    assert not trash.exists() or list(trash.iterdir()) == []  # (an owned one's is deleted at once)


@needs_root
def test_undo_mount_leaves_a_mounted_sandbox_alone(life: tuple[SandboxLifecycle, FakeLayers]) -> None:
    lc, layers = life
    add(lc, "a", status=MOUNTED)
    sb = add(lc, "b", status=MOUNTING)
    with lc.state.write() as t:
        t.put_sandbox(Sandbox(**{**sb.to_json(), "status": MOUNTED}), old=sb)
    lc.undo_mount(sb, overlay=False, created_dir=False)  # (it completed meanwhile: only `mounting` goes)
    with lc.state.read() as t:
        assert sorted(s.id for s in t.sandboxes()) == ["a", "b"]
    assert refs(lc) == {A: 2, B: 2} and layers.unmounted == []


@needs_root
def test_the_roots_mount_comes_and_goes(life: tuple[SandboxLifecycle, FakeLayers]) -> None:
    lc, _ = life
    roots = lc.paths.roots
    try:
        with lc.lock:
            lc.ensure_roots()
            first = linux.mount_id(roots)
            lc.ensure_roots()  # idempotent: the same mount, none stacked on it
            assert linux.is_mount_root(roots) and linux.mount_id(roots) == first
            lc.release_roots()
            assert not linux.is_mount_root(roots)
            lc.release_roots()  # nothing there: a no-op
    finally:
        while linux.is_mount_root(roots):
            linux.umount(roots, lazy=True)


@needs_root
def test_the_last_sandbox_out_releases_the_roots_mount(life: tuple[SandboxLifecycle, FakeLayers]) -> None:
    lc, _ = life
    roots = lc.paths.roots
    a, b = add(lc, "a"), add(lc, "b")
    try:
        with lc.lock:
            lc.ensure_roots()
            lc.teardown(a)
            assert linux.is_mount_root(roots)
            lc.teardown(b)
            assert not linux.is_mount_root(roots)
    finally:
        while linux.is_mount_root(roots):
            linux.umount(roots, lazy=True)


def test_the_shim_and_its_lifecycle_share_one_lock(tmp_path: Path) -> None:
    """A wrapper put in place of `shim.lock` (a benchmark's timed lock) is the lock every step
    takes, also the lifecycle's own (`undo_mount`)."""
    from runtime_shim.node.blobs import DirBlobs
    from runtime_shim.node.shim import Shim

    with Shim(NodePaths(tmp_path / "node"), DirBlobs(tmp_path / "blobs"), auto_recover=False) as shim:
        assert shim.lifecycle.lock is shim.lock and shim.lifecycle.state is shim.state
        assert shim.lifecycle.layers is shim.layers
        wrapped = NodeLock(shim.paths.lock)
        shim.lock = wrapped
        assert shim.lifecycle.lock is wrapped and shim.lock is wrapped
