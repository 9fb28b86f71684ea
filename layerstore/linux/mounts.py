"""The node's one binding to Linux: libc through ctypes, mount(2) and umount2(2), the mount
table (/proc/self/mountinfo: parse, escape, unescape, "is this a mount point"), the clean-up of
a dead FUSE mount, statfs(2), and the sparse-file calls of the node cache (hole punching,
SEEK_DATA). Every other module calls these; none binds libc itself.

File-backed EROFS must be mounted with mount(2) directly: util-linux's `mount` silently attaches
a loop device instead (and reuses an existing loop for the same file, ignoring new options).

Two costs of asking what is mounted:
* the whole picture (`read_mounts`): one parse of /proc/self/mountinfo, O(mounts). With 10,000
  sandboxes the file is several MB (every overlay line carries its lowerdir/upperdir/workdir),
  so nothing on the path of a single mount may read it;
* one path (`is_mount`, `is_mount_root`, `fs_type`, `mount_id`, `detach`): O(1) syscalls on
  that path only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from layerstore.errors import BadInput, LayerstoreError, NotFound, PermissionDenied

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_BIND = 4096
MS_PRIVATE = 1 << 18
MNT_DETACH = 2
UMOUNT_NOFOLLOW = 8
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02

# statfs(2) f_type values (linux/magic.h)
OVERLAYFS_MAGIC = 0x794C7630
EROFS_MAGIC = 0xE0F5E1E2
FUSE_MAGIC = 0x65735546

MOUNTINFO = "/proc/self/mountinfo"


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted",
                                               "nr_recently_evicted")]


class _Statfs(ctypes.Structure):
    _fields_ = [("f_type", ctypes.c_long), ("f_bsize", ctypes.c_long), ("f_blocks", ctypes.c_ulong),
                ("f_bfree", ctypes.c_ulong), ("f_bavail", ctypes.c_ulong), ("f_files", ctypes.c_ulong),
                ("f_ffree", ctypes.c_ulong), ("f_fsid", ctypes.c_int * 2), ("f_namelen", ctypes.c_long),
                ("f_frsize", ctypes.c_long), ("f_flags", ctypes.c_long), ("f_spare", ctypes.c_long * 4)]


libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
libc.fallocate.restype = ctypes.c_int
libc.statfs.argtypes = [ctypes.c_char_p, ctypes.POINTER(_Statfs)]
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
libc.syncfs.argtypes = [ctypes.c_int]
libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
libc.syscall.restype = ctypes.c_long
MAP_FAILED = ctypes.c_void_p(-1).value
SYS_CACHESTAT = 451  # x86_64 and most others (Linux 6.5+)
PAGE = mmap.PAGESIZE


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


# -- the mount table ------------------------------------------------------------------------------
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


def proc_start_time(pid: int) -> int | None:
    """The start time (clock ticks since boot, /proc/PID/stat field 22) of a live, non-zombie
    process, else None: with the pid, it names one process even after the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat_line = f.read()
    except OSError:
        return None
    # the command name may hold spaces and parentheses: fields resume after the last ')'
    rest = stat_line[stat_line.rindex(b")") + 2 :].split()
    if rest[0] in (b"Z", b"X"):
        return None
    return int(rest[19])


def fs_type(path: str | os.PathLike[str]) -> int | None:
    """statfs(2) f_type of the filesystem holding `path` (compare with *_MAGIC); None if unreadable."""
    buf = _Statfs()
    if libc.statfs(os.fsencode(path), ctypes.byref(buf)) != 0:
        return None
    return int(buf.f_type) & 0xFFFFFFFF


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
    if find_mount(mountpoint) is None:
        return False
    try:
        os.statvfs(mountpoint)  # always reaches the filesystem (stat may be answered from cache)
    except OSError as e:
        if e.errno == errno.ENOTCONN:
            umount(mountpoint, lazy=True)
            return True
        raise
    raise MountError(f"{os.fsdecode(mountpoint)} is already a mount point")


def bdi_read_ahead_kb(mountpoint: str | os.PathLike[str]) -> str | None:
    """The sysfs file of a mount's readahead (its backing device info), found through mountinfo,
    so no request reaches the filesystem (a FUSE mount not yet serving would hang a stat)."""
    m = find_mount(mountpoint)
    return f"/sys/class/bdi/{m.device}/read_ahead_kb" if m is not None and m.device else None


