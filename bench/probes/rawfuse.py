"""A minimal read-only FUSE server on /dev/fuse, in Python, for the passthrough probe: one root
directory holding regular files, each backed by a real file. It opens /dev/fuse itself, mounts
with mount(2) and answers requests in a thread of this process (no libfuse: bookworm's 3.14
cannot do passthrough, which needs 3.16's `fuse_passthrough_open`).

With `passthrough=True` it offers FUSE_PASSTHROUGH in INIT (flags2) with `max_stack_depth`, and
answers OPEN of a file with FOPEN_PASSTHROUGH and a backing id registered with
FUSE_DEV_IOC_BACKING_OPEN (one per inode: the kernel refuses two backing files on one inode).
Otherwise, and as a fallback when that ioctl fails, READ is served with a pread of the backing
file (two copies per byte, one request per `max_write` at most, as the project's daemon).

Protocol constants and struct layouts are from the kernel UAPI header include/uapi/linux/fuse.h
(protocol 7.40+: FUSE_PASSTHROUGH = 1 << 37, fuse_init_out.max_stack_depth, fuse_open_out.backing_id,
struct fuse_backing_map); /usr/include/linux/fuse.h on bookworm is 7.38 and has none of them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path

from layerstore import linux

# -- protocol (include/uapi/linux/fuse.h) --------------------------------------------------------
KERNEL_MAJOR = 7
OUR_MINOR = 40  # the first with passthrough; we reply min(kernel's, this)
ROOT_ID = 1

LOOKUP, FORGET, GETATTR, OPEN, READ, STATFS, RELEASE = 1, 2, 3, 14, 15, 17, 18
GETXATTR, LISTXATTR, FLUSH, INIT, OPENDIR, READDIR, RELEASEDIR = 22, 23, 25, 26, 27, 28, 29
INTERRUPT, DESTROY, BATCH_FORGET = 36, 38, 42
NO_REPLY = {FORGET, BATCH_FORGET, INTERRUPT}

ASYNC_READ = 1 << 0
BIG_WRITES = 1 << 5
PARALLEL_DIROPS = 1 << 18
MAX_PAGES = 1 << 22
INIT_EXT = 1 << 30
PASSTHROUGH = 1 << 37  # bits 32.. go to flags2
FOPEN_KEEP_CACHE = 1 << 1
FOPEN_PASSTHROUGH = 1 << 7

IN_HEADER = struct.Struct("<IIQQIIIHH")  # len opcode unique nodeid uid gid pid total_extlen padding
OUT_HEADER = struct.Struct("<IiQ")  # len error unique
INIT_IN = struct.Struct("<IIIII")  # major minor max_readahead flags flags2 (+ unused[11])
# major minor max_readahead flags max_background congestion_threshold max_write time_gran max_pages
# map_alignment flags2 max_stack_depth unused[6]
INIT_OUT = struct.Struct("<IIIIHHIIHHII24x")
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")  # ino size blocks a/m/ctime, nsecs, mode nlink uid gid rdev blksize flags
ENTRY_OUT_HEAD = struct.Struct("<QQQQII")  # nodeid generation entry_valid attr_valid (nsecs)
ATTR_OUT_HEAD = struct.Struct("<QII")  # attr_valid attr_valid_nsec dummy
OPEN_OUT = struct.Struct("<QIi")  # fh open_flags backing_id
READ_IN = struct.Struct("<QQII")  # fh offset size read_flags (+ lock_owner flags padding)
KSTATFS = struct.Struct("<QQQQQIIII24x")
DIRENT_HEAD = struct.Struct("<QQII")  # ino off namelen type
BACKING_MAP = struct.Struct("<iIQ")  # fd flags padding


def _iow(magic: int, nr: int, size: int) -> int:
    return (1 << 30) | (size << 16) | (magic << 8) | nr


FUSE_DEV_IOC_BACKING_OPEN = _iow(229, 1, BACKING_MAP.size)
FUSE_DEV_IOC_BACKING_CLOSE = _iow(229, 2, 4)
TTL = 86400


@dataclass
class Node:
    ino: int
    name: bytes
    path: Path  # the backing file
    size: int
    backing_id: int | None = None  # registered at the first passthrough open
    fd: int = -1  # for the READ fallback


@dataclass
class Log:
    """What happened, for the report."""

    kernel_minor: int = 0
    kernel_flags: int = 0  # flags | flags2 << 32 as offered
    reply_flags: int = 0
    max_pages: int = 0
    max_stack_depth: int = 0
    opens: int = 0
    passthrough_opens: int = 0
    backing_errors: list[str] = field(default_factory=list)
    reads: int = 0
    read_bytes: int = 0
    unknown: dict[int, int] = field(default_factory=dict)
    loop_error: str | None = None


def max_pages_limit() -> int:
    """The kernel's limit on pages per request (sysctl fs.fuse.max_pages_limit, 6.12+; 256 before)."""
    try:
        return int(Path("/proc/sys/fs/fuse/max_pages_limit").read_text())
    except (OSError, ValueError):
        return 256


