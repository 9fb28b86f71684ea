"""Helpers for the flattened-root tests and benchmarks: layers built from entry lists, the
kernel's own overlay of them (the reference view), and snapshots comparable across the two.

- `build_layers(tmp, specs)`: one EROFS layer image per list of (Entry, data).
- `overlay_view(layers)`: mount every layer file-backed and stack them read-only with
  overlayfs (bottom first in `layers`); yields the overlay's root; unmounts everything.
- `mounted_multidevice(image, devices)`: mount a multi-device image with `device=` options.
- `comparable(root)`: like `snapshot_tree`, with hard links grouped by (st_dev, st_ino) (the overlay
  shows lower files with their own layer's device and inode numbers, which collide across layers)
  and link counts left out (overlay reports the lower inode's count, hidden names included).
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import blake3

from erofs_builder.build import build_layer
from erofs_builder.tree import Entry
from layerstore.linux import MS_RDONLY, mount, mount_erofs, umount


def build_layers(tmp: Path, specs: Sequence[Sequence[tuple[Entry, Any]]]) -> list[Path]:
    """Data is None, bytes, or a tuple of pieces (bytes and `Hole`s)."""
    out = []
    for i, entries in enumerate(specs):
        path = tmp / f"layer{i}.erofs"
        build_layer([(e, d if d is None or isinstance(d, tuple) else (d,)) for e, d in entries], path)
        out.append(path)
    return out


@contextlib.contextmanager
def overlay_view(layers: Sequence[Path]) -> Iterator[Path]:
    mounted: list[Path] = []
    top = Path(tempfile.mkdtemp(prefix="flat-ovl-"))
    try:
        for lay in layers:
            m = Path(tempfile.mkdtemp(prefix="flat-lower-"))
            mount_erofs(lay, m)
            mounted.append(m)
        # overlayfs needs two lowers without an upper: an empty directory at the bottom then
        # (whiteouts and opaque markers of a lone layer mean something only to the overlay)
        bottom = [os.fspath(top) + ".empty"] if len(mounted) == 1 else []
        for b in bottom:
            os.mkdir(b)
        lowers = ":".join([*(os.fspath(m) for m in reversed(mounted)), *bottom])
        mount("overlay", top, "overlay", MS_RDONLY, f"lowerdir={lowers}")
        try:
            yield top
        finally:
            umount(top, lazy=True)
    finally:
        top.rmdir()
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(os.fspath(top) + ".empty")
        for m in mounted:
            umount(m, lazy=True)
            m.rmdir()


@contextlib.contextmanager
def mounted_multidevice(image: Path, devices: Sequence[Path]) -> Iterator[Path]:
    from erofs_builder.flatten import mount_options

    target = Path(tempfile.mkdtemp(prefix="flat-mnt-"))
    try:
        mount_erofs(image, target, mount_options(devices))
        try:
            yield target
        finally:
            umount(target, lazy=True)
    finally:
        target.rmdir()


def comparable(root: Path) -> dict[bytes, dict[str, Any]]:
    """What `snapshot_tree` records, except: hard links grouped by (st_dev, st_ino) as `links`,
    no link counts, and names that readdir lists but lookup does not find left out (overlayfs
    lists a whiteout inside a directory that no lower layer merges with)."""
    top = os.fsencode(root)
    out: dict[bytes, dict[str, Any]] = {}
    groups: dict[tuple[int, int], list[bytes]] = {}
    stack = [b""]
    while stack:
        rel = stack.pop()
        disk = top + b"/" + rel if rel else top
        try:
            st = os.lstat(disk)
        except FileNotFoundError:
            continue
        rec: dict[str, Any] = {
            "type": stat.filemode(st.st_mode)[0], "mode": oct(stat.S_IMODE(st.st_mode)),
            "uid": st.st_uid, "gid": st.st_gid, "mtime_ns": st.st_mtime_ns,
            "xattrs": {n: os.getxattr(disk, n, follow_symlinks=False)
                       for n in sorted(os.listxattr(disk, follow_symlinks=False))},
        }
        if stat.S_ISREG(st.st_mode):
            with open(disk, "rb") as f:
                rec.update(size=st.st_size, blake3=blake3.blake3(f.read()).hexdigest())
        elif stat.S_ISLNK(st.st_mode):
            rec["target"] = os.readlink(disk)
        elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
            rec["rdev"] = (os.major(st.st_rdev), os.minor(st.st_rdev))
        out[rel] = rec
        if stat.S_ISDIR(st.st_mode):
            stack.extend(rel + b"/" + n if rel else n for n in os.listdir(disk))
        else:
            groups.setdefault((st.st_dev, st.st_ino), []).append(rel)
    for paths in groups.values():
        if len(paths) > 1:
            for p in paths:
                out[p]["links"] = tuple(sorted(paths))
    return out
