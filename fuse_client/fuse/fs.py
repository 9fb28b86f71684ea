"""The FUSE operations: a read-only tree `/blobs/<digest>`, one regular file per blob.

    inode 1   /          (directory, 0500)
    inode 2   /blobs     (directory, 0500; lists the blobs whose chunk maps this node has seen; any
                          blob of the store can be looked up by name)
    inode 3+  /blobs/b3:<hex>   (regular file, mode 0400, the blob's full size)

Owned by the daemon's user; with `group_read` (a control group) the group may read too (0550,
0440). The kernel checks these modes (default_permissions): a blob may hold an environment's
secrets, and another user on the node reads none of it (docs/security.md).

Inode numbers of blobs are handed out on first lookup and never reused while the daemon runs.
Lookup counts (lookup +1, readdirplus entry +1, forget -n) and open file handles are counted
explicitly; a blob's inode is forgotten when both reach zero.

This module is a front end of the node cache (`fuse_client.nodecache`): it calls the cache's
API and never reads or writes its fields. An open file is a `nodecache.Reader`. The read path
(`read`): `Reader.read_cached` answers inline on the trio thread (no thread hop, no await) with a
pread of the blob's data file or a slice of its mapping when every chunk of the range is cached;
otherwise `read` awaits `Reader.read_missing` (fetch, then serve). Handlers raise only
`pyfuse3.FUSEError`: the project's errors are translated here, by their `.errno`.

The answer is valid until the next await: pyfuse3 sends the reply as soon as `read` returns,
before any other task runs, and the pages cannot be evicted in between (eviction punches holes
from the trio thread too). Callers that keep an answer longer must copy it.

Metadata push: EROFS reads its metadata (inodes, directories) from the backing file one page at
a time (`read_mapping_folio`, no readahead), and each such page is a synchronous FUSE request.
When a read touches a metadata chunk, the daemon also pushes that whole chunk, and the nearest
other metadata chunks (up to 4 MiB in all), into the kernel's page cache of the blob
file (FUSE notify_store, from a worker thread, in the background), so the following metadata
reads are page-cache hits, in buffered and `directio` mounts alike.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import stat
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import pyfuse3
import trio

from fuse_client.nodecache import BlobEntry, CacheIOError, LazyCache, Reader
from layerstore import digest as digestmod
from layerstore.errors import LayerstoreError, NotFound

log = logging.getLogger("layerstore.fuse.fs")

ROOT_INODE = pyfuse3.ROOT_INODE
BLOBS_INODE = 2
FIRST_BLOB_INODE = 3
BLOBS_DIR = b"blobs"
ATTR_TIMEOUT = 86400.0  # blobs are immutable: let the kernel cache entries and attributes
BLKSIZE = 128 * 1024
PUSH_THREADS = 2  # concurrent metadata pushes (notify_store) to the kernel
METADATA_PUSH_WINDOW = 4 << 20  # a metadata push also takes the following metadata chunks, up to this
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_TRUNC | os.O_CREAT

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


def fuse_edge(fn: F) -> F:
    """Translate the project's errors (and anything unexpected) into FUSEError."""

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kw: Any) -> Any:
        try:
            return await fn(*args, **kw)
        except pyfuse3.FUSEError:
            raise
        except LayerstoreError as e:
            if e.errno == errno.EIO:
                log.warning("%s: %s", fn.__name__, e)
            raise pyfuse3.FUSEError(e.errno) from None
        except OSError as e:
            log.error("%s: %s", fn.__name__, e)
            raise pyfuse3.FUSEError(e.errno or errno.EIO) from None
        except Exception:
            log.exception("%s: unexpected error", fn.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None

    return wrapper  # type: ignore[return-value]


def _push_range(e: BlobEntry, ino: int, lo: int, hi: int) -> None:
    pyfuse3.notify_store(ino, lo, e.read_sync(lo, hi))


class BlobFS(pyfuse3.Operations):
    supports_dot_lookup = False
    enable_writeback_cache = False

    def __init__(self, lazy: LazyCache, *, uid: int = 0, gid: int = 0, group_read: bool = False,
                 push_nursery: trio.Nursery | None = None) -> None:
        """`push_nursery`: where metadata pushes run (None: no pushes, e.g. without a kernel).
        `group_read`: group `gid` may read the blobs (else only `uid`)."""
        super().__init__()
        self._dir_mode = stat.S_IFDIR | (0o550 if group_read else 0o500)
        self._blob_mode = stat.S_IFREG | (0o440 if group_read else 0o400)
        self._push_nursery = push_nursery
        self._pushing: dict[str, set[int]] = {}  # blob -> metadata chunks being pushed
        self._push_threads = trio.CapacityLimiter(PUSH_THREADS)
        self.lazy = lazy
        self.uid = uid
        self.gid = gid
        self._ino_of: dict[str, int] = {}
        self._blob_of: dict[int, str] = {}
        self._lookups: dict[int, int] = {}
        self._opens: dict[int, int] = {}
        self._next_ino = FIRST_BLOB_INODE
        self._handles: dict[int, Reader] = {}
        self._handle_ino: dict[int, int] = {}
        self._next_fh = 1

    # -- inodes ------------------------------------------------------------------------------
    def _inode(self, blob: str) -> int:
        ino = self._ino_of.get(blob)
        if ino is None:
            ino = self._next_ino
            self._next_ino += 1
            self._ino_of[blob] = ino
            self._blob_of[ino] = blob
        return ino

    def _maybe_forget(self, ino: int) -> None:
        if self._lookups.get(ino, 0) <= 0 and self._opens.get(ino, 0) <= 0:
            self._lookups.pop(ino, None)
            self._opens.pop(ino, None)
            blob = self._blob_of.pop(ino, None)
            if blob is not None:
                del self._ino_of[blob]

    def _dir_attr(self, ino: int) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = ino
        a.st_mode = self._dir_mode
        a.st_nlink = 2
        a.st_uid, a.st_gid = self.uid, self.gid
        a.st_size = 0
        a.st_blksize = 4096
        a.entry_timeout = a.attr_timeout = ATTR_TIMEOUT
        return a

    def _blob_attr(self, ino: int, size: int) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = ino
        a.st_mode = self._blob_mode
        a.st_nlink = 1
        a.st_uid, a.st_gid = self.uid, self.gid
        a.st_size = size
        a.st_blocks = (size + 511) // 512  # not sparse as far as readers can tell
        a.st_blksize = BLKSIZE
        a.entry_timeout = a.attr_timeout = ATTR_TIMEOUT
        return a

    # -- namespace ----------------------------------------------------------------------------
    @fuse_edge
    async def lookup(self, parent_inode: int, name: bytes, ctx: Any = None) -> pyfuse3.EntryAttributes:
        if parent_inode == ROOT_INODE:
            if name == BLOBS_DIR:
                return self._dir_attr(BLOBS_INODE)
            raise pyfuse3.FUSEError(errno.ENOENT)
        if parent_inode != BLOBS_INODE:
            raise pyfuse3.FUSEError(errno.ENOTDIR if parent_inode in self._blob_of else errno.ENOENT)
        try:
            blob = digestmod.parse(os.fsdecode(name))
        except LayerstoreError:
            raise pyfuse3.FUSEError(errno.ENOENT) from None
        try:
            entry = await self.lazy.entry(blob)
        except NotFound:
            raise pyfuse3.FUSEError(errno.ENOENT) from None
        ino = self._inode(blob)
        self._lookups[ino] = self._lookups.get(ino, 0) + 1
        return self._blob_attr(ino, entry.size)

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        for ino, n in inode_list:  # must not raise
            if ino in self._lookups:
                self._lookups[ino] -= n
                self._maybe_forget(ino)

    @fuse_edge
    async def getattr(self, inode: int, ctx: Any = None) -> pyfuse3.EntryAttributes:
        if inode in (ROOT_INODE, BLOBS_INODE):
            return self._dir_attr(inode)
        blob = self._blob_of.get(inode)
        if blob is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._blob_attr(inode, (await self.lazy.entry(blob)).size)

    @fuse_edge
    async def opendir(self, inode: int, ctx: Any = None) -> int:
        if inode not in (ROOT_INODE, BLOBS_INODE):
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return inode

    @fuse_edge
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        if fh == ROOT_INODE:
            if start_id == 0:
                pyfuse3.readdir_reply(token, BLOBS_DIR, self._dir_attr(BLOBS_INODE), 1)
            return
        # The blobs this node has seen, in a stable order (start_id is an index into it).
        blobs = self.lazy.blobs()
        for k in range(start_id, len(blobs)):
            blob, size = blobs[k]
            ino = self._inode(blob)
            attr = self._blob_attr(ino, size)
            if not pyfuse3.readdir_reply(token, os.fsencode(blob), attr, k + 1):
                self._maybe_forget(ino)
                return
            self._lookups[ino] = self._lookups.get(ino, 0) + 1

    async def releasedir(self, fh: int) -> None:
        pass

    @fuse_edge
    async def statfs(self, ctx: Any = None) -> pyfuse3.StatvfsData:
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = 4096
        blobs = self.lazy.blobs()
        total = sum(size for _, size in blobs)
        s.f_blocks = (total + 4095) // 4096
        s.f_bfree = s.f_bavail = 0
        s.f_files = len(blobs) + 2
        s.f_ffree = s.f_favail = 0
        s.f_namemax = 255
        return s

    # -- files ---------------------------------------------------------------------------------
    @fuse_edge
    async def open(self, inode: int, flags: int, ctx: Any = None) -> pyfuse3.FileInfo:
        if flags & _WRITE_FLAGS:
            raise pyfuse3.FUSEError(errno.EROFS)
        if inode in (ROOT_INODE, BLOBS_INODE):
            raise pyfuse3.FUSEError(errno.EISDIR)
        blob = self._blob_of.get(inode)
        if blob is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        entry = await self.lazy.entry(blob)
        # The kernel's EROFS mount reads superblock, inodes and directories first, chunk by
        # chunk: fetch all of them, in parallel, before the open returns.
        await self.lazy.ensure_metadata(entry)
        fh = self._next_fh
        self._next_fh += 1
        self._handles[fh] = self.lazy.open_reader(
            entry, on_metadata_read=self._push_metadata if self._push_nursery is not None else None)
        self._handle_ino[fh] = inode
        self._opens[inode] = self._opens.get(inode, 0) + 1
        # keep_cache: the blob never changes, so pages cached by an earlier open stay valid.
        return pyfuse3.FileInfo(fh=fh, keep_cache=True)

    async def read(self, fh: int, off: int, size: int) -> bytes | memoryview:
        r = self._handles.get(fh)
        if r is None:
            raise pyfuse3.FUSEError(errno.EBADF)
        try:
            data = r.read_cached(off, size)  # inline: no await between the check and the reply
        except CacheIOError:  # logged by the reader
            raise pyfuse3.FUSEError(errno.EIO) from None
        if data is None:
            return await self._read_missing(r, off, size)
        return data

    @fuse_edge
    async def _read_missing(self, r: Reader, off: int, size: int) -> bytes | memoryview:
        return await r.read_missing(off, size)

    def _push_metadata(self, e: BlobEntry, i: int) -> None:
        """Start pushing metadata chunk `i` into the kernel's page cache (see the module doc),
        unless a push of it is under way (a read of it reaching us means the kernel lacks it),
        together with the nearest other metadata chunks, up to `METADATA_PUSH_WINDOW` bytes: a
        walk of the tree reads them soon."""
        if self._push_nursery is None:
            return
        ino = self._ino_of.get(e.blob)
        if ino is None:
            return
        # The other metadata chunks come along, nearest first. Pushed again even if pushed
        # before: a read of one of them reaching us says the kernel dropped what we pushed
        # (reclaim drops it together).
        pushing = self._pushing.get(e.blob)
        idxs = e.metadata_near(i, METADATA_PUSH_WINDOW, skip=pushing or ())
        if not idxs:
            return
        if pushing is None:
            pushing = self._pushing[e.blob] = set()
        pushing.update(idxs)
        self.lazy.cache.pin(e, idxs)  # no eviction (a punched hole reads as zeros) until pushed
        self._push_nursery.start_soon(self._push, e, ino, idxs)

    async def stop_pushes(self, timeout: float = 5.0) -> None:
        """No new metadata pushes; wait for those under way (before the FUSE session is closed:
        a notify_store on a closed session would touch freed memory)."""
        self._push_nursery = None
        with trio.move_on_after(timeout):
            while self._pushing:
                await trio.sleep(0.01)

    async def _push(self, e: BlobEntry, ino: int, idxs: list[int]) -> None:
        chunks = e.cmap.chunks
        # Contiguous chunks go in one notify_store.
        runs: list[tuple[int, int]] = []
        for k in idxs:
            ref = chunks[k]
            if runs and runs[-1][1] == ref.offset:
                runs[-1] = (runs[-1][0], ref.end)
            else:
                runs.append((ref.offset, ref.end))
        try:
            for lo, hi in runs:
                # In a worker thread: the kernel may wait for a page that an in-flight read of
                # ours has locked, and that read is answered by this (trio) thread. Read with
                # pread: faults on the mapping would read the device's readahead window around
                # every page they miss.
                await trio.to_thread.run_sync(_push_range, e, ino, lo, hi, limiter=self._push_threads)
                self.lazy.stats.count_metadata_push(hi - lo)
        except OSError as err:
            if err.errno == errno.ENOSYS:
                log.warning("the kernel does not take FUSE notify_store: no metadata push")
                self._push_nursery = None
            elif err.errno != errno.ENOENT:  # ENOENT: the kernel forgot the inode meanwhile
                log.warning("blob %s: pushing metadata to the kernel: %s", e.blob, err)
        finally:
            self.lazy.cache.unpin(e, idxs)
            pushing = self._pushing.get(e.blob)
            if pushing is not None:
                pushing.difference_update(idxs)
                if not pushing:
                    del self._pushing[e.blob]

    async def flush(self, fh: int) -> None:
        pass

    async def release(self, fh: int) -> None:
        r = self._handles.pop(fh, None)
        ino = self._handle_ino.pop(fh, None)
        if r is not None:
            r.close()
        if ino is not None:
            self._opens[ino] = self._opens.get(ino, 1) - 1
            self._maybe_forget(ino)

    async def fsync(self, fh: int, datasync: bool) -> None:
        pass

    # -- extended attributes: none -------------------------------------------------------------
    async def getxattr(self, inode: int, name: bytes, ctx: Any = None) -> bytes:
        raise pyfuse3.FUSEError(pyfuse3.ENOATTR)

    async def listxattr(self, inode: int, ctx: Any = None) -> list[bytes]:
        return []

    # -- nothing is writable ------------------------------------------------------------------
    async def setattr(self, inode: int, attr: Any, fields: Any, fh: Any, ctx: Any) -> pyfuse3.EntryAttributes:
        raise pyfuse3.FUSEError(errno.EROFS)

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        raise pyfuse3.FUSEError(errno.EROFS)

    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: Any) -> Any:
        raise pyfuse3.FUSEError(errno.EROFS)

    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: Any) -> Any:
        raise pyfuse3.FUSEError(errno.EROFS)

    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: Any) -> Any:
        raise pyfuse3.FUSEError(errno.EROFS)

    async def unlink(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        raise pyfuse3.FUSEError(errno.EROFS)

    async def rmdir(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        raise pyfuse3.FUSEError(errno.EROFS)

    async def symlink(self, parent_inode: int, name: bytes, target: bytes, ctx: Any) -> Any:
        raise pyfuse3.FUSEError(errno.EROFS)

    async def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int, name_new: bytes,
                     flags: int, ctx: Any) -> None:
        raise pyfuse3.FUSEError(errno.EROFS)

    async def link(self, inode: int, new_parent_inode: int, new_name: bytes, ctx: Any) -> Any:
        raise pyfuse3.FUSEError(errno.EROFS)

    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: Any) -> None:
        raise pyfuse3.FUSEError(errno.EROFS)

    async def removexattr(self, inode: int, name: bytes, ctx: Any) -> None:
        raise pyfuse3.FUSEError(errno.EROFS)
