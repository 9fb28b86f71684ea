"""Mounting and unmounting: mount(2) and umount2(2), the new mount API (open_tree, mount_setattr:
idmapped mounts), a dead FUSE mount's clean-up, and loop-mounted filesystem images.

File-backed EROFS must be mounted with mount(2) directly: util-linux's `mount` silently attaches
a loop device instead (and reuses an existing loop for the same file, ignoring new options).
"""

from __future__ import annotations

import ctypes
import errno
import os

from layerstore.errors import LayerstoreError, PermissionDenied

from . import mounttable
from .libc import libc

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_BIND = 4096
MS_PRIVATE = 1 << 18
MNT_DETACH = 2
UMOUNT_NOFOLLOW = 8

libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


class MountError(LayerstoreError):
    """mount(2) or umount2(2) failed."""


# -- mount(2), umount2(2) ---------------------------------------------------------------------------
def mount(source: str | os.PathLike[str], target: str | os.PathLike[str], fstype: str,
          flags: int = 0, options: str = "") -> None:
    rc = libc.mount(os.fsencode(source), os.fsencode(target), fstype.encode(), flags, options.encode() or None)
    if rc != 0:
        err = ctypes.get_errno()
        cls = PermissionDenied if err in (errno.EPERM, errno.EACCES) else MountError
        raise cls(f"mount {fstype} {os.fsdecode(source)} on {os.fsdecode(target)}"
                  f"{' -o ' + options if options else ''}: {os.strerror(err)}")


def mount_erofs(image: str | os.PathLike[str], target: str | os.PathLike[str], options: str = "") -> None:
    """Mount an EROFS image file file-backed (no loop device), read-only."""
    mount(image, target, "erofs", MS_RDONLY | MS_NODEV, options)


def umount2(target: str | os.PathLike[str], flags: int = 0) -> int:
    """umount2(2) without following a symlink at `target`; 0 or the errno."""
    if libc.umount2(os.fsencode(target), flags | UMOUNT_NOFOLLOW) == 0:
        return 0
    return ctypes.get_errno()


def umount(target: str | os.PathLike[str], *, lazy: bool = False) -> None:
    err = umount2(target, MNT_DETACH if lazy else 0)
    if err:
        raise MountError(f"umount {os.fsdecode(target)}: {os.strerror(err)}")


UNMOUNTED = "unmounted"
DETACHED_LAZILY = "detached lazily"


def detach_how(path: str | os.PathLike[str]) -> str | None:
    """Unmount `path`, lazily if it is busy or dead. None if nothing was mounted there, else
    UNMOUNTED, or DETACHED_LAZILY: the mount is gone from the tree but a process (or a mount
    stacked on it, detached lazily itself) may still read through it, so what backs it must stay.

    O(1): asks the kernel directly instead of looking `path` up in mountinfo first. EINVAL = not
    a mount point. Symlinks are not followed (a target is a directory the shim made or was given)."""
    for flags, how in ((0, UNMOUNTED), (MNT_DETACH, DETACHED_LAZILY)):  # busy: a process inside, a dead FUSE
        err = umount2(path, flags)
        if err == 0:
            return how
        if err in (errno.EINVAL, errno.ENOENT, errno.ENOTDIR):
            return None
    raise MountError(f"umount {os.fsdecode(path)}: {os.strerror(err)}")


def detach(path: str | os.PathLike[str]) -> bool:
    """`detach_how`: True if something was mounted there."""
    return detach_how(path) is not None


def bind_private(path: str | os.PathLike[str]) -> None:
    """Make `path` a private bind mount of itself (its own mount, whose children do not
    propagate to the parent's peers)."""
    mount(path, path, "", MS_BIND)
    mount("none", path, "", MS_PRIVATE)


# -- FUSE mounts ----------------------------------------------------------------------------------
def is_dead(path: str | os.PathLike[str]) -> bool:
    """True when `path` is a FUSE mount whose daemon is gone (every access fails with ENOTCONN)."""
    try:
        os.stat(path)
    except OSError as e:
        return e.errno == errno.ENOTCONN
    return False


def clear_dead_fuse(mountpoint: str | os.PathLike[str]) -> bool:
    """A FUSE daemon killed with -9 leaves its mount behind, answering ENOTCONN: detach it.
    True if there was one; False if nothing is mounted there. A live mount is left alone and
    raises `MountError`."""
    if mounttable.find_mount(mountpoint) is None:
        return False
    try:
        os.statvfs(mountpoint)  # always reaches the filesystem (stat may be answered from cache)
    except OSError as e:
        if e.errno == errno.ENOTCONN:
            umount(mountpoint, lazy=True)
            return True
        raise
    raise MountError(f"{os.fsdecode(mountpoint)} is already a mount point")