class RawFuse:
    """`with RawFuse(mnt, files, passthrough=...) as fs:` mounts, serves from a thread, and
    unmounts (lazily if busy) and joins the thread on every exit path."""

    def __init__(self, mountpoint: Path, files: dict[str, Path], *, passthrough: bool, max_stack_depth: int = 1,
                 max_pages: int | None = None, readahead_kb: int | None = None, threads: int = 1) -> None:
        self.mountpoint = Path(mountpoint)
        self.passthrough = passthrough
        self.want_depth = max_stack_depth
        self.max_pages = min(max_pages or max_pages_limit(), 0xFFFF)
        self.readahead_kb = readahead_kb
        self.nodes = {i + 2: Node(i + 2, n.encode(), p, p.stat().st_size)
                      for i, (n, p) in enumerate(sorted(files.items()))}
        self.by_name = {n.name: n for n in self.nodes.values()}
        self.log = Log()
        self.fd = -1
        self.mounted = False
        self.init_done = threading.Event()
        self.threads: list[threading.Thread] = []
        self.nthreads = threads
        self.lock = threading.Lock()

    # -- life cycle ---------------------------------------------------------------------------
    def __enter__(self) -> RawFuse:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        self.fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        opts = f"fd={self.fd},rootmode=40000,user_id=0,group_id=0,allow_other,default_permissions"
        flags = linux.MS_RDONLY | linux.MS_NODEV | linux.MS_NOSUID
        linux.mount("layerstore-probe", self.mountpoint, "fuse", flags, opts)
        self.mounted = True
        for i in range(self.nthreads):
            t = threading.Thread(target=self._serve, name=f"rawfuse-{i}", daemon=True)
            t.start()
            self.threads.append(t)
        if not self.init_done.wait(10):
            raise TimeoutError("no FUSE_INIT from the kernel within 10 s")
        os.statvfs(self.mountpoint)  # returns once the kernel has processed our INIT reply
        if self.readahead_kb:
            path = linux.bdi_read_ahead_kb(self.mountpoint)
            if path:
                Path(path).write_text(f"{self.readahead_kb}\n")

    def stop(self) -> None:
        if self.mounted:
            m = linux.find_mount(self.mountpoint)
            how = linux.detach_how(self.mountpoint)  # unmounted: the serving threads read ENODEV and return
            self.mounted = False
            if how == linux.DETACHED_LAZILY and m is not None:
                self.abort(m.device)  # still held (a loop device on a file): end the connection
        for t in self.threads:
            t.join(5)
        if self.fd >= 0:
            os.close(self.fd)  # also aborts the connection if a lazily detached mount still holds it
            self.fd = -1
        for n in self.nodes.values():
            if n.fd >= 0:
                os.close(n.fd)
                n.fd = -1

    @staticmethod
    def abort(device: str) -> None:
        """Abort the connection through fusectl (its directory is named by the device minor):
        every request, the blocked reads of /dev/fuse included, ends with ENODEV/ENOTCONN."""
        with contextlib.suppress(OSError):
            Path(f"/sys/fs/fuse/connections/{device.split(':')[-1]}/abort").write_text("1\n")

    # -- the loop -----------------------------------------------------------------------------
    def _serve(self) -> None:
        bufsize = max(8192, self.max_pages * 4096 + 4096)
        while True:
            try:
                req = os.read(self.fd, bufsize)
            except OSError as e:
                if e.errno in (errno.EINTR, errno.EAGAIN, errno.ENOENT):  # ENOENT: an interrupted request
                    continue
                if e.errno != errno.ENODEV:  # ENODEV: unmounted
                    self.log.loop_error = f"read /dev/fuse: {e}"
                return
            try:
                self._dispatch(req)
            except OSError as e:
                if e.errno == errno.ENODEV:
                    return
                if e.errno != errno.ENOENT:  # ENOENT: the request was interrupted meanwhile
                    self.log.loop_error = f"reply: {e}"

    def _dispatch(self, req: bytes) -> None:
        _len, op, unique, nodeid, _uid, _gid, _pid, _ext, _pad = IN_HEADER.unpack_from(req)
        body = memoryview(req)[IN_HEADER.size:]
        if op in NO_REPLY:
            return
        handler = HANDLERS.get(op)
        if handler is None:
            with self.lock:
                self.log.unknown[op] = self.log.unknown.get(op, 0) + 1
            self._reply(unique, -errno.ENOSYS)
            return
        try:
            out = handler(self, nodeid, body)
        except OSError as e:
            self._reply(unique, -(e.errno or errno.EIO))
            return
        if op == DESTROY or out is not None:
            self._reply(unique, 0, *(out or ()))
        if op == INIT:
            self.init_done.set()

    def _reply(self, unique: int, error: int, *parts: bytes) -> None:
        size = OUT_HEADER.size + sum(len(p) for p in parts)
        os.writev(self.fd, [OUT_HEADER.pack(size, error, unique), *parts])

    # -- handlers: each returns the reply's payload parts, or raises OSError ------------------
    def _attr(self, ino: int) -> bytes:
        if ino == ROOT_ID:
            mode, size, nlink = stat.S_IFDIR | 0o555, 0, 2
        else:
            node = self.nodes.get(ino)
            if node is None:
                raise OSError(errno.ENOENT, "no such inode")
            mode, size, nlink = stat.S_IFREG | 0o444, node.size, 1
        return ATTR.pack(ino, size, (size + 511) // 512, 0, 0, 0, 0, 0, 0, mode, nlink, 0, 0, 0, 4096, 0)

    def op_init(self, _nodeid: int, body: memoryview) -> tuple[bytes, ...]:
        major, minor, max_readahead, flags, flags2 = INIT_IN.unpack_from(body)
        if major != KERNEL_MAJOR:
            raise OSError(errno.EPROTO, f"kernel FUSE major {major}")
        offered = flags | (flags2 << 32 if flags & INIT_EXT else 0)
        want = ASYNC_READ | BIG_WRITES | PARALLEL_DIROPS | MAX_PAGES | INIT_EXT
        if self.passthrough:
            want |= PASSTHROUGH
        reply = offered & want
        depth = self.want_depth if reply & PASSTHROUGH else 0
        max_write = self.max_pages * 4096
        self.log.kernel_minor, self.log.kernel_flags, self.log.reply_flags = minor, offered, reply
        self.log.max_pages, self.log.max_stack_depth = self.max_pages, depth
        out = INIT_OUT.pack(KERNEL_MAJOR, min(minor, OUR_MINOR), max_readahead, reply & 0xFFFFFFFF, 0, 0, max_write, 1,
                            self.max_pages, 0, reply >> 32, depth)
        return (out,)

    def op_lookup(self, nodeid: int, body: memoryview) -> tuple[bytes, ...]:
        name = bytes(body).split(b"\0", 1)[0]
        node = self.by_name.get(name) if nodeid == ROOT_ID else None
        if node is None:
            raise OSError(errno.ENOENT, "no such name")
        return (ENTRY_OUT_HEAD.pack(node.ino, 0, TTL, TTL, 0, 0), self._attr(node.ino))

    def op_getattr(self, nodeid: int, _body: memoryview) -> tuple[bytes, ...]:
        return (ATTR_OUT_HEAD.pack(TTL, 0, 0), self._attr(nodeid))

    def op_open(self, nodeid: int, body: memoryview) -> tuple[bytes, ...]:
        node = self.nodes.get(nodeid)
        if node is None:
            raise OSError(errno.ENOENT, "no such inode")
        (oflags,) = struct.unpack_from("<I", body)
        if oflags & os.O_ACCMODE != os.O_RDONLY:
            raise OSError(errno.EROFS, "read-only")
        with self.lock:
            self.log.opens += 1
            if node.fd < 0:
                node.fd = os.open(node.path, os.O_RDONLY | os.O_CLOEXEC)
            if self.passthrough and self.log.reply_flags & PASSTHROUGH and node.backing_id is None:
                node.backing_id = self._backing_open(node)
            if node.backing_id is not None:
                self.log.passthrough_opens += 1
                return (OPEN_OUT.pack(nodeid, FOPEN_PASSTHROUGH, node.backing_id),)
        return (OPEN_OUT.pack(nodeid, FOPEN_KEEP_CACHE, 0),)

    def _backing_open(self, node: Node) -> int | None:
        """Register the backing file (the kernel keeps its own reference); None on failure
        (EPERM: passthrough not negotiated or no CAP_SYS_ADMIN; ELOOP: the backing file's
        filesystem is stacked as deep as max_stack_depth)."""
        try:
            return fcntl.ioctl(self.fd, FUSE_DEV_IOC_BACKING_OPEN, bytearray(BACKING_MAP.pack(node.fd, 0, 0)), True)
        except OSError as e:
            what = f"BACKING_OPEN {node.name.decode()}: {errno.errorcode.get(e.errno or 0)} {e.strerror}"
            self.log.backing_errors.append(what)
            return None

    def op_read(self, nodeid: int, body: memoryview) -> tuple[bytes, ...]:
        _fh, offset, size, _rflags = READ_IN.unpack_from(body)
        node = self.nodes[nodeid]
        data = os.pread(node.fd, size, offset)
        with self.lock:
            self.log.reads += 1
            self.log.read_bytes += len(data)
        return (data,)

    def op_empty(self, _nodeid: int, _body: memoryview) -> tuple[bytes, ...]:
        return ()

    def op_statfs(self, _nodeid: int, _body: memoryview) -> tuple[bytes, ...]:
        blocks = sum((n.size + 4095) // 4096 for n in self.nodes.values())
        return (KSTATFS.pack(blocks, 0, 0, len(self.nodes) + 1, 0, 4096, 255, 4096, 0),)

    def op_opendir(self, nodeid: int, _body: memoryview) -> tuple[bytes, ...]:
        if nodeid != ROOT_ID:
            raise OSError(errno.ENOTDIR, "not a directory")
        return (OPEN_OUT.pack(0, 0, 0),)

    def op_readdir(self, _nodeid: int, body: memoryview) -> tuple[bytes, ...]:
        _fh, offset, size, _rflags = READ_IN.unpack_from(body)
        entries = [(ROOT_ID, b".", 4), (ROOT_ID, b"..", 4)] + [(n.ino, n.name, 8) for n in self.nodes.values()]
        out = bytearray()
        for i in range(offset, len(entries)):
            ino, name, dtype = entries[i]
            rec = DIRENT_HEAD.pack(ino, i + 1, len(name), dtype) + name
            rec += b"\0" * (-len(rec) % 8)
            if len(out) + len(rec) > size:
                break
            out += rec
        return (bytes(out),)

    def op_getxattr(self, _nodeid: int, _body: memoryview) -> tuple[bytes, ...]:
        raise OSError(errno.ENODATA, "no xattrs")

    def op_listxattr(self, _nodeid: int, _body: memoryview) -> tuple[bytes, ...]:
        raise OSError(errno.ENOSYS, "no xattrs")


HANDLERS = {INIT: RawFuse.op_init, LOOKUP: RawFuse.op_lookup, GETATTR: RawFuse.op_getattr, OPEN: RawFuse.op_open,
            READ: RawFuse.op_read, RELEASE: RawFuse.op_empty, FLUSH: RawFuse.op_empty, STATFS: RawFuse.op_statfs,
            OPENDIR: RawFuse.op_opendir, READDIR: RawFuse.op_readdir, RELEASEDIR: RawFuse.op_empty,
            GETXATTR: RawFuse.op_getxattr, LISTXATTR: RawFuse.op_listxattr, DESTROY: RawFuse.op_empty}


def describe_flags(flags: int) -> str:
    names = {ASYNC_READ: "ASYNC_READ", BIG_WRITES: "BIG_WRITES", PARALLEL_DIROPS: "PARALLEL_DIROPS",
             MAX_PAGES: "MAX_PAGES", INIT_EXT: "INIT_EXT", PASSTHROUGH: "PASSTHROUGH"}
    return "|".join(n for bit, n in names.items() if flags & bit) or "0"
