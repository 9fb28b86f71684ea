"""What is mounted in this mount namespace: one parse of /proc/self/mountinfo (parsing is pure).

Recovery compares this picture with the state; reading it once per recovery keeps that O(mounts)
instead of one read per sandbox.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable
from dataclasses import dataclass


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