# -- sparse files ---------------------------------------------------------------------------------
def punch_hole(fd: int, offset: int, length: int) -> None:
    """Deallocate [offset, offset+length) of a file, keeping its size; the range reads as zeros.
    OSError on failure."""
    if length <= 0:
        return
    if libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"punching a hole at {offset}+{length}: {os.strerror(err)}")


def data_extents(fd: int, size: int) -> Iterator[tuple[int, int]]:
    """(start, end) of the allocated regions of a sparse file, via SEEK_DATA/SEEK_HOLE."""
    pos = 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as e:
            if e.errno == errno.ENXIO:  # no data after pos
                return
            raise
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        if end <= start:
            return
        yield start, end
        pos = end


SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int) -> None:
    """sync_file_range(2) with SYNC_FILE_RANGE_WRITE over the whole file: start writing its dirty
    pages back without waiting (and, on ext4 with delayed allocation, allocate their blocks now).
    It makes nothing durable by itself. OSError on failure."""
    if libc.sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"sync_file_range: {os.strerror(err)}")


def syncfs(path: str | os.PathLike[str]) -> None:
    """syncfs(2): write back the whole filesystem holding `path`."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if libc.syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"syncfs {os.fsdecode(path)}: {os.strerror(err)}")
    finally:
        os.close(fd)


# -- the page cache (benchmarks measure with these) -----------------------------------------------
def resident_pages(path: str | os.PathLike[str]) -> bytes:
    """mincore(2) of a whole file: one byte per page, bit 0 set when the page is in the page cache."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return b""
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr == MAP_FAILED or addr is None:
            raise OSError(ctypes.get_errno(), f"mmap {os.fsdecode(path)}")
        try:
            vec = ctypes.create_string_buffer((size + PAGE - 1) // PAGE)
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore {os.fsdecode(path)}")
            return vec.raw
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def cached_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes of `path` in the page cache (cachestat(2)); 0 if it cannot be asked."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return 0
    try:
        rng, st = _CachestatRange(0, 0), _Cachestat()
        if libc.syscall(SYS_CACHESTAT, fd, ctypes.byref(rng), ctypes.byref(st), 0) != 0:
            return 0
        return int(st.nr_cache) * PAGE
    finally:
        os.close(fd)


# -- files a sandbox controls ---------------------------------------------------------------------
# A sandbox can swap any path in its tree for a symlink, a FIFO or a device node at any moment; the
# host must never follow, block on or open what it planted. openat2(2) resolves a whole path in the
# kernel under rules (no symlink in any component, never above the starting directory, never across
# a mount), so nothing can be swapped between a check and the open. A file is first opened O_PATH
# (no open(2) reaches a device driver, no FIFO blocks), checked with fstat, and only a regular file
# is then reopened for reading through its descriptor (/proc/self/fd: the very inode checked).
SYS_OPENAT2 = 437  # x86_64 and the generic syscall table alike (Linux 5.6+)
RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE_STRICT = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV
SAFE_OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def openat2(dirfd: int, path: str | bytes, flags: int, mode: int = 0, resolve: int = 0) -> int:
    """openat2(2); the new descriptor, or OSError (ELOOP: a symlink on the way with
    RESOLVE_NO_SYMLINKS; EXDEV: the path leaves `dirfd` or crosses a mount)."""
    how = _OpenHow(flags, mode, resolve)
    fd = libc.syscall(SYS_OPENAT2, ctypes.c_long(dirfd), ctypes.c_char_p(os.fsencode(path)), ctypes.byref(how),
                      ctypes.c_size_t(ctypes.sizeof(how)))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), os.fsdecode(path))
    return int(fd)


