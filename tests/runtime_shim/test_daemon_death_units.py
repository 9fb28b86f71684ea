"""Pure units of what a node daemon's death takes (`nodestate.lost`): which layer mounts read
through its FUSE mount, which sandboxes are lost with them, and the lost mark in the state (an
LMDB in a temporary directory: no kernel, no root)."""

from __future__ import annotations

from pathlib import Path

from layerstore.linux import MountEntry
from runtime_shim.nodestate.lost import (
    dead_layer_mounts,
    lost_layers,
    lost_reason,
    lost_sandboxes,
    mark_lost,
    reads_through_fuse,
)
from runtime_shim.nodestate.state import BROKEN, MOUNTED, MOUNTING, UNMOUNTING, LayerMount, NodeState, Sandbox
from runtime_shim.supervise.death import Severed

FUSE = "/n/fuse"
A, B, C, D = ("b3:" + c * 64 for c in "abcd")


def fuse_layer(blob: str, generation: str = "daemon:1:10", status: str = MOUNTED) -> LayerMount:
    return LayerMount(blob, f"/n/layers/{blob[3:]}", f"{FUSE}/blobs/{blob}", 1, generation, status)


def sandbox(sid: str, layers: list[str], status: str = MOUNTED, lost: str = "") -> Sandbox:
    return Sandbox(sid, "e:1", "b3:m", layers, {}, f"/n/roots/{sid}", f"/n/sandboxes/{sid}/upper",
                   f"/n/sandboxes/{sid}/work", True, status=status, lost=lost)


def test_only_layers_mounted_on_the_daemons_fuse_files_depend_on_it() -> None:
    assert reads_through_fuse(fuse_layer(A), FUSE)
    pinned = LayerMount(A, "/n/layers/a", "/n/cache/data/a", 1, "direct", pin="shim:/n/layers/a")
    attached = LayerMount(A, "/n/layers/a", "/n/cache/data/a", 1, "fanotify:g1")
    local = LayerMount(A, "/n/layers/a", "/images/a", 1, "dir")
    beside = LayerMount(A, "/n/layers/a", "/n/fuse2/blobs/a", 1, "daemon:1:10")  # (a prefix, not the directory)
    assert not any(reads_through_fuse(lm, FUSE) for lm in (pinned, attached, local, beside))


def test_layers_of_a_daemon_that_is_not_the_healthy_one_are_lost() -> None:
    old, new = fuse_layer(A, "daemon:1:10"), fuse_layer(B, "daemon:2:20")
    claimed = fuse_layer(C, "daemon:1:10", MOUNTING)  # its claimant settles it
    pinned = LayerMount(D, "/n/layers/d", "/n/cache/data/d", 1, "direct", pin="shim:/n/layers/d")
    layers = [old, new, claimed, pinned]
    assert [lm.blob for lm in lost_layers(layers, FUSE, None)] == [A, B]  # no healthy daemon: every FUSE one
    assert [lm.blob for lm in lost_layers(layers, FUSE, "daemon:2:20")] == [A]
    # the fanotify data path: the generation names the group and the daemon; a FUSE-backed layer
    # (its attach failed) follows the daemon
    assert [lm.blob for lm in lost_layers(layers, FUSE, "fanotify:g1|daemon:2:20")] == [A]


def test_the_sandboxes_stacked_on_a_lost_layer_are_lost_once() -> None:
    sbs = [sandbox("s1", [A, B]), sandbox("s2", [B]), sandbox("s3", [C, A], BROKEN),
           sandbox("s4", [A], MOUNTING), sandbox("s5", [A], UNMOUNTING), sandbox("s6", [A], lost="earlier")]
    assert [sb.id for sb in lost_sandboxes(sbs, [A])] == ["s1", "s3"]
    assert lost_sandboxes(sbs, []) == []


def test_the_reason_is_one_line_naming_the_layer_and_the_time() -> None:
    why = lost_reason(A, 0.0)
    assert why == f"its layer {A} was on the node daemon's FUSE mount, which died at 1970-01-01T00:00:00Z: run it again"
    assert "\n" not in why and "died:" in lost_reason(A)


def test_the_erofs_mounts_on_a_dead_fuse_mount_are_found_in_the_mount_table() -> None:
    mounts = {m.mountpoint: m for m in (
        MountEntry("/n/fuse", "fuse.layerstore", "layerstore", "rw"),
        MountEntry("/n/layers/a", "erofs", f"{FUSE}/blobs/{A}", "ro"),
        MountEntry("/n/layers/b", "erofs", f"/n/cache/data/{B}", "ro"),  # direct: a local file
        MountEntry("/elsewhere/c", "erofs", f"{FUSE}/blobs/{C}", "ro"),  # not the node's layer mount
        MountEntry("/n/roots/s1", "overlay", "overlay", "lowerdir=/n/layers/a"),
    )}
    assert dead_layer_mounts(mounts, "/n/layers", FUSE) == ["/n/layers/a"]


def test_mark_lost_marks_the_sandboxes_in_one_transaction_and_keeps_the_layer_records(tmp_path: Path) -> None:
    with NodeState(tmp_path / "state") as state:
        with state.write() as t:
            for lm in (fuse_layer(A), fuse_layer(B, "daemon:2:20")):
                t.put_layer(lm)
            for sb in (sandbox("s1", [A]), sandbox("s2", [B]), sandbox("s3", [B, A])):
                t.put_sandbox(sb)
        with state.write() as t:
            loss = mark_lost(t, FUSE, "daemon:2:20", 0.0)
        assert loss.sandbox_ids == ["s1", "s3"] and [lm.blob for lm in loss.layers] == [A]
        with state.read() as t:
            marked = {sb.id: sb.lost for sb in t.sandboxes()}
            assert {lm.blob for lm in t.layers()} == {A, B}  # (stale: the next mount or recovery remounts them)
        assert marked == {"s1": lost_reason(A, 0.0), "s2": "", "s3": lost_reason(A, 0.0)}
        with state.write() as t:  # idempotent: a marked sandbox keeps its first reason
            assert mark_lost(t, FUSE, None, 99.0).sandbox_ids == ["s2"]
        with state.read() as t:
            assert t.sandbox("s1").lost == lost_reason(A, 0.0)  # type: ignore[union-attr]
            assert t.sandbox("s2").lost == lost_reason(B, 99.0)  # type: ignore[union-attr]


def test_the_lost_mark_is_in_the_record_only_when_set() -> None:
    assert "lost" not in sandbox("s1", [A]).to_json()
    sb = sandbox("s1", [A], lost="why")
    assert Sandbox.from_json(sb.to_json()).lost == "why"


def test_the_restart_line_says_what_went() -> None:
    from runtime_shim.nodestate.lost import Loss

    sev = Severed(Loss([fuse_layer(A)], [sandbox(f"s{i}", [A]) for i in range(7)]), ["/n/layers/a"])
    assert sev.summary() == ("1 layer mount(s) on its dead FUSE mount removed, 7 sandbox(es) lost: "
                             "s0, s1, s2, s3, s4, ... (7)")
    assert Severed().summary() == "0 layer mount(s) on its dead FUSE mount removed, 0 sandbox(es) lost"
