"""Reusable helpers for tests that build and mount EROFS images.

- `mounted_erofs(image)`: mount an image file-backed on a fresh temporary directory, yield the
  mount point, always unmount (and remove the directory) afterwards.
- `snapshot_tree(root)`: everything a layer promises about a tree, as a plain dict keyed by
  relative path (bytes): type, mode, owner, size, mtime, content digest, symlink target, xattrs,
  device numbers, hard-link groups.
- `assert_trees_equal(a, b)`: compare two snapshots with a readable diff.
- `fsck_erofs(image)`: run erofs-utils' `fsck.erofs` and fail the test if it complains.
- `make_tree(root, spec)`: create a small tree on disk from a compact description.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import blake3
import pytest

from layerstore.linux import mount_erofs, umount

HAVE_ROOT = os.geteuid() == 0
HAVE_FSCK = shutil.which("fsck.erofs") is not None
F = TypeVar("F", bound=Callable[..., Any])


def needs_mount(fn: F) -> F:
    """A test that mounts EROFS images and checks them with fsck.erofs."""
    return pytest.mark.root(pytest.mark.skipif(not HAVE_FSCK, reason="needs fsck.erofs")(fn))


@contextlib.contextmanager
def mounted_erofs(image: str | os.PathLike[str], options: str = "") -> Iterator[Path]:
    """Mount `image` (a regular file) read-only with EROFS's file-backed mode."""
    target = Path(tempfile.mkdtemp(prefix="erofs-mnt-"))
    try:
        mount_erofs(image, target, options)
        try:
            yield target
        finally:
            umount(target, lazy=True)
    finally:
        target.rmdir()


