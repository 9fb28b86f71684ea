"""The shim against the real kernel: shared EROFS layer mounts with reference counts, overlay
composition, private uppers, id/upper uniqueness, and recovery after simulated shim crashes.
Images come from mkfs.erofs and are served from a directory (`DirBlobs`), so no daemon is needed."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from testkit.shim_support import add_blob, busybox_rootfs, mkfs, needs_busybox, needs_root, spec

from layerstore import linux
from runtime_shim.errors import SandboxExists, ShimError
from runtime_shim.node.blobs import DirBlobs
from runtime_shim.node.request import MountRequest
from runtime_shim.node.shim import Shim
from runtime_shim.nodestate import records
from runtime_shim.nodestate.paths import NodePaths
from runtime_shim.nodestate.state import MOUNTED, UNMOUNTING

pytestmark = [needs_root, needs_busybox]


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """base: busybox + /data/{a,b} + /olddir/x; toolkit: /opt/tool, a whiteout of /data/b and an
    opaque /olddir holding only `new`."""
    root = tmp_path_factory.mktemp("images")
    base = busybox_rootfs(root / "base")
    (base / "data").mkdir()
    (base / "data" / "a").write_text("a from base\n")
    (base / "data" / "b").write_text("b from base\n")
    (base / "olddir").mkdir()
    (base / "olddir" / "x").write_text("x\n")
    tk = root / "toolkit"
    (tk / "opt" / "tool").mkdir(parents=True)
    (tk / "opt" / "tool" / "run.sh").write_text("#!/bin/sh\necho tool\n")
    (tk / "data").mkdir()
    os.mknod(tk / "data" / "b", 0o600 | 0o020000, os.makedev(0, 0))
    (tk / "olddir").mkdir()
    os.setxattr(tk / "olddir", "trusted.overlay.opaque", b"y")
    (tk / "olddir" / "new").write_text("new\n")
    blobs = root / "blobs"
    b = add_blob(blobs, mkfs(base, root / "base.img"))
    t = add_blob(blobs, mkfs(tk, root / "tk.img"))
    return {"blobs": blobs, "base": b, "toolkit": t}


def open_shim(node: Path, images: dict[str, object]) -> Shim:
    return Shim(NodePaths(node), DirBlobs(images["blobs"]))  # type: ignore[arg-type]


def env2(images: dict[str, object]):  # type: ignore[no-untyped-def]
    return spec((images["base"], "base"), (images["toolkit"], "toolkit"))  # type: ignore[arg-type]


def erofs_mounts(node: Path) -> list[str]:
    return sorted(m.mountpoint for m in linux.read_mounts().values()
                  if m.fstype == "erofs" and m.mountpoint.startswith(str(node) + "/"))


def test_layers_are_mounted_once_and_reference_counted(node: Path, images: dict[str, object]) -> None:
    with open_shim(node, images) as shim:
        a = shim.mount(MountRequest(env2(images)))
        b = shim.mount(MountRequest(env2(images)))
        assert a.id != b.id and a.upper != b.upper
        assert len(erofs_mounts(node)) == 2  # one per layer, not per sandbox
        assert shim.layer_refs() == {images["base"]: 2, images["toolkit"]: 2}
        only_base = shim.mount(MountRequest(spec((images["base"], "base"))))  # type: ignore[arg-type]
        assert shim.layer_refs()[images["base"]] == 3
        shim.unmount(a.target)
        assert shim.layer_refs() == {images["base"]: 2, images["toolkit"]: 1}
        shim.unmount(b.id)
        assert shim.layer_refs() == {images["base"]: 1}
        assert len(erofs_mounts(node)) == 1
        shim.unmount(only_base.id)
        assert shim.layer_refs() == {} and erofs_mounts(node) == []
        assert os.listdir(node / "layers") == []
        assert [d for d in os.listdir(node / "sandboxes") if not d.startswith(".")] == []
        assert shim.sandboxes() == []


def test_whiteouts_and_opaque_directories_across_layers(node: Path, images: dict[str, object]) -> None:
    with open_shim(node, images) as shim:
        sb = shim.mount(MountRequest(env2(images)))
        root = Path(sb.target)
        assert (root / "data" / "a").read_text() == "a from base\n"
        assert not (root / "data" / "b").exists()
        assert sorted(os.listdir(root / "olddir")) == ["new"]
        assert (root / "opt" / "tool" / "run.sh").exists()
        assert (root / "etc" / "motd").read_text() == "base motd\n"
        shim.unmount(sb.id)


def test_writes_land_in_the_private_upper_only(node: Path, images: dict[str, object]) -> None:
    with open_shim(node, images) as shim:
        a, b = shim.mount(MountRequest(env2(images))), shim.mount(MountRequest(env2(images)))
        ra, rb = Path(a.target), Path(b.target)
        (ra / "etc" / "motd").write_text("changed in a\n")
        (ra / "new-file").write_text("only a\n")
        (ra / "data" / "a").unlink()
        assert (Path(a.upper) / "etc" / "motd").read_text() == "changed in a\n"
        assert (Path(a.upper) / "new-file").exists()
        wh = os.lstat(Path(a.upper) / "data" / "a")
        assert (os.major(wh.st_rdev), os.minor(wh.st_rdev)) == (0, 0)  # a whiteout
        # the other sandbox and the shared layer are untouched
        assert (rb / "etc" / "motd").read_text() == "base motd\n"
        assert not (rb / "new-file").exists() and (rb / "data" / "a").exists()
        layer = NodePaths(node).layer_mount(images["base"])  # type: ignore[arg-type]
        assert (layer / "etc" / "motd").read_text() == "base motd\n"
        with pytest.raises(OSError):
            (layer / "etc" / "motd").write_text("x")  # read-only EROFS
        assert os.listdir(b.upper) == []
        shim.unmount(a.id)
        shim.unmount(b.id)
        assert not os.path.exists(a.upper)  # the shim's own upper goes with the sandbox


def test_sandbox_ids_and_uppers_are_unique(node: Path, images: dict[str, object], tmp_path: Path) -> None:
    with open_shim(node, images) as shim:
        shim.mount(MountRequest(env2(images), sandbox="task-1"))
        with pytest.raises(SandboxExists):
            shim.mount(MountRequest(env2(images), sandbox="task-1"))
        mine = tmp_path / "keep" / "upper"
        shim.mount(MountRequest(env2(images), tmp_path / "t2", sandbox="task-2", upper=mine))
        with pytest.raises(SandboxExists):
            shim.mount(MountRequest(env2(images), tmp_path / "t3", sandbox="task-3", upper=mine))  # in use
        (tmp_path / "t2" / "work.txt").write_text("progress\n")
        shim.unmount(str(tmp_path / "t2"))
        assert (mine / "work.txt").read_text() == "progress\n"  # the caller's upper is kept
        # an id whose directory survived (e.g. a crash) is refused unless its upper is given
        (NodePaths(node).sandbox_dir("task-4") / "upper").mkdir(parents=True)
        (NodePaths(node).sandbox_dir("task-4") / "upper" / "f").write_text("old\n")
        with pytest.raises(SandboxExists):
            shim.mount(MountRequest(env2(images), sandbox="task-4"))
        sb = shim.mount(MountRequest(env2(images), sandbox="task-4", upper=NodePaths(node).upper("task-4")))
        assert (Path(sb.target) / "f").read_text() == "old\n"
        # resume the kept upper under a new sandbox
        sb5 = shim.mount(MountRequest(env2(images), sandbox="task-5", upper=mine))
        assert (Path(sb5.target) / "work.txt").read_text() == "progress\n"
        for s in shim.sandboxes():
            shim.unmount(s.id)
        assert (NodePaths(node).upper("task-4") / "f").exists()


def test_failed_mount_leaves_nothing(node: Path, images: dict[str, object]) -> None:
    with open_shim(node, images) as shim:
        keep = shim.mount(MountRequest(env2(images)))
        missing = "b3:" + "e" * 64
        with pytest.raises(ShimError):
            shim.mount(MountRequest(spec((images["base"], "base"), (missing, "toolkit")), sandbox="doomed"))  # type: ignore[arg-type]
        assert [s.id for s in shim.sandboxes()] == [keep.id]
        assert shim.layer_refs() == {images["base"]: 1, images["toolkit"]: 1}
        assert not NodePaths(node).sandbox_dir("doomed").exists()
        shim.unmount(keep.id)


def test_recover_when_state_says_mounted_but_mounts_are_gone(node: Path, images: dict[str, object]) -> None:
    with open_shim(node, images) as shim:
        a, b = shim.mount(MountRequest(env2(images))), shim.mount(MountRequest(spec((images["base"], "base"))))  # type: ignore[arg-type]
        (Path(a.target) / "mine").write_text("a's data\n")
    for m in sorted(linux.mounts_under(linux.read_mounts(), str(node)), key=lambda m: -len(m.mountpoint)):
        linux.umount(m.mountpoint, lazy=True)  # the mounts vanish (reboot, crashed namespace)
    assert erofs_mounts(node) == []
    with open_shim(node, images) as shim:  # recovery runs when the shim starts
        assert {s.id: s.status for s in shim.sandboxes()} == {a.id: MOUNTED, b.id: MOUNTED}
        assert (Path(a.target) / "mine").read_text() == "a's data\n"  # the same upper
        assert not (Path(b.target) / "mine").exists()
        assert shim.layer_refs() == {images["base"]: 2, images["toolkit"]: 1}
        assert len(erofs_mounts(node)) == 2
        assert shim.check(a.id).ok, shim.check(a.id).problems
        assert shim.recover().changed is False  # idempotent


def test_recover_when_mounts_are_present_but_state_is_lost(node: Path, images: dict[str, object]) -> None:
    with open_shim(node, images) as shim:
        a = shim.mount(MountRequest(env2(images)))
        gone = shim.mount(MountRequest(env2(images)))
        (Path(a.target) / "mine").write_text("kept\n")
        (Path(gone.target) / "g").write_text("upper data\n")
    shutil.rmtree(node / "state")  # the database is lost; mounts and records remain
    records.remove(NodePaths(node), gone.id)  # and one record too
    stray = node / "layers" / ("f" * 64)
    stray.mkdir()
    linux.mount_erofs(Path(images["blobs"]) / images["base"], stray)  # type: ignore[arg-type, operator]
    with open_shim(node, images) as shim:
        assert [s.id for s in shim.sandboxes()] == [a.id]  # rebuilt from its record
        assert (Path(a.target) / "mine").read_text() == "kept\n"
        assert shim.layer_refs() == {images["base"]: 1, images["toolkit"]: 1}
        assert not linux.is_mount(gone.target) and not linux.is_mount(stray)
        assert (Path(gone.upper) / "g").read_text() == "upper data\n"  # never touched
        shim.unmount(a.id)
    assert erofs_mounts(node) == []


def test_recover_finishes_an_interrupted_teardown(node: Path, images: dict[str, object]) -> None:
    with open_shim(node, images) as shim:
        a, b = shim.mount(MountRequest(env2(images))), shim.mount(MountRequest(env2(images)))
        with shim.state.write() as t:  # the shim died right after marking `a` for teardown
            rec = t.sandbox(a.id)
            assert rec is not None
            rec.status = UNMOUNTING
            t.put_sandbox(rec)
        rep = shim.recover()
        assert rep.finished_teardowns == [a.id]
        assert [s.id for s in shim.sandboxes()] == [b.id]
        assert shim.layer_refs() == {images["base"]: 1, images["toolkit"]: 1}
        assert not os.path.exists(a.upper) and not linux.is_mount(a.target)
        shim.unmount(b.id)


def test_state_records_are_plain_json(node: Path, images: dict[str, object]) -> None:
    with open_shim(node, images) as shim:
        sb = shim.mount(MountRequest(env2(images), sandbox="rec-1"))
        rec = json.loads(records.load(NodePaths(node).sandbox_dir("rec-1")) or b"")
        assert rec["id"] == "rec-1" and rec["layers"] == [images["base"], images["toolkit"]]
        shim.unmount(sb.id)


def test_recover_finishes_a_teardown_found_in_the_trash(node: Path, images: dict[str, object]) -> None:
    from layerstore.linux import detach

    with open_shim(node, images) as shim:
        a, b = shim.mount(MountRequest(env2(images))), shim.mount(MountRequest(env2(images)))
        detach(a.target)  # the shim died after moving a's directory to the trash
        assert records.trash(shim.paths, a.id) is not None
        rep = shim.recover()
        assert rep.finished_teardowns == [a.id] and rep.trash_emptied == 1
        assert [s.id for s in shim.sandboxes()] == [b.id]
        assert shim.layer_refs() == {images["base"]: 1, images["toolkit"]: 1}
        assert os.listdir(node / "sandboxes" / ".trash") == []
        shim.unmount(b.id)


def test_a_thousand_sandboxes_then_none(node: Path, images: dict[str, object]) -> None:
    with open_shim(node, images) as shim:
        sbs = [shim.mount(MountRequest(env2(images))) for _ in range(1000)]
        assert shim.layer_refs() == {images["base"]: 1000, images["toolkit"]: 1000}
        assert len(erofs_mounts(node)) == 2
        overlays = [m for m in linux.read_mounts().values() if m.fstype == "overlay"
                    and m.mountpoint.startswith(str(node) + "/")]
        assert len(overlays) == 1000
        assert shim.recover().changed is False
        for sb in sbs:
            shim.unmount(sb.id)
        assert shim.layer_refs() == {} and shim.sandboxes() == []
    assert linux.mounts_under(linux.read_mounts(), str(node)) == []
    loops = Path("/sys/block")
    assert not any((loops / d / "loop" / "backing_file").exists()
                   and str(node) in (loops / d / "loop" / "backing_file").read_text() for d in os.listdir(loops))


def test_mount_and_teardown_never_read_the_mount_table(node: Path, images: dict[str, object],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """At 10,000 sandboxes /proc/self/mountinfo is several MB: one mount or teardown must not parse it."""
    from runtime_shim.node import shim as shim_module

    with open_shim(node, images) as shim:
        keep = shim.mount(MountRequest(env2(images)))

        def scan(*_a: object, **_k: object) -> None:
            raise AssertionError("the mount table was read on the path of one sandbox")

        for where in (linux, linux.mounttable):  # the callers' name and the one the package's own calls use
            monkeypatch.setattr(where, "read_mounts", scan)
            monkeypatch.setattr(where, "find_mount", scan)
        monkeypatch.setattr(shim_module.Shim, "sandboxes", scan)  # and no walk over every sandbox
        sb = shim.mount(MountRequest(env2(images)))
        assert shim.check(sb.id).ok and shim.recover_if_needed() is None
        shim.unmount(sb.id)
        shim.unmount(keep.id)
        monkeypatch.undo()
        assert shim.sandboxes() == [] and erofs_mounts(node) == []


CRASH = """
import json, os, sys
from pathlib import Path
from runtime_shim.node import lifecycle, shim as shim_module
from runtime_shim.nodestate import records
from runtime_shim.node.request import MountRequest
from runtime_shim.node.blobs import DirBlobs
from runtime_shim.resolve.environment import EnvSpec, LayerSpec
from runtime_shim.nodestate.paths import NodePaths