def open_beneath(dirfd: int, relpath: str | bytes, flags: int = os.O_RDONLY, *,
                 resolve: int = RESOLVE_STRICT) -> int:
    """Open `relpath` below the directory `dirfd` without following a symlink in any component
    (a trailing one too: O_NOFOLLOW; with O_PATH the symlink itself is opened), never leaving
    `dirfd` and (by default) never crossing a mount; O_NONBLOCK, O_CLOEXEC and O_NOCTTY are
    added, so a FIFO does not block the open (with O_PATH only O_NOFOLLOW and O_CLOEXEC:
    openat2 refuses the others there). OSError as `openat2`."""
    extra = os.O_NOFOLLOW | os.O_CLOEXEC if flags & os.O_PATH else SAFE_OPEN_FLAGS
    return openat2(dirfd, relpath, flags | extra, 0, resolve)


_KIND_NAMES = {stat.S_IFDIR: "directory", stat.S_IFLNK: "symlink", stat.S_IFIFO: "FIFO", stat.S_IFSOCK: "socket",
               stat.S_IFCHR: "character device", stat.S_IFBLK: "block device"}


def _path_beneath(dirfd: int, relpath: str | bytes) -> int:
    """An O_PATH descriptor of `relpath` below `dirfd` (resolved as `open_beneath`: nothing is
    opened, no FIFO blocks, no driver is reached); `BadInput` for a symlink on the path or a path
    leaving `dirfd`, `NotFound` if absent."""
    name = os.fsdecode(relpath)
    try:
        return open_beneath(dirfd, relpath, os.O_PATH)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise BadInput(f"{name}: a symlink on the path (refused, not followed)") from None
        if e.errno == errno.EXDEV:
            raise BadInput(f"{name}: leaves its directory or crosses a mount (refused)") from None
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            raise NotFound(f"{name}: no such file") from None
        raise


def _regular(name: str, st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        kind = _KIND_NAMES.get(stat.S_IFMT(st.st_mode), "special file")
        raise BadInput(f"{name}: a {kind} where a regular file was expected (refused, not opened)")


def open_regular_beneath(dirfd: int, relpath: str | bytes, *, expect: tuple[int, int] | None = None) -> int:
    """A read-only descriptor (O_NONBLOCK, O_CLOEXEC) of the regular file `relpath` below
    `dirfd`, resolved as `open_beneath`; with `expect`, only if it is that (st_dev, st_ino) (the
    inode a walk's lstat saw). Refusals, never opening anything but the regular file checked:
    `BadInput` for a symlink anywhere on the path, a path leaving `dirfd`, any other type of
    file (FIFO, device, socket, directory) or another inode than `expect`; `NotFound` if absent."""
    name = os.fsdecode(relpath)
    pfd = _path_beneath(dirfd, relpath)
    try:
        st = os.fstat(pfd)
        _regular(name, st)
        if expect is not None and (st.st_dev, st.st_ino) != expect:
            raise BadInput(f"{name}: changed while it was read (another file is at its path now)")
        fd = os.open(f"/proc/self/fd/{pfd}", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    finally:
        os.close(pfd)
    return fd


def entry_path(dirfd: int, name: bytes) -> bytes:
    """A path naming the entry `name` of the open directory `dirfd` whatever happens to the
    directory's own path meanwhile (through its descriptor: /proc/self/fd); for the calls that
    take no directory descriptor (llistxattr, lgetxattr). `name` is one component."""
    if b"/" in name or name in (b"", b".", b".."):
        raise BadInput(f"{os.fsdecode(name)!r}: not one path component")
    return b"/proc/self/fd/%d/%s" % (dirfd, name)


def regular_size_beneath(root: str | os.PathLike[str], relpath: str | bytes, max_size: int) -> int | None:
    """The size of `relpath` below the directory `root` if it is a regular file of at most
    `max_size` bytes, None if it is absent; `BadInput` (naming it) for anything else: a symlink
    on the path, a path leaving `root` or crossing a mount, a FIFO, device, socket or directory,
    a larger file. Nothing is opened but O_PATH (a FIFO cannot block, a device is never reached):
    the check for a file that another program (a container runtime) will open later."""
    rel = os.fsencode(relpath).lstrip(b"/") or b"."
    name = os.fsdecode(rel)
    rootfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            pfd = _path_beneath(rootfd, rel)
        except NotFound:
            return None
    finally:
        os.close(rootfd)
    try:
        st = os.fstat(pfd)
    finally:
        os.close(pfd)
    _regular(name, st)
    if st.st_size > max_size:
        raise BadInput(f"{name}: larger than {max_size} bytes (refused)")
    return st.st_size


def read_regular_beneath(root: str | os.PathLike[str] | int, relpath: str | bytes, max_size: int) -> bytes:
    """The content of the regular file `relpath` (a leading "/" is taken as relative) below
    `root` (a directory path the caller trusts, or an open directory descriptor), opened as
    `open_regular_beneath`: never through a symlink, never a FIFO or device. More than
    `max_size` bytes is `BadInput`; an absent file is `NotFound`."""
    rel = os.fsencode(relpath).lstrip(b"/") or b"."
    rootfd = root if isinstance(root, int) else os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = open_regular_beneath(rootfd, rel)
    finally:
        if not isinstance(root, int):
            os.close(rootfd)
    try:
        chunks, got = [], 0
        while True:
            buf = os.read(fd, max_size + 1 - got)
            if not buf:
                break
            chunks.append(buf)
            got += len(buf)
            if got > max_size:
                raise BadInput(f"{os.fsdecode(rel)}: larger than {max_size} bytes (refused)")
        return b"".join(chunks)
    finally:
        os.close(fd)


# -- the control socket's peers and the cache's filesystem ------------------------------------------
SO_PEERGROUPS = 59  # Linux 4.13+; not in Python's socket module


def peer_credentials(fd: int) -> tuple[int, int, int, tuple[int, ...]]:
    """(pid, uid, gid, supplementary gids) of the process at the other end of a connected Unix
    socket, as the kernel recorded them at connect time (SO_PEERCRED, SO_PEERGROUPS)."""
    import socket
    import struct

    s = socket.socket(fileno=os.dup(fd))
    try:
        pid, uid, gid = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        raw = s.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 1024)  # Python's largest buffer: 256 groups
    except OSError as e:
        if e.errno != errno.ERANGE:
            raise
        raw = b""  # more groups than that: ask /proc (the peer's groups now, not at connect time)
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    raw = struct.pack(f"{len(line.split()) - 1}I", *map(int, line.split()[1:]))
    finally:
        s.close()
    return pid, uid, gid, struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4])