# -- idmapped mounts (Linux 5.12+; open_tree/move_mount 5.2+) ---------------------------------------
SYS_OPEN_TREE = 428  # x86_64 and the generic syscall table alike
SYS_MOUNT_SETATTR = 442
OPEN_TREE_CLONE = 1
OPEN_TREE_CLOEXEC = os.O_CLOEXEC
AT_EMPTY_PATH = 0x1000
MOUNT_ATTR_IDMAP = 0x00100000


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                ("userns_fd", ctypes.c_uint64)]


def open_tree_clone(path: str | os.PathLike[str]) -> int:
    """A detached clone of the mount at `path` (open_tree(OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC)):
    an fd that holds the clone; closing it unmounts the clone unless something holds it (an
    overlay that stacks it, or `move_mount`)."""
    fd = libc.syscall(SYS_OPEN_TREE, ctypes.c_long(-100), ctypes.c_char_p(os.fsencode(path)),
                      ctypes.c_uint(OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC))
    if fd < 0:
        err = ctypes.get_errno()
        raise MountError(f"open_tree {os.fsdecode(path)}: {os.strerror(err)}")
    return int(fd)


def idmap_mount(mount_fd: int, userns_fd: int) -> None:
    """mount_setattr(MOUNT_ATTR_IDMAP) on a detached mount: its files' owners are shown through
    the user namespace's mapping (on-disk id k appears as the id k maps to)."""
    attr = _MountAttr(MOUNT_ATTR_IDMAP, 0, 0, userns_fd)
    rc = libc.syscall(SYS_MOUNT_SETATTR, ctypes.c_long(mount_fd), ctypes.c_char_p(b""),
                      ctypes.c_uint(AT_EMPTY_PATH), ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)))
    if rc != 0:
        err = ctypes.get_errno()
        raise MountError(f"mount_setattr(MOUNT_ATTR_IDMAP): {os.strerror(err)}")


# -- loop-mounted filesystem images (a kept sandbox's upper with a quota) ----------------------------
def _tool(name: str) -> str:
    """A system tool's path; the sbin directories too (mount(8) runs its helpers with a short PATH)."""
    import shutil

    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/bin", "/bin"])
    return shutil.which(name, path=path) or name


def make_ext4_image(image: str | os.PathLike[str], size: int, *, journal_mib: int = 4, create: bool = True) -> None:
    """Create `image` (exclusively, 0600; or use the existing regular file, `create=False`) as a
    sparse file of `size` bytes holding an empty ext4 filesystem: no reserved blocks, a small
    journal (`journal_mib`, 0: none). Raises MountError."""
    import subprocess

    flags = os.O_CREAT | os.O_EXCL if create else os.O_NOFOLLOW
    fd = os.open(image, flags | os.O_WRONLY | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)
    journal = ["-J", f"size={journal_mib}"] if journal_mib else ["-O", "^has_journal"]
    try:
        res = subprocess.run([_tool("mkfs.ext4"), "-q", "-F", "-m", "0", *journal, os.fspath(image)],
                             stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise MountError("mkfs.ext4 is not installed (e2fsprogs)") from None
    if res.returncode != 0:
        raise MountError(f"mkfs.ext4 {os.fsdecode(image)}: {res.stderr.strip() or res.returncode}")


def mount_image(image: str | os.PathLike[str], target: str | os.PathLike[str], fstype: str = "ext4",
                options: str = "nosuid,nodev") -> None:
    """Mount the filesystem image `image` on `target` through a loop device (util-linux mount(8):
    the loop device it sets up is autocleared, freed when the filesystem is unmounted). No utab
    entry (-n). Raises MountError."""
    import subprocess

    try:
        argv = [_tool("mount"), "-n", "-t", fstype, "-o", f"loop,{options}", os.fspath(image), os.fspath(target)]
        res = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise MountError("mount(8) is not installed (util-linux)") from None
    if res.returncode != 0:
        raise MountError(f"mount {os.fsdecode(image)} on {os.fsdecode(target)}: {res.stderr.strip() or res.returncode}")


def loop_devices_of(image: str | os.PathLike[str]) -> list[str]:
    """The loop devices backed by `image` (read from /sys/block/loop*/loop/backing_file; a deleted
    backing file reads "<path> (deleted)")."""
    want = os.path.abspath(image)
    out = []
    try:
        names = os.listdir("/sys/block")
    except FileNotFoundError:
        return out
    for name in names:
        if not name.startswith("loop"):
            continue
        try:
            with open(f"/sys/block/{name}/loop/backing_file") as f:
                backing = f.read().strip()
        except OSError:
            continue
        if backing.removesuffix(" (deleted)") == want:
            out.append(f"/dev/{name}")
    return sorted(out)
