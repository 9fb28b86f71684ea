"""What runs as PID 1 of a container: a minimal init (tini), so that a workload's signals and exit
codes are what they are in a microVM or VM, whose guest init runs the workload as a child.

Without one, the workload is PID 1 of its pid namespace, and the kernel drops every signal PID 1
has no handler for: `sh -c 'kill -TERM $$'` exits 0 in a container and 143 in a VM, and a SIGTERM
passed on by `layerctl run` never ends a `sleep`. With tini as PID 1 the workload is its child: it
gets the signals sent to the container (tini passes on every one but SIGCHLD, to the workload's
process only, as the guest init does: no `-g`), its exit code is the container's (death by signal
N: 128+N), and orphans are reaped. No `-s` (tini is PID 1, it needs no subreaper), no `-e`.

Where it comes from: $LAYERSTORE_CONTAINER_INIT (an absolute path), else `tini-static` on PATH
(Debian's tini package). It must be a static program: the container's root may have no libc.

How it gets in: bound read-only (nosuid, nodev) at `/dev/init`. The runtime mounts a fresh tmpfs
on the container's /dev first and creates the bind's target inside it, so an image cannot shadow
or replace it (whatever the image has at /dev is under that tmpfs; a /dev symlink is resolved
within the root and lands on the same tmpfs). The host file cannot be changed from inside: the
bind is read-only, the container has no CAP_SYS_ADMIN to remount it, and a running program's file
is busy (ETXTBSY).
"""

from __future__ import annotations

import os
import shutil
import stat
import struct
from typing import Any

from ..errors import RuntimeNotAvailable

INIT_ENV = "LAYERSTORE_CONTAINER_INIT"
INIT_NAME = "tini-static"  # Debian's tini package
IN_CONTAINER = "/dev/init"
PT_INTERP = 3
HOW = f"install tini (the Debian package ships {INIT_NAME}) or set {INIT_ENV} to a static tini"


def find_init() -> str:
    """The host path of the init to bind into containers (`RuntimeNotAvailable` if there is none
    or it is unusable; saying what to do)."""
    raw = os.environ.get(INIT_ENV, "").strip()
    if raw:
        if not os.path.isabs(raw):
            raise RuntimeNotAvailable(f"{INIT_ENV}={raw!r}: want an absolute path to a static tini")
        path, named = raw, f"{INIT_ENV}={raw}"
    else:
        found = shutil.which(INIT_NAME)
        if found is None:
            raise RuntimeNotAvailable(f"containers run a minimal init as PID 1 and {INIT_NAME} is not on PATH: {HOW}")
        path, named = found, found
    path = os.path.realpath(path)
    try:
        st = os.stat(path)
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError as e:
        raise RuntimeNotAvailable(f"{named}: {e.strerror}: {HOW}") from None
    if not stat.S_ISREG(st.st_mode) or not st.st_mode & 0o111:
        raise RuntimeNotAvailable(f"{named}: not an executable file: {HOW}")
    if needs_interpreter(head):
        raise RuntimeNotAvailable(f"{named}: dynamically linked (a container's root may lack its libraries): {HOW}")
    return path


def needs_interpreter(head: bytes) -> bool:
    """Does this 64-bit little-endian ELF (its first bytes) name a program interpreter (a
    dynamically linked program)? False for anything else (pure)."""
    if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
        return False
    phoff, = struct.unpack_from("<Q", head, 32)
    phentsize, phnum = struct.unpack_from("<HH", head, 54)
    for i in range(phnum):
        at = phoff + i * phentsize
        if at + 4 > len(head):
            break
        if struct.unpack_from("<I", head, at)[0] == PT_INTERP:
            return True
    return False


def init_args(args: list[str]) -> list[str]:
    """The container's process.args: the init, then the workload's argv (pure)."""
    return [IN_CONTAINER, "--", *args]


def init_mount(source: str) -> dict[str, Any]:
    """The OCI mount that binds the init at IN_CONTAINER; after the /dev tmpfs (pure)."""
    return {"destination": IN_CONTAINER, "type": "bind", "source": source,
            "options": ["bind", "ro", "nosuid", "nodev"]}