def fs_size(path: str | os.PathLike[str]) -> int:
    """Total bytes of the filesystem holding `path` (statvfs)."""
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize


# -- user namespaces and idmapped mounts (Linux 5.12+; open_tree/move_mount 5.2+) -------------------
SYS_OPEN_TREE = 428  # x86_64 and the generic syscall table alike
SYS_MOUNT_SETATTR = 442
OPEN_TREE_CLONE = 1
OPEN_TREE_CLOEXEC = os.O_CLOEXEC
AT_EMPTY_PATH = 0x1000
MOUNT_ATTR_IDMAP = 0x00100000
CLONE_NEWUSER = 0x10000000
libc.unshare.argtypes = [ctypes.c_int]


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


def user_namespace(uid_base: int, gid_base: int, count: int) -> int:
    """An fd of a new user namespace in which ids 0..count-1 are the host's uid_base.. and
    gid_base..: a short-lived child unshares CLONE_NEWUSER, this process writes its uid_map and
    gid_map, opens /proc/PID/ns/user and lets it exit (the fd keeps the namespace)."""
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only raw syscalls, then _exit
        code = 1
        try:
            os.close(ready_r)
            os.close(go_w)
            ok = libc.unshare(CLONE_NEWUSER) == 0
            os.write(ready_w, b"y" if ok else b"n")
            os.read(go_r, 1)
            code = 0
        finally:
            os._exit(code)
    os.close(ready_w)
    os.close(go_r)
    try:
        answer = os.read(ready_r, 1)
        if answer != b"y":
            raise PermissionDenied("unshare(CLONE_NEWUSER) failed in the helper process")
        with open(f"/proc/{pid}/uid_map", "w") as f:
            f.write(f"0 {uid_base} {count}\n")
        with open(f"/proc/{pid}/gid_map", "w") as f:
            f.write(f"0 {gid_base} {count}\n")
        return os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(ready_r)
        os.close(go_w)  # the child reads EOF and exits
        os.waitpid(pid, 0)


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
