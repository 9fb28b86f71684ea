"""The mount table (/proc/self/mountinfo: parse, escape, unescape, "is this a mount point").

Two costs of asking what is mounted:
* the whole picture (`read_mounts`): one parse of /proc/self/mountinfo, O(mounts). With 10,000
  sandboxes the file is several MB (every overlay line carries its lowerdir/upperdir/workdir),
  so nothing on the path of a single mount may read it;
* one path (`is_mount`, `is_mount_root`, `mount_id`, `find_mount`'s line filter aside, and
  `mounts.detach`, `filesystems.fs_type`): O(1) syscalls on that path only.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

MOUNTINFO = "/proc/self/mountinfo"


@dataclass(frozen=True)
class MountEntry:
    mountpoint: str
    fstype: str
    source: str
    options: str  # per-superblock options (the overlay's lowerdir/upperdir, the erofs source...)
    device: str = ""  # major:minor


def escape(value: str) -> str:
    """The kernel's and libmount's escaping of space, tab, newline and backslash: a backslash and
    three octal digits."""
    return (value.replace("\\", "\\134").replace(" ", "\\040").replace("\t", "\\011")
            .replace("\n", "\\012"))


def unescape(field: str) -> str:
    """The inverse of `escape`."""
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        octal = field[i + 1 : i + 4]
        if field[i] == "\\" and len(octal) == 3 and octal.isdigit():
            out.append(chr(int(octal, 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def parse_mountinfo(lines: Iterable[str]) -> dict[str, MountEntry]:
    """Mount point -> its topmost mount (a later line for the same point is stacked on top)."""
    out: dict[str, MountEntry] = {}
    for line in lines:
        fields = line.rstrip("\n").split(" ")
        try:
            sep = fields.index("-", 6)
        except ValueError:
            continue
        mp = unescape(fields[4])
        out[mp] = MountEntry(mp, fields[sep + 1], unescape(fields[sep + 2]),
                             fields[sep + 3] if len(fields) > sep + 3 else "", fields[2])
    return out


def _mountinfo_lines() -> Iterator[str]:
    with open(MOUNTINFO, encoding="utf-8", errors="surrogateescape") as f:
        yield from f


def read_mounts() -> dict[str, MountEntry]:
    """The whole mount table of this namespace, O(mounts)."""
    return parse_mountinfo(_mountinfo_lines())


def find_mount(target: str | os.PathLike[str]) -> MountEntry | None:
    """The topmost mount at `target`, reading mountinfo but parsing only the lines that name it
    (works on dead FUSE mounts, where stat() fails with ENOTCONN)."""
    want = os.path.abspath(os.fsdecode(target))
    needle = f" {escape(want)} "
    found = None
    for line in _mountinfo_lines():
        if needle in line:
            found = parse_mountinfo([line]).get(want, found)
    return found


def mounts_under(mounts: dict[str, MountEntry], root: str) -> list[MountEntry]:
    """Mounts at or below `root`, deepest first (the order to unmount them in)."""
    root = root.rstrip("/")
    found = [m for p, m in mounts.items() if p == root or p.startswith(root + "/")]
    return sorted(found, key=lambda m: m.mountpoint.count("/"), reverse=True)


def is_mount(path: str | os.PathLike[str]) -> bool:
    """Is `path` the root of a mount? O(1): a mount root's device differs from its parent's (true
    for every mount the node makes: FUSE, EROFS and overlayfs each have their own device; a bind
    mount within one filesystem would not be seen: `is_mount_root`). A dead FUSE mount
    (ENOTCONN) is a mount."""
    p = os.path.abspath(path)
    try:
        st = os.lstat(p)
    except OSError as e:
        return e.errno == errno.ENOTCONN
    try:
        parent = os.lstat(os.path.dirname(p))
    except OSError:
        return False
    return st.st_dev != parent.st_dev or st.st_ino == parent.st_ino


def mount_id(path: str | os.PathLike[str]) -> int | None:
    """The mount id (mountinfo's first field) of the mount `path` is on, from /proc/self/fdinfo."""
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        with open(f"/proc/self/fdinfo/{fd}") as f:
            for line in f:
                if line.startswith("mnt_id:"):
                    return int(line.split()[1])
    finally:
        os.close(fd)
    return None


def is_mount_root(path: str | os.PathLike[str]) -> bool:
    """Is `path` the root of a mount, bind mounts of the same filesystem included? O(1): its mount
    id differs from its parent directory's."""
    p = os.path.abspath(path)
    mine, parent = mount_id(p), mount_id(os.path.dirname(p))
    return mine is not None and parent is not None and mine != parent


def bdi_read_ahead_kb(mountpoint: str | os.PathLike[str]) -> str | None:
    """The sysfs file of a mount's readahead (its backing device info), found through mountinfo,
    so no request reaches the filesystem (a FUSE mount not yet serving would hang a stat)."""
    m = find_mount(mountpoint)
    return f"/sys/class/bdi/{m.device}/read_ahead_kb" if m is not None and m.device else None