def fsck_erofs(image: str | os.PathLike[str]) -> None:
    proc = subprocess.run(["fsck.erofs", os.fspath(image)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"fsck.erofs {image} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"


def _digest_file(path: bytes) -> str:
    h = blake3.blake3()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def snapshot_tree(root: str | os.PathLike[str], *, root_meta: bool = True) -> dict[bytes, dict[str, Any]]:
    """{relative path: attributes} for every path under `root` (b"" is the root itself).

    Hard links show up as `link_group`: the sorted paths that share the inode (for every
    non-directory with more than one link inside the tree). Directory sizes and nlinks differ
    between filesystems and are left out."""
    top = os.fsencode(root)
    out: dict[bytes, dict[str, Any]] = {}
    by_ino: dict[int, list[bytes]] = {}
    stack = [b""]
    while stack:
        rel = stack.pop()
        disk = top + b"/" + rel if rel else top
        st = os.lstat(disk)
        kind = stat.S_IFMT(st.st_mode)
        rec: dict[str, Any] = {
            "type": stat.filemode(st.st_mode)[0],
            "mode": oct(stat.S_IMODE(st.st_mode)),
            "uid": st.st_uid, "gid": st.st_gid,
            "mtime_ns": st.st_mtime_ns,
            "xattrs": {n: os.getxattr(disk, n, follow_symlinks=False)
                       for n in sorted(os.listxattr(disk, follow_symlinks=False))},
        }
        if kind == stat.S_IFREG:
            rec["size"] = st.st_size
            rec["blake3"] = _digest_file(disk)
            rec["nlink"] = st.st_nlink
        elif kind == stat.S_IFLNK:
            rec["target"] = os.readlink(disk)
            rec["nlink"] = st.st_nlink
        elif kind in (stat.S_IFCHR, stat.S_IFBLK):
            rec["rdev"] = (os.major(st.st_rdev), os.minor(st.st_rdev))
        if kind != stat.S_IFDIR:
            by_ino.setdefault(st.st_ino, []).append(rel)
        if rel == b"" and not root_meta:
            rec = {"type": rec["type"]}
        out[rel] = rec
        if kind == stat.S_IFDIR:
            for name in os.listdir(disk):
                stack.append(rel + b"/" + name if rel else name)
    for paths in by_ino.values():
        if len(paths) > 1:
            group = tuple(sorted(paths))
            for p in paths:
                out[p]["link_group"] = group
    return out


def assert_trees_equal(a: dict[bytes, dict[str, Any]], b: dict[bytes, dict[str, Any]]) -> None:
    only_a = sorted(set(a) - set(b))
    only_b = sorted(set(b) - set(a))
    diffs = []
    for p in sorted(set(a) & set(b)):
        if a[p] != b[p]:
            keys = sorted(set(a[p]) | set(b[p]))
            diffs.append((p, {k: (a[p].get(k), b[p].get(k)) for k in keys if a[p].get(k) != b[p].get(k)}))
    assert not (only_a or only_b or diffs), (
        f"trees differ:\n only in first: {only_a[:20]}\n only in second: {only_b[:20]}\n"
        f" different: {diffs[:20]}")


def make_tree(root: Path, spec: dict[str, Any]) -> None:
    """Create files from {relative path: content}: bytes for a file, a dict of attributes
    ({"symlink": target} / {"dir": True} / {"data": bytes, "mode": 0o4755, "xattrs": {...}})."""
    for rel, what in spec.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(what, bytes):
            p.write_bytes(what)
            continue
        if "symlink" in what:
            os.symlink(what["symlink"], p)
        elif what.get("dir"):
            p.mkdir(exist_ok=True)
        else:
            p.write_bytes(what.get("data", b""))
        if "mode" in what:
            os.chmod(p, what["mode"])
        for k, v in what.get("xattrs", {}).items():
            os.setxattr(p, k, v, follow_symlinks=False)


def expected_snapshot(entries: list[tuple[Any, bytes | None]], *, mtime_clamp: int | None = None,
                      all_root: bool = False) -> dict[bytes, dict[str, Any]]:
    """What `snapshot_tree` of the mounted image should show for in-memory entries whose
    content is given as whole byte strings (implicit parents, hard links, clamping applied)."""
    from erofs_builder.tree import Kind

    type_char = {Kind.DIR: "d", Kind.REG: "-", Kind.SYMLINK: "l", Kind.CHR: "c", Kind.BLK: "b",
                 Kind.FIFO: "p", Kind.SOCK: "s"}
    default_mtime = (mtime_clamp or 0) * 1_000_000_000

    def implicit() -> dict[str, Any]:
        return {"type": "d", "mode": "0o755", "uid": 0, "gid": 0, "mtime_ns": default_mtime, "xattrs": {}}

    out: dict[bytes, dict[str, Any]] = {b"": implicit()}
    inode_of: dict[bytes, dict[str, Any]] = {}
    paths_of: dict[int, list[bytes]] = {}
    for e, data in entries:
        parts = e.path.split(b"/") if e.path else []
        for i in range(1, len(parts)):
            out.setdefault(b"/".join(parts[:i]), implicit())
        if e.hardlink is not None:
            rec = inode_of[e.hardlink]
            out[e.path] = rec
            inode_of[e.path] = rec
            paths_of[id(rec)].append(e.path)
            continue
        mtime, nsec = e.mtime, e.mtime_nsec
        if mtime_clamp is not None and (mtime, nsec) > (mtime_clamp, 0):
            mtime, nsec = mtime_clamp, 0
        rec = {"type": type_char[e.kind], "mode": oct(e.mode), "uid": 0 if all_root else e.uid,
               "gid": 0 if all_root else e.gid, "mtime_ns": mtime * 1_000_000_000 + nsec,
               "xattrs": {os.fsdecode(k): v for k, v in sorted(e.xattrs.items())}}
        if e.kind is Kind.REG:
            content = data or b""
            rec.update(size=len(content), blake3=blake3.blake3(content).hexdigest())
        elif e.kind is Kind.SYMLINK:
            rec["target"] = e.symlink
        elif e.kind in (Kind.CHR, Kind.BLK):
            rec["rdev"] = tuple(e.rdev)
        out[e.path] = rec
        inode_of[e.path] = rec
        paths_of[id(rec)] = [e.path]
    result: dict[bytes, dict[str, Any]] = {}
    for path, rec in out.items():
        rec = dict(rec)
        if rec["type"] != "d":
            group = paths_of.get(id(out[path]), [path])
            if rec["type"] in "-l":
                rec["nlink"] = len(group)
            if len(group) > 1:
                rec["link_group"] = tuple(sorted(group))
        result[path] = rec
    return result
