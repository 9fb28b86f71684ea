"""The project's one binding to Linux: libc through ctypes (loaded once, in `libc`), raw system
calls, /proc and /sys. The bottom of the import graph with the rest of `layerstore`: every package
that needs a Linux call (the node daemon, the shim, the service, the snapshotter, the builder)
imports it from here; none binds libc itself (tests/test_house.py checks it).

One module a concern:
* `libc`: the loader and the errno helper;
* `mounts`: mount(2)/umount2(2), idmapped mounts (open_tree, mount_setattr), dead FUSE mounts,
  loop-mounted filesystem images;
* `mounttable`: /proc/self/mountinfo and "is this a mount point";
* `filesystems`: statfs(2), sparse files (hole punching, SEEK_DATA), writeback (syncfs);
* `memory`: the page cache (mincore, cachestat);
* `beneath`: files a sandbox controls, opened with openat2(2) beneath a directory;
* `process`: process start times, a socket peer's credentials, user namespaces;
* `fanotify`: fanotify_init(2) and fanotify_mark(2) (not re-exported: the daemon's fanotify
  listener is their one user).

The names below are re-exported, so callers write `from layerstore import linux` and `linux.mount`.
"""
# ruff: noqa: F401  (the re-exports are this module's whole content)

from .beneath import (
    RESOLVE_BENEATH,
    RESOLVE_NO_MAGICLINKS,
    RESOLVE_NO_SYMLINKS,
    RESOLVE_NO_XDEV,
    RESOLVE_STRICT,
    SAFE_OPEN_FLAGS,
    SYS_OPENAT2,
    entry_path,
    open_beneath,
    open_regular_beneath,
    openat2,
    read_regular_beneath,
    regular_size_beneath,
)
from .filesystems import (
    EROFS_MAGIC,
    FALLOC_FL_KEEP_SIZE,
    FALLOC_FL_PUNCH_HOLE,
    FUSE_MAGIC,
    OVERLAYFS_MAGIC,
    SYNC_FILE_RANGE_WRITE,
    data_extents,
    fs_size,
    fs_type,
    punch_hole,
    start_writeback,
    syncfs,
)
from .memory import (
    MAP_FAILED,
    PAGE,
    SYS_CACHESTAT,
    cached_bytes,
    resident_pages,
)
from .mounts import (
    AT_EMPTY_PATH,
    DETACHED_LAZILY,
    MNT_DETACH,
    MOUNT_ATTR_IDMAP,
    MS_BIND,
    MS_NODEV,
    MS_NOSUID,
    MS_PRIVATE,
    MS_RDONLY,
    OPEN_TREE_CLOEXEC,
    OPEN_TREE_CLONE,
    SYS_MOUNT_SETATTR,
    SYS_OPEN_TREE,
    UMOUNT_NOFOLLOW,
    UNMOUNTED,
    MountError,
    bind_private,
    clear_dead_fuse,
    detach,
    detach_how,
    idmap_mount,
    is_dead,
    loop_devices_of,
    make_ext4_image,
    mount,
    mount_erofs,
    mount_image,
    open_tree_clone,
    umount,
    umount2,
)
from .mounttable import (
    MOUNTINFO,
    MountEntry,
    bdi_read_ahead_kb,
    escape,
    find_mount,
    is_mount,
    is_mount_root,
    mount_id,
    mounts_under,
    parse_mountinfo,
    read_mounts,
    unescape,
)
from .process import (
    CLONE_NEWUSER,
    SO_PEERGROUPS,
    peer_credentials,
    proc_start_time,
    user_namespace,
)
