"""Issue 27, a kept upper the node disk cannot hold: `--upper-size 500G` on a disk with 73 GB
free was accepted (a sparse image: nothing fails until the sandboxes fill the disk, and then
every writer on it does). A kept upper is refused (`NodeFull`, exit 2) when its size and what
the other kept uppers may still take exceed the node disk's free space; the image is reserved
(created sparse) under the node lock, so two mounts cannot both count the same free space."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from testkit.cli_helpers import assert_clean_failure, layerctl
from testkit.fuse_helpers import make_tree
from testkit.shim_support import cleanup_node, needs_root, node_mounts, store_with_env

from runtime_shim.errors import NodeFull
from runtime_shim.node.overlay import check_room, image_growth, kept_uppers_growth, reserve_upper_image

MiB = 1 << 20


def test_check_room_counts_the_other_kept_uppers() -> None:
    check_room(60 * MiB, 40 * MiB, 100 * MiB, "d")  # exactly full: allowed
    with pytest.raises(NodeFull) as ei:
        check_room(60 * MiB, 41 * MiB, 100 * MiB, "d")
    assert "100 MiB free" in str(ei.value) and "at most 59 MiB" in str(ei.value)
    assert (ei.value.exit_code, ei.value.errno) == (2, errno.ENOSPC)
    assert image_growth(100 * MiB, (30 * MiB) // 512) == 70 * MiB
    assert image_growth(MiB, 4096) == 0  # (more blocks than its size: metadata; never negative)


def _free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def test_reserve_refuses_what_the_disk_cannot_hold(tmp_path: Path) -> None:
    """Another kept upper that may still grow by twice the free space leaves no room for a
    64 MiB one; without it, the 64 MiB image is reserved: sparse, 0600, at its full size."""
    sandboxes = tmp_path / "sandboxes"
    (sandboxes / "other").mkdir(parents=True)
    (sandboxes / "mine").mkdir()
    other = sandboxes / "other" / "upper.img"
    with open(other, "wb") as f:
        f.truncate(2 * _free(tmp_path))  # sparse: takes nothing yet, may take all that
    mine = sandboxes / "mine" / "upper.img"
    assert kept_uppers_growth(sandboxes, "upper.img", absent="mine") == other.stat().st_size
    with pytest.raises(NodeFull):
        reserve_upper_image(mine, 64 * MiB)
    assert not mine.exists()
    other.unlink()
    reserve_upper_image(mine, 64 * MiB)
    st = mine.stat()
    assert (st.st_size, st.st_blocks, st.st_mode & 0o777) == (64 * MiB, 0, 0o600)
    with pytest.raises(FileExistsError):  # (exclusive: a planted file is never taken over)
        reserve_upper_image(mine, 64 * MiB)
    # Larger than the disk's free space on its own: refused with no other upper at all.
    (sandboxes / "big").mkdir()
    with pytest.raises(NodeFull):
        reserve_upper_image(sandboxes / "big" / "upper.img", 2 * _free(tmp_path) + (1 << 30))


@needs_root
def test_layerctl_mount_refuses_an_upper_size_beyond_the_free_space(tmp_path: Path) -> None:
    """`layerctl mount --upper-size` of twice the node disk's free space: exit 2, one clear line,
    and nothing left on the node (no sandbox, no directory, no mount); a size that fits mounts."""
    src = tmp_path / "src"
    make_tree(src, small=2, big=(64 << 10,))
    url = store_with_env(tmp_path, src)
    node = tmp_path / "node"
    try:
        too_big = 2 * _free(tmp_path) + (1 << 30)
        r = layerctl("mount", "--store", url, "--node-dir", str(node), "--sandbox", "huge",
                     "--upper-size", str(too_big), "bb:1", str(tmp_path / "root"))
        assert r.code == 2, r
        assert_clean_failure(r, "free")
        assert not (node / "sandboxes" / "huge").exists()
        assert layerctl("sandbox", "ls", "--node-dir", str(node), "--json").json()["sandboxes"] == []
        r = layerctl("mount", "--store", url, "--node-dir", str(node), "--sandbox", "fits",
                     "--upper-size", "64M", "bb:1", str(tmp_path / "root"))
        assert r.code == 0, r.err
        assert (node / "sandboxes" / "fits" / "upper.img").stat().st_size == 64 * MiB
        assert layerctl("umount", "--node-dir", str(node), "fits").code == 0
    finally:
        cleanup_node(node, tmp_path)
    assert not node_mounts(node, tmp_path)