node, blobs, layers, point, op, upper = sys.argv[1:7]
def die_after(fn):
    def wrapped(*a, **k):
        fn(*a, **k)
        os._exit(9)  # the shim dies here, holding the node lock
    return wrapped
spec = EnvSpec("", tuple(LayerSpec(b, 0, "base" if i == 0 else "toolkit") for i, b in enumerate(json.loads(layers))),
               {"cmd": ["/bin/sh"]}, "test")
s = shim_module.Shim(NodePaths(Path(node)), DirBlobs(blobs))
if op == "unmount":
    s.mount(MountRequest(spec, sandbox="victim", upper=upper or None, target=(node + "/t-victim") if upper else None))
if point == "record":
    records.save = die_after(records.save)
elif point == "layers":
    s.layers.mount = die_after(s.layers.mount)
elif point == "overlay":
    shim_module.mount_overlay = die_after(shim_module.mount_overlay)
elif point == "detach":
    lifecycle.detach = die_after(lifecycle.detach)
elif point == "trash":
    records.trash = die_after(records.trash)
if op == "mount":
    s.mount(MountRequest(spec, sandbox="victim"))
else:
    s.unmount("victim")
sys.exit("the crash point was not reached")
"""


def crash(node: Path, images: dict[str, object], point: str, op: str, upper: str = "") -> None:
    import subprocess
    import sys

    layers = json.dumps([images["base"], images["toolkit"]])
    p = subprocess.run([sys.executable, "-c", CRASH, str(node), str(images["blobs"]), layers, point, op, upper],
                       capture_output=True, text=True)
    assert p.returncode == 9, p.stderr


@pytest.mark.parametrize("point", ["record", "layers", "overlay"])
def test_a_mount_a_crash_interrupted_is_rolled_back(node: Path, images: dict[str, object], point: str) -> None:
    with open_shim(node, images) as shim:
        keep = shim.mount(MountRequest(spec((images["base"], "base"))))  # type: ignore[arg-type]
    crash(node, images, point, "mount")
    with Shim(NodePaths(node), DirBlobs(images["blobs"]), auto_recover=False) as shim:  # type: ignore[arg-type]
        rep = shim.recover_if_needed()
        assert rep is not None and "interrupted" in rep.reason and rep.rolled_back == ["victim"]
        assert [s.id for s in shim.sandboxes()] == [keep.id]
        assert shim.layer_refs() == {images["base"]: 1}
        assert erofs_mounts(node) == [str(shim.paths.layer_mount(images["base"]))]  # type: ignore[arg-type]
        assert not NodePaths(node).sandbox_dir("victim").exists()
        assert shim.recover_if_needed() is None
        again = shim.mount(MountRequest(env2(images), sandbox="victim"))  # the caller's retry with the same id works
        assert (Path(again.target) / "opt" / "tool" / "run.sh").exists()
        shim.unmount(again.id)
        shim.unmount(keep.id)


@pytest.mark.parametrize("point", ["detach", "trash"])
def test_a_teardown_a_crash_interrupted_is_finished(node: Path, images: dict[str, object], point: str) -> None:
    crash(node, images, point, "unmount")
    with Shim(NodePaths(node), DirBlobs(images["blobs"]), auto_recover=False) as shim:  # type: ignore[arg-type]
        rep = shim.recover_if_needed()
        assert rep is not None and rep.finished_teardowns == ["victim"]
        assert shim.sandboxes() == [] and shim.layer_refs() == {} and erofs_mounts(node) == []
        assert [d for d in os.listdir(node / "sandboxes") if d != ".trash"] == []
        assert os.listdir(node / "sandboxes" / ".trash") == []


def test_a_caller_upper_survives_a_crash_mid_teardown(node: Path, images: dict[str, object], tmp_path: Path) -> None:
    upper = tmp_path / "mine"
    upper.mkdir()
    (upper / "keep.txt").write_text("caller's data\n")
    crash(node, images, "detach", "unmount", str(upper))
    with Shim(NodePaths(node), DirBlobs(images["blobs"]), auto_recover=False) as shim:  # type: ignore[arg-type]
        rep = shim.recover_if_needed()
        assert rep is not None and rep.finished_teardowns == ["victim"] and shim.sandboxes() == []
    assert (upper / "keep.txt").read_text() == "caller's data\n"


def test_after_a_reboot_the_picture_is_rebuilt_from_the_records(node: Path, images: dict[str, object]) -> None:
    from runtime_shim.nodestate.state import Sandbox

    with open_shim(node, images) as shim:
        a = shim.mount(MountRequest(env2(images), sandbox="a"))
        b = shim.mount(MountRequest(env2(images), sandbox="b"))
        (Path(a.target) / "mine").write_text("a's data\n")
        (Path(b.target) / "theirs").write_text("b's data\n")
        with shim.state.write() as t:
            # what the unsynced database may hold after a power loss: an earlier boot, a sandbox
            # whose teardown had reached the disk but whose final transaction had not
            t.put_boot("an-earlier-boot")
            t.put_sandbox(Sandbox(id="ghost", env="", manifest="", layers=[images["base"]],  # type: ignore[list-item]
                                  config={}, target=str(node / "ghost"), upper=str(node / "gu"), work=str(node / "gw"),
                                  owned=True, status=MOUNTED))
    records.remove(NodePaths(node), "b")  # b's unsynced record did not come back
    for m in sorted(linux.mounts_under(linux.read_mounts(), str(node)), key=lambda m: -len(m.mountpoint)):
        linux.umount(m.mountpoint, lazy=True)  # every mount is gone after a reboot
    with Shim(NodePaths(node), DirBlobs(images["blobs"]), auto_recover=False) as shim:  # type: ignore[arg-type]
        rep = shim.recover_if_needed()
        assert rep is not None and rep.rebooted and "restarted" in rep.reason
        assert [s.id for s in shim.sandboxes()] == ["a"] and rep.remounted_sandboxes == ["a"]
        assert (Path(a.target) / "mine").read_text() == "a's data\n"
        assert shim.layer_refs() == {images["base"]: 1, images["toolkit"]: 1}
        assert rep.unrecorded == ["b"]  # reported, and its upper left alone
        assert (Path(b.upper) / "theirs").read_text() == "b's data\n"
        assert shim.recover_if_needed() is None
        shim.unmount("a")


def test_a_damaged_state_database_is_rebuilt_from_the_records(node: Path, images: dict[str, object]) -> None:
    with open_shim(node, images) as shim:
        a = shim.mount(MountRequest(env2(images), sandbox="a"))
    with open(node / "state" / "data.mdb", "r+b") as f:  # its pages in use, meta pages first (the file is sparse)
        f.write(b"\x5a" * (1 << 20))
    with Shim(NodePaths(node), DirBlobs(images["blobs"]), auto_recover=False) as shim:  # type: ignore[arg-type]
        rep = shim.recover_if_needed()
        assert rep is not None and rep.adopted == ["a"]
        assert shim.check("a").ok, shim.check("a").problems
        assert shim.layer_refs() == {images["base"]: 1, images["toolkit"]: 1}
        shim.unmount(a.id)
    assert list(node.glob("state.damaged-*"))


def test_check_and_full_recover_see_a_root_unmounted_behind_the_shims_back(node: Path,
                                                                           images: dict[str, object]) -> None:
    with open_shim(node, images) as shim:
        a, b = shim.mount(MountRequest(env2(images))), shim.mount(MountRequest(env2(images)))
        linux.umount(a.target)
        assert not shim.check(a.id).ok and shim.check(b.id).ok
        assert shim.recover_if_needed() is None  # the start-up check looks at layers only (documented)
        assert shim.recover().remounted_sandboxes == [a.id]
        assert shim.check(a.id).ok
        shim.unmount(a.id)
        shim.unmount(b.id)


def test_default_roots_are_not_mounted_beside_the_uppers(node: Path, images: dict[str, object]) -> None:
    """overlayfs walks every child mount of its upper's mount at each mount(2): the default roots
    hang off NODE/roots, a mount of its own that exists while the node has sandboxes."""
    roots = node / "roots"
    with open_shim(node, images) as shim:
        a, b = shim.mount(MountRequest(env2(images))), shim.mount(MountRequest(env2(images)))
        assert Path(a.target).parent == roots and linux.is_mount_root(roots)
        assert linux.mount_id(a.upper) != linux.mount_id(roots)
        table = linux.read_mounts()
        assert table[str(roots)].fstype != "overlay" and table[a.target].fstype == "overlay"
        shim.unmount(a.id)
        assert linux.is_mount_root(roots) and not os.path.exists(a.target)
        shim.unmount(b.id)
        assert not linux.is_mount_root(roots)  # gone with the last sandbox
        assert linux.mounts_under(linux.read_mounts(), str(node)) == []


INFLIGHT = """
import os, sys, time
from pathlib import Path
from runtime_shim.node import lifecycle, shim as shim_module
from runtime_shim.node.request import MountRequest
from runtime_shim.node.blobs import DirBlobs
from runtime_shim.nodestate.paths import NodePaths

