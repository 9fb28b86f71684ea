"""overlayfs composition: a sandbox's root = its private upper over the shared read-only layers.

redirect_dir, metacopy and index are pinned off: then an upper holds only whole copied-up files,
whiteouts (chr 0/0) and opaque directories (trusted.overlay.opaque=y), which is exactly what a
commit can turn into a layer; renaming a lower directory copies it up instead of redirecting.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence

from fuse_client import linux

from .errors import ShimError
from .paths import check_overlay_safe

# overlayfs refuses more lower layers than this (OVL_MAX_STACK)
MAX_LOWERS = 500


def options(lowers_top_first: Sequence[str], upper: str, work: str) -> str:
    """The mount options for one sandbox (pure). `lowers_top_first`: the workspace first, base last."""
    if not lowers_top_first:
        raise ShimError("an overlay needs at least one lower layer")
    if len(lowers_top_first) > MAX_LOWERS:
        raise ShimError(f"{len(lowers_top_first)} layers: overlayfs stacks at most {MAX_LOWERS}")
    for p in (*lowers_top_first, upper, work):
        check_overlay_safe(p, "overlay path")
    return (f"lowerdir={':'.join(lowers_top_first)},upperdir={upper},workdir={work},"
            "redirect_dir=off,metacopy=off,index=off")


def mount_overlay(target: str, lowers_top_first: Sequence[str], upper: str, work: str) -> None:
    opts = options(lowers_top_first, upper, work)
    if len(opts) >= 4096:
        raise ShimError(f"overlay options for {target} are {len(opts)} bytes; the kernel takes one page")
    try:
        linux.mount("overlay", target, "overlay", 0, opts)
    except linux.MountError as e:
        raise ShimError(explain(e)) from None


def explain(e: Exception) -> str:
    """A mount error, with the limit named when the kernel's mount table is full (ENOSPC: more
    mounts in this namespace than fs.mount-max; every sandbox costs one, every layer one)."""
    msg = str(e)
    if os.strerror(errno.ENOSPC) in msg:
        try:
            with open("/proc/sys/fs/mount-max") as f:
                limit = f.read().strip()
        except OSError:
            limit = "?"
        msg += f" (the mount table is full: fs.mount-max = {limit} mounts per namespace; raise it with sysctl)"
    return msg
