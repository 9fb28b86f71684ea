"""The snapshots API's edge cases containerd relies on, through the real gRPC server: parent
chains and the mounts they give, View of a committed key, the refusals (and their status codes,
which containerd's errdefs maps back), Remove of a parent refused, Walk filters as containerd
writes them, Update, Usage, Cleanup; remote layers (EROFS images mounted from a directory)."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest
from testkit.shim_support import busybox_image, needs_busybox

from layerstore import linux
from snapshotter.snapshots import LABEL_BLOB, LABEL_REF, REMOTE_PREFIX
from snapshotter.stubs import snapshots_pb2 as pb

from .conftest import Served, code_of

C = grpc.StatusCode


def opts(m: pb.Mount) -> dict[str, str]:
    return dict(o.split("=", 1) if "=" in o else (o, "") for o in m.options)


def test_parent_chain_mounts_stack_every_ancestor(snaps: Served) -> None:
    [m] = snaps.prepare("a")
    assert (m.type, set(m.options)) == ("bind", {"rw", "rbind"})
    a_fs = m.source
    Path(a_fs, "from-a").write_text("a")
    snaps.commit("A", "a")
    [m] = snaps.prepare("b", "A")
    assert m.type == "overlay"
    assert opts(m)["lowerdir"] == a_fs  # a commit keeps its directory: the key's fs is the name's
    b_fs = opts(m)["upperdir"]
    snaps.commit("B", "b")
    [m] = snaps.prepare("c", "B")
    assert opts(m)["lowerdir"] == f"{b_fs}:{a_fs}"  # nearest parent first
    assert os.path.isdir(opts(m)["workdir"]) and os.path.isdir(opts(m)["upperdir"])
    assert snaps.mounts("c") == [m]  # Mounts answers what Prepare did
    info = snaps.stat("c")
    assert (info.kind, info.parent) == (pb.ACTIVE, "B")
    assert (snaps.stat("B").kind, snaps.stat("B").parent) == (pb.COMMITTED, "A")
    assert code_of(snaps.stat, "b") == C.NOT_FOUND  # the key is gone once committed


def test_view_of_a_committed_key(snaps: Served) -> None:
    [m] = snaps.prepare("a")
    snaps.commit("A", "a")
    [v] = snaps.view("v1", "A")
    assert (v.type, v.source, set(v.options)) == ("bind", m.source, {"ro", "rbind"})
    assert snaps.stat("v1").kind == pb.VIEW
    snaps.prepare("b", "A")
    snaps.commit("B", "b")
    [v2] = snaps.view("v2", "B")
    assert v2.type == "overlay" and "upperdir" not in opts(v2) and opts(v2)["lowerdir"].count(":") == 1
    [v3] = snaps.view("v3")  # no parent: an empty read-only directory
    assert v3.type == "bind" and "ro" in v3.options
    assert code_of(snaps.commit, "V", "v1") == C.FAILED_PRECONDITION  # a view is not committed
    assert code_of(snaps.view, "v4", "v1") == C.INVALID_ARGUMENT  # a parent must be committed


def test_refusals_have_containerds_status_codes(snaps: Served) -> None:
    snaps.prepare("a")
    assert code_of(snaps.prepare, "a") == C.ALREADY_EXISTS
    assert code_of(snaps.prepare, "x", "nope") == C.NOT_FOUND
    assert code_of(snaps.prepare, "x", "a") == C.INVALID_ARGUMENT  # active parent
    snaps.commit("A", "a")
    assert code_of(snaps.mounts, "A") == C.FAILED_PRECONDITION  # committed: not active or view
    assert code_of(snaps.mounts, "zz") == C.NOT_FOUND
    snaps.prepare("b", "A")
    assert code_of(snaps.commit, "A", "b") == C.ALREADY_EXISTS
    assert code_of(snaps.commit, "Z", "zz") == C.NOT_FOUND
    assert code_of(snaps.commit, "Z", "A") == C.FAILED_PRECONDITION
    assert code_of(snaps.prepare, "") == C.INVALID_ARGUMENT
    assert code_of(snaps.prepare, "bad\0key") == C.INVALID_ARGUMENT
    assert code_of(snaps.remove, "zz") == C.NOT_FOUND
    assert code_of(snaps.usage, "zz") == C.NOT_FOUND
    assert code_of(snaps.walk, 'name=="unterminated') == C.INVALID_ARGUMENT


def test_remove_of_a_key_with_children_is_refused(snaps: Served) -> None:
    snaps.prepare("a")
    snaps.commit("A", "a")
    snaps.prepare("b", "A")
    snaps.view("v", "A")
    assert code_of(snaps.remove, "A") == C.FAILED_PRECONDITION
    snaps.remove("b")
    assert code_of(snaps.remove, "A") == C.FAILED_PRECONDITION  # the view is a child too
    snaps.remove("v")
    snaps.remove("A")
    assert snaps.walk() == {}
    assert os.listdir(snaps.root / "snapshots") == []  # every directory went with its record


def test_walk_filters(snaps: Served) -> None:
    snaps.prepare("a", labels={"containerd.io/snapshot.ref": "sha256:1", "team": "x"})
    snaps.commit("A", "a", {"containerd.io/snapshot.ref": "sha256:1", "team": "x"})
    snaps.prepare("b", "A", {"team": "y"})
    snaps.view("v", "A")
    assert set(snaps.walk()) == {"A", "b", "v"}
    assert set(snaps.walk("kind==committed")) == {"A"}
    assert set(snaps.walk("kind==active")) == {"b"}
    assert set(snaps.walk('parent=="A"')) == {"b", "v"}
    assert set(snaps.walk('parent==""')) == {"A"}  # containerd looks for a base layer this way
    assert set(snaps.walk('labels."containerd.io/snapshot.ref"==sha256:1,parent==""')) == {"A"}
    assert set(snaps.walk('labels."containerd.io/snapshot.ref"==sha256:1,parent=="b"')) == set()
    assert set(snaps.walk("labels.team")) == {"A", "b"}  # presence
    assert set(snaps.walk("labels.team!=x")) == {"b", "v"}  # an absent label is "" for !=
    assert set(snaps.walk("name~=^[ab]$")) == {"b"}
    assert set(snaps.walk("kind==view", "labels.team==x")) == {"v", "A"}  # filters: any may match
    assert set(snaps.walk("name==A,kind==active")) == set()  # selectors: all must match


def test_update_labels(snaps: Served) -> None:
    snaps.prepare("a", labels={"k1": "v1", "k2": "v2"})
    req = pb.UpdateSnapshotRequest(info=pb.Info(name="a", labels={"k2": "new", "k3": "v3"}))
    req.update_mask.paths.extend(["labels.k2", "labels.k1"])
    info = snaps.stub.Update(req).info
    assert dict(info.labels) == {"k2": "new"}  # k1 unset (absent from the new labels), k3 not in the mask
    info = snaps.stub.Update(pb.UpdateSnapshotRequest(info=pb.Info(name="a", labels={"only": "this"}))).info
    assert dict(info.labels) == {"only": "this"}
    assert dict(snaps.stat("a").labels) == {"only": "this"}
    bad = pb.UpdateSnapshotRequest(info=pb.Info(name="a", parent="x"))
    bad.update_mask.paths.append("parent")
    assert code_of(snaps.stub.Update, bad) == C.INVALID_ARGUMENT
    assert code_of(snaps.stub.Update, pb.UpdateSnapshotRequest(info=pb.Info(name="zz"))) == C.NOT_FOUND


def test_usage_counts_local_bytes(snaps: Served) -> None:
    [m] = snaps.prepare("a")
    Path(m.source, "data").write_bytes(os.urandom(300_000))
    os.link(Path(m.source, "data"), Path(m.source, "hardlink"))
    size, inodes = snaps.usage("a")
    assert 300_000 <= size < 400_000 and inodes == 1  # a hard link is one inode, counted once
    snaps.commit("A", "a")
    assert snaps.usage("A") == (size, inodes)
    [m] = snaps.prepare("b", "A")
    assert snaps.usage("b") == (0, 0)  # the parent's bytes are the parent's
    Path(opts(m)["upperdir"], "w").write_bytes(b"x" * 5000)
    assert snaps.usage("b")[1] == 1


def test_cleanup_removes_what_no_record_names(snaps: Served) -> None:
    snaps.prepare("a")
    orphan = snaps.root / "snapshots" / "999"
    (orphan / "fs").mkdir(parents=True)
    snaps.stub.Cleanup(pb.CleanupRequest())
    assert not orphan.exists()
    assert snaps.walk().keys() == {"a"} and (snaps.root / "snapshots" / "1" / "fs").is_dir()


@pytest.mark.root
@needs_busybox
def test_remote_layer_protocol(snaps: Served, tmp_path: Path) -> None:
    """containerd's remote-snapshot protocol: Prepare with the target label and our blob label
    answers AlreadyExists; the committed snapshot is found by containerd's Walk filter; a child
    stacks the blob's EROFS mount; Usage counts no local bytes; the last Remove unmounts it."""
    _blobs, blob = busybox_image(tmp_path / "img")
    os.rename(tmp_path / "img" / "blobs" / blob, snaps.blobs / blob)
    labels = {LABEL_REF: "sha256:chain1", LABEL_BLOB: blob}
    assert code_of(snaps.prepare, "default/1/extract-1 sha256:chain1", "", labels) == C.ALREADY_EXISTS
    found = snaps.walk(f'labels."{LABEL_REF}"==sha256:chain1,parent==""')
    assert list(found) == [REMOTE_PREFIX + "sha256:chain1"]
    name = REMOTE_PREFIX + "sha256:chain1"
    assert found[name].kind == pb.COMMITTED
    assert code_of(snaps.prepare, "default/2/extract-2 sha256:chain1", "", labels) == C.ALREADY_EXISTS  # again
    assert "default/1/extract-1 sha256:chain1" not in snaps.walk()  # the extraction key is never created
    layer_mp = snaps.sn.layers.mountpoint(blob)
    assert linux.fs_type(layer_mp) == linux.EROFS_MAGIC
    [m] = snaps.prepare("ctr1", name)
    assert opts(m)["lowerdir"] == layer_mp
    assert snaps.usage(name) == (0, 0)
    target = tmp_path / "root"
    target.mkdir()
    linux.mount("overlay", target, "overlay", 0, ",".join(m.options))
    try:
        assert (target / "etc" / "motd").read_text() == "base motd\n"
        (target / "written").write_text("by the container")
    finally:
        linux.umount(target)
    assert snaps.usage("ctr1")[1] == 1
    assert code_of(snaps.remove, name) == C.FAILED_PRECONDITION
    snaps.remove("ctr1")
    snaps.remove(name)
    assert not linux.is_mount(layer_mp) and not os.path.exists(layer_mp)


def test_a_root_overlayfs_cannot_name_is_refused(tmp_path: Path) -> None:
    from layerstore.errors import ConfigError
    from snapshotter.snapshots import Snapshotter

    with pytest.raises(ConfigError, match="overlayfs"):
        Snapshotter(tmp_path / "a:b")