node, blobs, marker, go = sys.argv[1:5]
real = lifecycle.detach
def slow(path):
    Path(marker).write_text(str(os.getpid()))
    while not os.path.exists(go):
        time.sleep(0.02)
    return real(path)
lifecycle.detach = slow
with shim_module.Shim(NodePaths(Path(node)), DirBlobs(blobs)) as s:
    s.unmount("victim")
"""


def test_recovery_leaves_a_teardown_in_flight_alone(node: Path, images: dict[str, object], tmp_path: Path) -> None:
    """A teardown unmounts the root outside the node lock; meanwhile another process's recovery
    must neither finish it nor mount it again."""
    import subprocess
    import sys
    import time

    with open_shim(node, images) as shim:
        other = shim.mount(MountRequest(env2(images)))
        shim.mount(MountRequest(env2(images), sandbox="victim"))
    marker, go = tmp_path / "in-detach", tmp_path / "go"
    child = subprocess.Popen([sys.executable, "-c", INFLIGHT, str(node), str(images["blobs"]), str(marker), str(go)])
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert marker.exists(), "the teardown did not start"
        with Shim(NodePaths(node), DirBlobs(images["blobs"]), auto_recover=False) as shim:  # type: ignore[arg-type]
            assert shim.recover_if_needed() is None  # an operation in flight is not a crash
            rep = shim.recover()
            assert "victim" not in rep.finished_teardowns + rep.remounted_sandboxes + rep.rolled_back
            assert shim.find("victim").status == "unmounting"
            assert shim.layer_refs() == {images["base"]: 2, images["toolkit"]: 2}
            go.write_text("")
            assert child.wait(timeout=60) == 0
            assert [s.id for s in shim.sandboxes()] == [other.id]
            assert shim.layer_refs() == {images["base"]: 1, images["toolkit"]: 1}
            shim.unmount(other.id)
    finally:
        go.write_text("")
        if child.poll() is None:
            child.kill()
            child.wait()
