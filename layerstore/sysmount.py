"""Thin wrappers over mount(2)/umount2(2) (Linux).

File-backed EROFS must be mounted with mount(2) directly: util-linux's `mount` silently attaches a
loop device instead (and reuses an existing loop for the same file, ignoring new options).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

from .errors import LayerstoreError, PermissionDenied

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MNT_DETACH = 2

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


class MountError(LayerstoreError):
    """mount(2) or umount2(2) failed."""


def _b(p: str | os.PathLike[str] | bytes) -> bytes:
    return os.fsencode(p)


def mount(source: str | os.PathLike[str], target: str | os.PathLike[str], fstype: str,
          flags: int = 0, options: str = "") -> None:
    rc = _libc.mount(_b(source), _b(target), fstype.encode(), flags, options.encode() or None)
    if rc != 0:
        err = ctypes.get_errno()
        cls = PermissionDenied if err in (1, 13) else MountError
        raise cls(f"mount {fstype} {os.fsdecode(source)} on {os.fsdecode(target)}"
                  f"{' -o ' + options if options else ''}: {os.strerror(err)}")


def mount_erofs(image: str | os.PathLike[str], target: str | os.PathLike[str], options: str = "") -> None:
    """Mount an EROFS image file file-backed (no loop device), read-only."""
    mount(image, target, "erofs", MS_RDONLY | MS_NODEV, options)


def umount(target: str | os.PathLike[str], *, lazy: bool = False) -> None:
    rc = _libc.umount2(_b(target), MNT_DETACH if lazy else 0)
    if rc != 0:
        err = ctypes.get_errno()
        raise MountError(f"umount {os.fsdecode(target)}: {os.strerror(err)}")


def is_mountpoint(path: str | os.PathLike[str]) -> bool:
    """True if `path` is listed as a mount point in this namespace (works on dead FUSE mounts,
    where stat() fails with ENOTCONN)."""
    want = os.path.abspath(os.fsdecode(path))
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields = line.split(" ")
            if _unescape(fields[4]) == want:
                return True
    return False


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as octal
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) + 0 and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)
