"""The FUSE operations: a read-only tree `/blobs/<digest>`, one regular file per blob.

    inode 1   /          (directory)
    inode 2   /blobs     (directory; lists the blobs whose chunk maps this node has seen; any
                          blob of the store can be looked up by name)
    inode 3+  /blobs/b3:<hex>   (regular file, mode 0444, the blob's full size)

Inode numbers of blobs are handed out on first lookup and never reused while the daemon runs.
Lookup counts (lookup +1, readdirplus entry +1, forget -n) and open file handles are counted
explicitly; a blob's inode is forgotten when both reach zero.

The read path (`read`): map the range to chunk indexes; if every one is present in the node cache,
answer on the trio thread (no thread hop, no await) with a pread of the blob's data file, or, for
a long sequential stream, a slice of its mapping (no syscall, no copy: the kernel copies from the
page cache straight into its reply; see `_serve` for why not always). Otherwise pin
the chunks (eviction skips pinned chunks), let the fetcher make them present (fetched in
parallel, single-flight), and answer the same way. Handlers raise only `pyfuse3.FUSEError`: the
project's errors are translated here, by their `.errno`.

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

from layerstore import digest as digestmod
from layerstore.errors import LayerstoreError, NotFound

from .cache import BlobEntry, NodeCache
from .fetcher import Fetcher
from .stats import BlobStats, Stats
from .trace import TraceRecorder

log = logging.getLogger("layerstore.fuse.fs")

ROOT_INODE = pyfuse3.ROOT_INODE
BLOBS_INODE = 2
FIRST_BLOB_INODE = 3
BLOBS_DIR = b"blobs"
ATTR_TIMEOUT = 86400.0  # blobs are immutable: let the kernel cache entries and attributes
BLKSIZE = 128 * 1024
DEFAULT_READAHEAD = 16  # chunks: the largest readahead window of a sequential stream
PUSH_THREADS = 2  # concurrent metadata pushes (notify_store) to the kernel
# A hit is served from the data file's mapping once its stream has read this much (see `_serve`).
MAP_STREAM_MIN = 4 << 20
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


class Handle:
    __slots__ = ("entry", "stats")

    def __init__(self, entry: BlobEntry, stats: BlobStats) -> None:
        self.entry = entry
        self.stats = stats


def _push_range(e: BlobEntry, ino: int, lo: int, hi: int) -> None:
    pyfuse3.notify_store(ino, lo, e.read_sync(lo, hi))


class BlobFS(pyfuse3.Operations):
    supports_dot_lookup = False
    enable_writeback_cache = False

    def __init__(self, fetcher: Fetcher, cache: NodeCache, stats: Stats, *, trace: TraceRecorder | None = None,
                 readahead: int = DEFAULT_READAHEAD, uid: int = 0, gid: int = 0,
                 push_nursery: trio.Nursery | None = None) -> None:
        """`push_nursery`: where metadata pushes run (None: no pushes, e.g. without a kernel)."""
        super().__init__()
        self._push_nursery = push_nursery
        self._pushing: set[tuple[str, int]] = set()
        self._push_threads = trio.CapacityLimiter(PUSH_THREADS)
        self.readahead = readahead
        self._clock = cache.clock
        self.fetcher = fetcher
        self.cache = cache
        self.stats = stats
        self.trace = trace
        self.uid = uid
        self.gid = gid
        self._ino_of: dict[str, int] = {}
        self._blob_of: dict[int, str] = {}
        self._lookups: dict[int, int] = {}
        self._opens: dict[int, int] = {}
        self._next_ino = FIRST_BLOB_INODE
        self._handles: dict[int, Handle] = {}
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
        a.st_mode = stat.S_IFDIR | 0o555
        a.st_nlink = 2
        a.st_uid, a.st_gid = self.uid, self.gid
        a.st_size = 0
        a.st_blksize = 4096
        a.entry_timeout = a.attr_timeout = ATTR_TIMEOUT
        return a

    def _blob_attr(self, ino: int, size: int) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = ino
        a.st_mode = stat.S_IFREG | 0o444
        a.st_nlink = 1
        a.st_uid, a.st_gid = self.uid, self.gid
        a.st_size = size
        a.st_blocks = (size + 511) // 512  # not sparse as far as readers can tell
        a.st_blksize = BLKSIZE
        a.entry_timeout = a.attr_timeout = ATTR_TIMEOUT
        return a

    async def _entry(self, blob: str) -> BlobEntry:
        entry = await self.fetcher.entry(blob)
        self.stats.blob(blob, entry.size)
        return entry

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
            entry = await self._entry(blob)
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
        return self._blob_attr(inode, (await self._entry(blob)).size)

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
        blobs = sorted(self.cache.entries)
        for k in range(start_id, len(blobs)):
            blob = blobs[k]
            ino = self._inode(blob)
            attr = self._blob_attr(ino, self.cache.entries[blob].size)
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
        total = sum(e.size for e in self.cache.entries.values())
        s.f_blocks = (total + 4095) // 4096
        s.f_bfree = s.f_bavail = 0
        s.f_files = len(self.cache.entries) + 2
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
        entry = await self._entry(blob)
        if entry.metadata and entry.missing(entry.metadata):
            # The kernel's EROFS mount reads superblock, inodes and directories first, chunk by
            # chunk: fetch all of them, in parallel, before the open returns.
            self.cache.pin(entry, entry.metadata)
            try:
                await self.fetcher.ensure(entry, entry.metadata)
            finally:
                self.cache.unpin(entry, entry.metadata)
        fh = self._next_fh
        self._next_fh += 1
        self._handles[fh] = Handle(entry, self.stats.blob(blob, entry.size))
        self._handle_ino[fh] = inode
        self._opens[inode] = self._opens.get(inode, 0) + 1
        entry.open_count += 1
        # keep_cache: the blob never changes, so pages cached by an earlier open stay valid.
        return pyfuse3.FileInfo(fh=fh, keep_cache=True)

    async def read(self, fh: int, off: int, size: int) -> bytes | memoryview:
        h = self._handles.get(fh)
        if h is None:
            raise pyfuse3.FUSEError(errno.EBADF)
        e = h.entry
        cmap = e.cmap
        end = off + size
        if end > cmap.size:
            end = cmap.size
        if off >= end:
            return b""
        first = cmap.index_at(off)
        last = cmap.index_at(end - 1) + 1
        if e.present.find(0, first, last) < 0:
            # Fast path: one lookup (above) and a slice of the mapped data file, inline. No
            # await between the check and the reply, so no eviction can slip in between.
            data = self._serve(e, off, end)
            now = self._clock()
            lu = e.last_use
            for i in range(first, last):
                lu[i] = now
            e.use_dirty = True
            if not e.is_meta[first]:  # metadata reads interleave with streams; they neither start nor end one
                self._follow_stream(e, off, end, first, last, now)
            elif self._push_nursery is not None and end - off < cmap.chunks[first].length:
                self._push_metadata(e, first)
            st = h.stats
            st.hits += 1
            st.served_bytes += len(data)
            if self.trace is not None:
                self.trace.record(e.blob, len(e.present), first, last)
            return data
        return await self._read_missing(h, off, end, first, last)

    def _serve(self, e: BlobEntry, off: int, end: int) -> bytes | memoryview:
        """Bytes [off, end) of a blob whose chunks there are all committed.

        Where the pages are not in the page cache (a warm node cache after a reboot, or after
        reclaim), how they are read decides the speed. A pread reads ahead as the kernel does
        for any file: a small read reads little, a stream's windows grow and are read
        asynchronously. A fault on the mapping reads the device's whole readahead window
        around the page, synchronously (8 MiB, 5 ms, here), while the kernel waits for our
        reply: a stall for a small file, but large reads with large folios for a stream, and
        no copy in the daemon. So a request that continues a stream of `MAP_STREAM_MIN`
        bytes or more is a slice of the mapping, any other a pread (walk + hash of a tree of
        small files, warm, page cache dropped: 0.67 -> 0.85 of EROFS on a local file; 0.94
        with the 4 MiB kernel readahead, docs/benchmarks-read.md)."""
        if e.streams.run_to(off) >= MAP_STREAM_MIN:
            return self._from_mapping(e, off, end)
        return self._pread(e, off, end)

    def _from_mapping(self, e: BlobEntry, off: int, end: int) -> bytes | memoryview:
        """A slice of the mapping, or a pread where the file cannot be mapped."""
        v = e.mapped_range(off, end)
        return v if v is not None else self._pread(e, off, end)

    def _follow_stream(self, e: BlobEntry, off: int, end: int, first: int, last: int, now: float) -> None:
        """Let a data read extend its sequential stream, and read ahead of it if that opens a window."""
        w = e.streams.on_read(off, end, last, len(e.present), self.readahead, now, e.cmap.chunks[first].length)
        if w is not None:
            self._readahead(e, w)

    @staticmethod
    def _pread(e: BlobEntry, off: int, end: int) -> bytes:
        try:
            return os.pread(e.fd, end - off, off)
        except OSError as err:
            log.error("blob %s: reading the cache at %d+%d: %s", e.blob, off, end - off, err)
            raise pyfuse3.FUSEError(errno.EIO) from None

    @fuse_edge
    async def _read_missing(self, h: Handle, off: int, end: int, first: int, last: int) -> bytes | memoryview:
        e = h.entry
        idxs = range(first, last)
        if self.trace is not None:
            self.trace.record(e.blob, len(e.present), first, last)
        if not e.is_meta[first]:
            # Read ahead before this read waits: the fetches overlap.
            self._follow_stream(e, off, end, first, last, self._clock())
        self.cache.pin(e, idxs)
        try:
            await self.fetcher.ensure(e, idxs)
            # Present now, and nothing awaits before the reply. The chunks just fetched were just
            # written, so their pages are in the page cache: the mapping, no copy.
            data = self._from_mapping(e, off, end)
        finally:
            self.cache.unpin(e, idxs)
        e.touch(first, last, self.cache.clock())
        h.stats.misses += 1
        h.stats.served_bytes += len(data)
        return data

    def _push_metadata(self, e: BlobEntry, i: int) -> None:
        """Start pushing metadata chunk `i` into the kernel's page cache (see the module doc),
        unless a push of it is under way (a read of it reaching us means the kernel lacks it),
        together with the nearest other metadata chunks, up to `METADATA_PUSH_WINDOW` bytes: a
        walk of the tree reads them soon."""
        if self._push_nursery is None or (e.blob, i) in self._pushing or not e.present[i]:
            return
        ino = self._ino_of.get(e.blob)
        if ino is None:
            return
        chunks = e.cmap.chunks
        idxs = [i]
        budget = METADATA_PUSH_WINDOW - chunks[i].length
        # The other metadata chunks, nearest first (EROFS jumps between inodes and directories
        # all over the metadata region). Pushed again even if pushed before: a read of one of
        # them reaching us says the kernel dropped what we pushed (reclaim drops it together).
        for j in sorted(e.metadata, key=lambda j: abs(j - i)):
            if budget <= 0:
                break
            if j != i and e.present[j] and (e.blob, j) not in self._pushing:
                idxs.append(j)
                budget -= chunks[j].length
        idxs.sort()
        for k in idxs:
            self._pushing.add((e.blob, k))
        self.cache.pin(e, idxs)  # no eviction (a punched hole reads as zeros) until pushed
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
                self.stats.metadata_pushes += 1
                self.stats.metadata_pushed_bytes += hi - lo
        except OSError as err:
            if err.errno == errno.ENOSYS:
                log.warning("the kernel does not take FUSE notify_store: no metadata push")
                self._push_nursery = None
            elif err.errno != errno.ENOENT:  # ENOENT: the kernel forgot the inode meanwhile
                log.warning("blob %s: pushing metadata to the kernel: %s", e.blob, err)
        finally:
            self.cache.unpin(e, idxs)
            for k in idxs:
                self._pushing.discard((e.blob, k))

    def _readahead(self, e: BlobEntry, window: tuple[int, int]) -> None:
        """Fetch a stream's new window (see `readahead.Streams`) in the background, at prefetch
        priority, leaving out chunks present or in flight (a prefetch task for a chunk in flight
        would hold a token just to wait)."""
        busy = self.cache.busy
        todo = [i for i in range(*window) if not e.present[i] and (e.blob, i) not in busy]
        if todo:
            self.fetcher.readahead(e, todo)

    async def flush(self, fh: int) -> None:
        pass

    async def release(self, fh: int) -> None:
        h = self._handles.pop(fh, None)
        ino = self._handle_ino.pop(fh, None)
        if h is not None:
            h.entry.open_count -= 1
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
