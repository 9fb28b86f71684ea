"""What is mounted in this mount namespace.

Two kinds of question, at two costs:
* the whole picture (`read`): one parse of /proc/self/mountinfo, O(mounts). Recovery compares it
  with the state once per run. With 10,000 sandboxes the file is several MB (every overlay line
  carries its lowerdir/upperdir/workdir), so nothing on the path of a single mount may read it;
* one path (`is_mount`, `fs_type`, `mount_id`): O(1) syscalls on that path only, for the mount,
  teardown, health-check and daemon-check paths.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from collections.abc import Iterable
from dataclasses import dataclass

# statfs(2) f_type values (linux/magic.h)
OVERLAYFS_MAGIC = 0x794C7630
EROFS_MAGIC = 0xE0F5E1E2
FUSE_MAGIC = 0x65735546


@dataclass(frozen=True)
class MountEntry:
    mountpoint: str
    fstype: str
    source: str
    options: str  # per-superblock options (the overlay's lowerdir/upperdir, the erofs source...)


def unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as a backslash and three octal digits."""
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1 : i + 4].isdigit() and len(field[i + 1 : i + 4]) == 3:
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def parse(lines: Iterable[str]) -> dict[str, MountEntry]:
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
                             fields[sep + 3] if len(fields) > sep + 3 else "")
    return out


def read() -> dict[str, MountEntry]:
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        return parse(f)


def under(mounts: dict[str, MountEntry], root: str) -> list[MountEntry]:
    """Mounts at or below `root`, deepest first (the order to unmount them in)."""
    root = root.rstrip("/")
    found = [m for p, m in mounts.items() if p == root or p.startswith(root + "/")]
    return sorted(found, key=lambda m: m.mountpoint.count("/"), reverse=True)


def is_dead(path: str | os.PathLike[str]) -> bool:
    """True when `path` is a FUSE mount whose daemon is gone (every access fails with ENOTCONN)."""
    try:
        os.stat(path)
    except OSError as e:
        return e.errno == errno.ENOTCONN
    return False


def find(target: str) -> MountEntry | None:
    """The topmost mount at `target`, reading mountinfo but parsing only the lines that name it
    (for the one-off callers that need a mount's options, e.g. the umount helper)."""
    want = os.path.abspath(target)
    needle = " " + want.replace("\\", "\\134").replace(" ", "\\040").replace("\t", "\\011") \
        .replace("\n", "\\012") + " "
    found = None
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            if needle in line:
                m = parse([line]).get(want)
                if m is not None:
                    found = m
    return found


def is_mount(path: str | os.PathLike[str]) -> bool:
    """Is `path` the root of a mount? O(1): a mount root's device differs from its parent's (true
    for every mount the shim makes: FUSE, EROFS and overlayfs each have their own device; a bind
    mount within one filesystem would not be seen). A dead FUSE mount (ENOTCONN) is a mount."""
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


def is_mount_root(path: str | os.PathLike[str]) -> bool:
    """Is `path` the root of a mount, bind mounts of the same filesystem included? O(1): its mount
    id differs from its parent directory's."""
    p = os.path.abspath(path)
    mine, parent = mount_id(p), mount_id(os.path.dirname(p))
    return mine is not None and parent is not None and mine != parent


class _Statfs(ctypes.Structure):
    _fields_ = [("f_type", ctypes.c_long), ("f_bsize", ctypes.c_long), ("f_blocks", ctypes.c_ulong),
                ("f_bfree", ctypes.c_ulong), ("f_bavail", ctypes.c_ulong), ("f_files", ctypes.c_ulong),
                ("f_ffree", ctypes.c_ulong), ("f_fsid", ctypes.c_int * 2), ("f_namelen", ctypes.c_long),
                ("f_frsize", ctypes.c_long), ("f_flags", ctypes.c_long), ("f_spare", ctypes.c_long * 4)]


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.statfs.argtypes = [ctypes.c_char_p, ctypes.POINTER(_Statfs)]


def fs_type(path: str | os.PathLike[str]) -> int | None:
    """statfs(2) f_type of the filesystem holding `path` (compare with *_MAGIC); None if unreadable."""
    buf = _Statfs()
    if _libc.statfs(os.fsencode(path), ctypes.byref(buf)) != 0:
        return None
    return int(buf.f_type) & 0xFFFFFFFF


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
