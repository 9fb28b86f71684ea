"""The builder's tree model (pure): one `Entry` per path, as every input (directory, tar, OCI
layer) describes it, independent of how EROFS lays it out.

Inputs produce entries in a deterministic order and hand each regular file's content as an
iterable of byte strings that is consumed exactly once, when the entry is added to the writer.
That lets a tar stream be built without extracting it to disk.
"""

from __future__ import annotations

import enum
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field

from layerstore.errors import BadInput

NAME_MAX = 255


class Kind(enum.Enum):
    DIR = stat.S_IFDIR
    REG = stat.S_IFREG
    SYMLINK = stat.S_IFLNK
    CHR = stat.S_IFCHR
    BLK = stat.S_IFBLK
    FIFO = stat.S_IFIFO
    SOCK = stat.S_IFSOCK


@dataclass
class Entry:
    """One path of a layer.

    `path` is relative, '/'-separated bytes without a leading '/', b"" for the root. `mode` holds
    permission bits only (including setuid, setgid, sticky); the type is `kind`. A hard link is
    an entry whose `hardlink` names an earlier entry's path; its own metadata fields are ignored.
    An overlayfs whiteout is a CHR entry with rdev (0, 0); an opaque directory carries the xattr
    b"trusted.overlay.opaque" = b"y".
    """

    path: bytes
    kind: Kind
    mode: int = 0o644
    uid: int = 0
    gid: int = 0
    mtime: int = 0
    mtime_nsec: int = 0
    size: int = 0  # REG: content length (apparent size for sparse files)
    symlink: bytes | None = None  # SYMLINK: target
    rdev: tuple[int, int] = (0, 0)  # CHR/BLK: (major, minor)
    xattrs: dict[bytes, bytes] = field(default_factory=dict)
    hardlink: bytes | None = None  # path of the entry this one links to

    @property
    def name(self) -> bytes:
        return self.path.rpartition(b"/")[2]

    @property
    def parent(self) -> bytes:
        return self.path.rpartition(b"/")[0]


# Content of a regular file, consumed once when the entry is added. `None` for non-files.
# A data source may yield `Hole(n)` for n bytes of zeros that need no storage (sparse files).
@dataclass(frozen=True)
class Hole:
    length: int


Data = Iterable["bytes | memoryview | Hole"]


def check_path(path: bytes) -> bytes:
    """Validate a normalised layer path; raises `BadInput` naming it."""
    if path == b"":
        return path
    if b"\0" in path:
        raise BadInput(f"{path!r}: name contains NUL")
    if path.startswith(b"/") or path.endswith(b"/"):
        raise BadInput(f"{path!r}: not a normalised relative path")
    if len(path) <= NAME_MAX and b"//" not in path:  # the common case, without splitting
        wrapped = b"/" + path + b"/"
        if b"/./" not in wrapped and b"/../" not in wrapped:
            return path
    for comp in path.split(b"/"):
        if comp in (b"", b".", b".."):
            raise BadInput(f"{path!r}: empty, '.' or '..' component")
        if len(comp) > NAME_MAX:
            raise BadInput(f"{path[:80]!r}...: a name is longer than {NAME_MAX} bytes")
    return path
