"""A kept sandbox's upper with a quota, through real runc: a sparse ext4 image per sandbox
(NODE/sandboxes/<id>/upper.img) loop-mounted at NODE/sandboxes/<id>/scratch. A disk filler gets
ENOSPC in its own upper, the files survive a reboot (recovery mounts the image again before the
overlay), a commit reads the upper, and a teardown leaves no mount and no loop device. Every
mount and loop device is removed by the fixtures, also when a test fails."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from testkit.shim_support import (
    busybox_image,
    busybox_rootfs,
    cleanup_node,
    dir_shim,
    loops_under,
    needs_busybox,
    needs_root,
    needs_runc,
    no_loops_left,
    node_mounts,
    spec,
    store_with_env,
)

from layerstore import linux
from layerstore.store import Store
from runtime_shim.node.blobs import DirBlobs
from runtime_shim.node.request import MountRequest
from runtime_shim.node.shim import Shim
from runtime_shim.nodestate.paths import NodePaths
from runtime_shim.sandbox import runner
from runtime_shim.sandbox.commit import commit

pytestmark = [needs_root, needs_busybox, needs_runc]
EXT4_MAGIC = 0xEF53
MiB = 1 << 20
QUOTA = 32 * MiB


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("kept")
    return busybox_image(root)


@pytest.fixture
def shim(tmp_path: Path, image: tuple[Path, str]) -> Iterator[Shim]:
    with dir_shim(tmp_path, image[0]) as s:
        yield s


def run(shim: Shim, blob: str, script: str, **kw: object) -> tuple[str, int, str, str]:
    out, err = shim.paths.root / "run.out", shim.paths.root / "run.err"
    with open(out, "wb") as o, open(err, "wb") as e:
        res = runner.run(shim, spec((blob, "base")), ["/bin/sh", "-c", script], keep=True, stdin=subprocess.DEVNULL,
                         stdout=o, stderr=e, **kw)  # type: ignore[arg-type]
    return res.sandbox, res.exit_code, out.read_text(), err.read_text()


def on_its_image(shim: Shim, sid: str) -> bool:
    scratch = shim.paths.scratch(sid)
    return (linux.is_mount_root(scratch) and linux.fs_type(scratch) == EXT4_MAGIC
            and shim.find(sid).upper == str(scratch / "upper"))


def test_a_kept_sandboxs_disk_filler_gets_enospc_in_its_own_upper(shim: Shim, image: tuple[Path, str]) -> None:
    sid, code, out, err = run(shim, image[1], "dd if=/dev/zero of=/fill bs=1M count=64; echo rc=$?;"
                              " stat -c %s /fill", upper_size=QUOTA)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] != "rc=0" and int(lines[1]) <= QUOTA, out
    assert "No space left on device" in err
    assert on_its_image(shim, sid)
    img = shim.paths.upper_image(sid)
    # what the filler wrote is in its image (sparse: at most its size), not elsewhere on the node disk
    assert img.stat().st_size == QUOTA and img.stat().st_blocks * 512 <= QUOTA
    vfs = os.statvfs(shim.paths.scratch(sid))
    assert vfs.f_bavail * vfs.f_frsize < MiB  # (full: less than one more of dd's blocks)
    assert len(loops_under(shim.paths.root)) == 1
    shim.unmount(sid)
    assert no_loops_left(shim.paths.root) and node_mounts(shim.paths.sandboxes) == []
    assert not shim.paths.sandbox_dir(sid).exists()


def test_a_kept_sandboxs_files_survive_a_reboot(shim: Shim, image: tuple[Path, str]) -> None:
    sid, code, _, err = run(shim, image[1], "echo kept > /data && mkdir -p /d/e && echo deep > /d/e/f",
                            upper_size=QUOTA)
    assert code == 0, err
    target = Path(shim.find(sid).target)
    with shim.state.write() as t:
        t.put_boot("an-earlier-boot")  # what the database says after a reboot
    node = shim.paths.root
    for m in sorted(linux.mounts_under(linux.read_mounts(), str(node)), key=lambda m: -len(m.mountpoint)):
        linux.umount(m.mountpoint, lazy=True)  # every mount is gone after a reboot
    assert no_loops_left(node) and not (target / "data").exists()
    with Shim(NodePaths(node), DirBlobs(image[0]), auto_recover=False) as again:
        rep = again.recover_if_needed()
        assert rep is not None and rep.rebooted and rep.remounted_sandboxes == [sid], rep
        assert on_its_image(again, sid)
        assert (target / "data").read_text() == "kept\n" and (target / "d" / "e" / "f").read_text() == "deep\n"
        assert again.recover().remounted_sandboxes == []  # (mounted once: nothing left to do)
        again.unmount(sid)
    assert no_loops_left(node) and node_mounts(shim.paths.sandboxes) == []


def test_a_crash_after_the_image_is_mounted_is_rolled_back(shim: Shim, image: tuple[Path, str]) -> None:
    from runtime_shim.nodestate.state import MOUNTING

    sb = shim.mount(MountRequest(spec((image[1], "base")), sandbox="crashed", upper_image=QUOTA))
    with shim.state.write() as t:  # as a mount a crash interrupted leaves it: `mounting`, pending, owner gone
        cur = t.sandbox(sb.id)
        cur.status = MOUNTING
        t.put_sandbox(cur, old=cur)
        t.put_pending(sb.id, "mount")
    shim.lifecycle.undo_mount(shim.find(sb.id), overlay=True, created_dir=True)  # (what recovery does then)
    assert shim.sandboxes() == [] and no_loops_left(shim.paths.root)
    assert node_mounts(shim.paths.sandboxes) == [] and not shim.paths.sandbox_dir(sb.id).exists()


def test_an_explicit_upper_stays_the_callers(shim: Shim, image: tuple[Path, str], tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    sb = shim.mount(MountRequest(spec((image[1], "base")), upper=mine, upper_image=QUOTA))
    try:
        assert sb.upper == str(mine) and not shim.paths.upper_image(sb.id).exists()
        assert loops_under(shim.paths.root) == []
    finally:
        shim.unmount(sb.id)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("kept-store")
    return store_with_env(root, busybox_rootfs(root / "base"))


def test_commit_of_a_kept_quotad_sandbox(tmp_path: Path, store: str) -> None:
    node = tmp_path / "node"
    try:
        with Shim.for_node(node, store) as shim:
            res = runner.run(shim, "bb:1", ["/bin/sh", "-c", "echo committed > /made"], keep=True,
                             upper_size=QUOTA, stdin=subprocess.DEVNULL)
            assert res.exit_code == 0 and on_its_image(shim, res.sandbox)
            with Store.open(store) as st:
                commit(st, shim.find(res.sandbox), "bb:2", workdir=tmp_path)
            shim.unmount(res.sandbox)
            assert no_loops_left(node)
            with open(tmp_path / "out", "wb") as o:
                res = runner.run(shim, "bb:2", ["/bin/cat", "/made"], stdin=subprocess.DEVNULL, stdout=o)
            assert res.exit_code == 0 and (tmp_path / "out").read_text() == "committed\n"
    finally:
        cleanup_node(node, tmp_path)
