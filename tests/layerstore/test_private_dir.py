"""`fileio.private_dir` (issue 27): a directory of the node's own is 0700 (0710 and a group for a
control group) whatever mode it had; a symlink, a file or another user's directory in its place
is refused, and nothing is changed through it."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from layerstore.errors import PermissionDenied
from layerstore.fileio import narrow_files, private_dir
from runtime_shim.nodestate.paths import NodePaths


def mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def test_made_or_narrowed_to_0700(tmp_path: Path) -> None:
    new = private_dir(tmp_path / "a" / "b", parents=True)
    assert mode(new) == 0o700
    wide = tmp_path / "wide"
    wide.mkdir()
    wide.chmod(0o757)
    private_dir(wide)
    assert mode(wide) == 0o700
    gid = os.getegid()
    private_dir(wide, gid=gid)
    assert (mode(wide), wide.stat().st_gid) == (0o710, gid)


@pytest.mark.hostile
def test_a_symlink_or_a_file_in_its_place_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    elsewhere.chmod(0o777)
    link = tmp_path / "link"
    link.symlink_to(elsewhere)
    with pytest.raises(PermissionDenied, match="symlink"):
        private_dir(link)
    assert mode(elsewhere) == 0o777  # nothing changed through the link
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(PermissionDenied):
        private_dir(tmp_path / "file")
    # A node directory whose cache is a planted symlink: the shim refuses to use it.
    node = tmp_path / "node"
    node.mkdir()
    (node / "cache").symlink_to(elsewhere)
    with pytest.raises(PermissionDenied):
        NodePaths(node).create()


@pytest.mark.hostile
@pytest.mark.root
def test_another_users_directory_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    theirs.chmod(0o755)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(PermissionDenied, match="uid 65534"):
        private_dir(theirs)
    assert mode(theirs) == 0o755


def test_narrow_files(tmp_path: Path) -> None:
    (tmp_path / "data.mdb").write_bytes(b"")
    (tmp_path / "data.mdb").chmod(0o644)
    (tmp_path / "lock.mdb").symlink_to(tmp_path / "data.mdb")
    narrow_files(tmp_path, ("data.mdb", "lock.mdb", "absent"))
    assert mode(tmp_path / "data.mdb") == 0o600
