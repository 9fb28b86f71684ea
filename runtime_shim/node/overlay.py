"""overlayfs composition: a sandbox's root = its private upper over the shared read-only layers.

redirect_dir, metacopy and index are pinned off: then an upper holds only whole copied-up files,
whiteouts (chr 0/0) and opaque directories (trusted.overlay.opaque=y), which is exactly what a
commit can turn into a layer; renaming a lower directory copies it up instead of redirecting.

Every mount a sandbox can reach is `nosuid,nodev` unless the caller relaxes it: a setuid binary
or a device node in a layer or written to the upper gives nothing. An upper with a quota lives on
a filesystem of its own: a tmpfs (`mount_scratch`) for a sandbox that is not kept, a sparse ext4
image loop-mounted (`make_upper_image`, `mount_upper_image`) for one that is kept (it survives a
reboot). A sandbox that fills it gets ENOSPC, the node disk and the other sandboxes do not notice.
"""

from __future__ import annotations

import errno
import functools
import os
import stat
from collections.abc import Sequence
from pathlib import Path

from layerstore import linux

from ..errors import NodeFull, ShimError
from ..nodestate.paths import check_overlay_safe

# overlayfs refuses more lower layers than this (OVL_MAX_STACK)
MAX_LOWERS = 500
MIN_IMAGE = 32 << 20  # the smallest upper image (its journal takes 4 MiB)


def options(lowers_top_first: Sequence[str], upper: str, work: str) -> str:
    """The mount options for one sandbox (pure). `lowers_top_first`: the workspace first, base last."""
    for p in (upper, work):
        check_overlay_safe(p, "overlay path")
    return (f"{_lowerdir(tuple(lowers_top_first))},upperdir={upper},workdir={work},"
            "redirect_dir=off,metacopy=off,index=off")


@functools.lru_cache(maxsize=256)
def _lowerdir(lowers_top_first: tuple[str, ...]) -> str:
    """The lowerdir option, checked (an environment's layers are stacked by many sandboxes)."""
    if not lowers_top_first:
        raise ShimError("an overlay needs at least one lower layer")
    if len(lowers_top_first) > MAX_LOWERS:
        raise ShimError(f"{len(lowers_top_first)} layers: overlayfs stacks at most {MAX_LOWERS}")
    for p in lowers_top_first:
        check_overlay_safe(p, "overlay path")
    return f"lowerdir={':'.join(lowers_top_first)}"


def mount_flags(*, nosuid: bool = True, nodev: bool = True) -> int:
    return (linux.MS_NOSUID if nosuid else 0) | (linux.MS_NODEV if nodev else 0)


SAFE = mount_flags()  # the default: nosuid, nodev


def mount_overlay(target: str, lowers_top_first: Sequence[str], upper: str, work: str, flags: int = SAFE) -> None:
    opts = options(lowers_top_first, upper, work)
    if len(opts) >= 4096:
        raise ShimError(f"overlay options for {target} are {len(opts)} bytes; the kernel takes one page")
    try:
        linux.mount("overlay", target, "overlay", flags, opts)
    except linux.MountError as e:
        raise ShimError(explain(e)) from None


def mount_scratch(path: str | os.PathLike[str], size: int) -> None:
    """A private tmpfs of `size` bytes at `path` for a sandbox's upper and work directories (0700,
    nosuid, nodev). Its pages are charged to the memory cgroup of whoever writes them: the
    sandbox's, for what the sandbox writes."""
    try:
        linux.mount("tmpfs", path, "tmpfs", SAFE, f"size={size},mode=0700")
    except linux.MountError as e:
        raise ShimError(explain(e)) from None


def check_image_size(size: int) -> None:
    if size < MIN_IMAGE:
        raise ShimError(f"upper size {size}: a kept sandbox's upper takes at least {MIN_IMAGE >> 20} MiB")


def image_growth(size: int, blocks: int) -> int:
    """What a sparse image of `size` bytes with `blocks` 512-byte blocks allocated may still take
    of its disk (pure)."""
    return max(0, size - blocks * 512)


def check_room(size: int, others: int, free: int, where: str) -> None:
    """Refuse a kept upper of `size` bytes when it and what the other kept uppers may still take
    (`others`) exceed the node disk's `free` bytes (pure): once they all filled up, writes on the
    node disk (every sandbox's, the cache's, the state's) would fail with ENOSPC."""
    if size + others > free:
        raise NodeFull(f"upper size {size >> 20} MiB: the node disk ({where}) has {free >> 20} MiB free, and the other "
                       f"kept uppers may still take {others >> 20} MiB of it; ask for at most "
                       f"{max(0, free - others) >> 20} MiB, or remove kept sandboxes")


def kept_uppers_growth(sandboxes: str | os.PathLike[str], image_name: str, absent: str = "") -> int:
    """What the kept uppers' images (SANDBOXES/<id>/`image_name`, except sandbox `absent`'s) may
    still take of the node disk: each one's size less the blocks it has already."""
    total = 0
    try:
        entries = os.listdir(sandboxes)
    except FileNotFoundError:
        return 0
    for name in entries:
        if name == absent:
            continue
        try:
            st = os.stat(os.path.join(sandboxes, name, image_name), follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            total += image_growth(st.st_size, st.st_blocks)
    return total


def reserve_upper_image(image: Path, size: int) -> None:
    """Create a kept upper's image file (exclusively, 0600, sparse: `size` bytes, no blocks), after
    checking the node disk can hold it (`check_room`, `NodeFull`). Caller holds the node lock: the
    file is what the next check counts, so two mounts cannot both take the same free space."""
    check_image_size(size)
    sandboxes = image.parent.parent
    others = kept_uppers_growth(sandboxes, image.name, absent=image.parent.name)
    st = os.statvfs(image.parent)
    check_room(size, others, st.f_bavail * st.f_frsize, str(sandboxes))
    fd = os.open(image, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)


def make_upper_image(image: str | os.PathLike[str], size: int, *, reserved: bool = False) -> None:
    """A sparse file of `size` bytes (created exclusively, 0600; or the one `reserve_upper_image`
    made, `reserved`) holding an empty ext4 filesystem
    with a 4 MiB journal: a machine crash leaves it consistent (the journal is replayed when
    recovery mounts it), as the node disk's own upper would be. Costs 4 MiB of disk at creation
    (the journal); the rest is allocated as the sandbox writes."""
    check_image_size(size)
    try:
        linux.make_ext4_image(image, size, create=not reserved)
    except linux.MountError as e:
        raise ShimError(str(e)) from None


def mount_upper_image(image: str | os.PathLike[str], path: str | os.PathLike[str]) -> bool:
    """Mount a sandbox's upper image at `path` (nosuid, nodev, through an autocleared loop device)
    unless something is mounted there already; its root is made 0700. True if mounted here."""
    if linux.is_mount_root(path):
        return False
    try:
        linux.mount_image(image, path, "ext4", "nosuid,nodev,noatime")
    except linux.MountError as e:
        raise ShimError(explain(e)) from None
    os.chmod(path, 0o700)
    return True


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
