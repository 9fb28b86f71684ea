"""A pure-Python EROFS image writer: 4 KiB blocks, uncompressed, reproducible.

Image layout (see docs/erofs-builder.md):

    block 0            superblock at byte 1024
    blocks 1..D-1      data area: regular-file data streamed as entries are added, each stored
                       run starting on a block boundary
    blocks D..         metadata area (meta_blkaddr = D):
                         volatile records: the root directory first (nid 0), then every inode
                           that holds an absolute address (directories, files with data blocks,
                           chunk-based files, symlinks stored in a block)
                         stable groups: inodes that depend only on their entry (small files
                           with all their data inline, empty files, inline symlinks, devices,
                           fifos, sockets), in content-defined groups that each start on a block
                         directory blocks of directories too big to be inline
                         the shared xattr area

Data is written while entries are added (the image file is the only buffer for file data);
metadata is kept in memory and written by `finish`, together with the superblock.
"""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Iterator
from typing import BinaryIO

import blake3

from layerstore.errors import BadInput

from . import format as fmt
from .chunking import DataExtent, ImageLayout, MetaSegment
from .tree import Data, Entry, Hole, Kind, check_path

BS = fmt.BLOCK_SIZE
_FLUSH = 1 << 20
_ZEROS = bytes(BS)
PATH_MAX = 4096


class Inode:
    """One inode of the image being built (a directory, or what one or more dirents name)."""

    __slots__ = ("kind", "mode", "uid", "gid", "mtime", "nsec", "xattrs", "size", "rdev", "symlink", "nlink",
                 "children", "explicit", "layout", "blkaddr", "inline", "chunkbits", "blockmap", "path")

    def __init__(self, kind: Kind, path: bytes) -> None:
        self.kind = kind
        self.path = path
        self.mode = 0o755
        self.uid = self.gid = 0
        self.mtime = self.nsec = 0
        self.xattrs: dict[bytes, bytes] = {}
        self.size = 0
        self.rdev = 0
        self.symlink = b""
        self.nlink = 1
        self.children: dict[bytes, Inode] | None = {} if kind is Kind.DIR else None
        self.explicit = False
        self.layout = fmt.LAYOUT_FLAT_PLAIN
        self.blkaddr = 0
        self.inline = b""
        self.chunkbits = 0
        self.blockmap: list[int] = []

    @property
    def has_address(self) -> bool:
        """True if the inode's bytes hold an absolute position (so they change when data moves)."""
        return (self.kind is Kind.DIR or self.layout == fmt.LAYOUT_CHUNK_BASED
                or (self.kind in (Kind.REG, Kind.SYMLINK) and self.size > len(self.inline)))


class ImageWriter:
    def __init__(self, out: BinaryIO, *, mtime_clamp: int | None = None, all_root: bool = False,
                 pack_tails: bool = False) -> None:
        """`pack_tails` also packs the last partial block of multi-block files into the metadata
        (smaller image, but those tails then sit next to absolute addresses and dedup poorly)."""
        self._out = out
        self._clamp = mtime_clamp
        self._all_root = all_root
        self._pack_tails = pack_tails
        self._root = Inode(Kind.DIR, b"")
        self._root.mtime = mtime_clamp or 0
        self._explicit: set[bytes] = set()
        self._extents: list[DataExtent] = []
        self._cur = blake3.blake3()  # digest of the data run being written
        self._digests: list[bytes] = []  # one per extent
        self._pos = BS
        self._paths = 1
        self._finished = False
        out.seek(BS)

    # -- entries ------------------------------------------------------------------------
    def add(self, entry: Entry, data: Data | None = None) -> None:
        if self._finished:
            raise BadInput("image writer already finished")
        path = check_path(entry.path)
        if path in self._explicit:
            raise BadInput(f"{path!r}: duplicate entry")
        if entry.hardlink is not None:
            self._add_hardlink(path, check_path(entry.hardlink))
            _drain_empty(data, path)
            return
        if path == b"":
            if entry.kind is not Kind.DIR:
                raise BadInput("the root entry must be a directory")
            self._apply_meta(self._root, entry)
            self._explicit.add(path)
            _drain_empty(data, path)
            return
        parent = self._parent_dir(path)
        name = entry.name
        existing = parent.children.get(name)  # type: ignore[union-attr]
        if existing is not None:
            if existing.kind is not Kind.DIR or entry.kind is not Kind.DIR:
                raise BadInput(f"{path!r}: already a directory of earlier entries; cannot be a {entry.kind.name}")
            self._apply_meta(existing, entry)
            self._explicit.add(path)
            _drain_empty(data, path)
            return
        node = Inode(entry.kind, path)
        self._apply_meta(node, entry)
        if entry.kind is Kind.REG:
            if entry.size < 0:
                raise BadInput(f"{path!r}: negative size")
            node.size = entry.size
            if data is None and entry.size:
                raise BadInput(f"{path!r}: {entry.size} bytes announced but no data given")
            self._store_file(node, data or (), path)
        else:
            _drain_empty(data, path)
            if entry.kind is Kind.SYMLINK:
                self._store_symlink(node, entry.symlink, path)
            elif entry.kind in (Kind.CHR, Kind.BLK):
                node.rdev = fmt.encode_dev(*entry.rdev)
        parent.children[name] = node  # type: ignore[index]
        self._explicit.add(path)
        self._paths += 1

    def _add_hardlink(self, path: bytes, target_path: bytes) -> None:
        target = self._lookup(target_path)
        if target is None or target_path not in self._explicit:
            raise BadInput(f"{path!r}: hard link to missing {target_path!r}")
        if target.kind is Kind.DIR:
            raise BadInput(f"{path!r}: hard link to directory {target_path!r}")
        if path == b"":
            raise BadInput("the root cannot be a hard link")
        parent = self._parent_dir(path)
        name = path.rpartition(b"/")[2]
        if name in parent.children:  # type: ignore[operator]
            raise BadInput(f"{path!r}: already a directory of earlier entries; cannot be a hard link")
        parent.children[name] = target  # type: ignore[index]
        target.nlink += 1
        self._explicit.add(path)
        self._paths += 1

    def _lookup(self, path: bytes) -> Inode | None:
        node = self._root
        if path == b"":
            return node
        for comp in path.split(b"/"):
            if node.children is None:
                return None
            nxt = node.children.get(comp)
            if nxt is None:
                return None
            node = nxt
        return node

    def _parent_dir(self, path: bytes) -> Inode:
        node = self._root
        parent = path.rpartition(b"/")[0]
        if not parent:
            return node
        done = []
        for comp in parent.split(b"/"):
            done.append(comp)
            nxt = node.children.get(comp)  # type: ignore[union-attr]
            if nxt is None:
                nxt = Inode(Kind.DIR, b"/".join(done))
                nxt.mtime = self._clamp or 0
                node.children[comp] = nxt  # type: ignore[index]
                self._paths += 1
            elif nxt.kind is not Kind.DIR:
                raise BadInput(f"{path!r}: ancestor {b'/'.join(done)!r} is a {nxt.kind.name}, not a directory")
            node = nxt
        return node

    def _apply_meta(self, node: Inode, e: Entry) -> None:
        where = e.path
        if e.mode & ~0o7777:
            raise BadInput(f"{where!r}: mode {e.mode:#o} has bits beyond the permission bits")
        node.mode = e.mode
        uid, gid = (0, 0) if self._all_root else (e.uid, e.gid)
        if not (0 <= uid < 1 << 32 and 0 <= gid < 1 << 32):
            raise BadInput(f"{where!r}: owner {uid}:{gid} out of range")
        node.uid, node.gid = uid, gid
        mtime, nsec = e.mtime, e.mtime_nsec
        if not 0 <= nsec < 1_000_000_000:
            raise BadInput(f"{where!r}: mtime nanoseconds {nsec} out of range")
        if self._clamp is not None and (mtime, nsec) > (self._clamp, 0):
            mtime, nsec = self._clamp, 0
        if not 0 <= mtime < 1 << 63:
            raise BadInput(f"{where!r}: mtime {mtime} cannot be stored (before 1970?)")
        node.mtime, node.nsec = mtime, nsec
        for name in e.xattrs:
            try:
                fmt.split_xattr_name(name)
            except BadInput as err:
                raise BadInput(f"{where!r}: {err}") from None
            if len(e.xattrs[name]) > 0xFFFF:
                raise BadInput(f"{where!r}: xattr {name!r} value too large")
        node.xattrs = dict(e.xattrs)

    def finish(self) -> ImageLayout:
        """Write the metadata and the superblock; the image is complete afterwards."""
        if self._finished:
            raise BadInput("image writer already finished")
        self._finished = True
        return _finish_image(self)

    # -- data -----------------------------------------------------------------------------
    def _inline_room(self, node: Inode) -> int:
        """Bytes left in one block after the inode and all its xattrs inline (worst case)."""
        x = 0
        if node.xattrs:
            x = fmt.XATTR_IBODY_HEADER + sum(
                len(fmt.xattr_entry(*fmt.split_xattr_name(k), v)) for k, v in node.xattrs.items())
        return BS - fmt.EXTENDED_SIZE - x

    def _write(self, buf: bytes | bytearray | memoryview) -> None:
        self._out.write(buf)
        self._cur.update(buf)
        self._pos += len(buf)

    def _end_extent(self, offset: int, length: int) -> None:
        """Record the data run just written; its digest is its content hint and feeds the UUID."""
        digest = self._cur.digest()
        self._cur = blake3.blake3()
        self._digests.append(digest)
        self._extents.append(DataExtent(offset, length, int.from_bytes(digest[:4], "little")))

    def _store_symlink(self, node: Inode, target: bytes | None, path: bytes) -> None:
        if not target:
            raise BadInput(f"{path!r}: symlink without a target")
        if b"\0" in target or len(target) >= PATH_MAX:
            raise BadInput(f"{path!r}: bad symlink target")
        node.symlink = target
        node.size = len(target)
        if len(target) <= self._inline_room(node):
            node.inline = target
            node.layout = fmt.LAYOUT_FLAT_INLINE
        else:
            node.blkaddr = self._pos // BS
            self._write(target + _ZEROS[: (-len(target)) % BS])
            self._end_extent(node.blkaddr * BS, fmt.align(len(target), BS))

    def _store_file(self, node: Inode, data: Data, path: bytes) -> None:
        size = node.size
        if size == 0:
            _drain_empty(data, path)
            return
        room = self._inline_room(node)
        if size < BS and size <= room:
            buf = bytearray()
            for item in data:
                if isinstance(item, Hole):
                    buf += bytes(item.length)
                else:
                    buf += item
                if len(buf) > size:
                    break
            if len(buf) != size:
                raise BadInput(f"{path!r}: data is {len(buf)}+ bytes, entry says {size}")
            node.inline = bytes(buf)
            node.layout = fmt.LAYOUT_FLAT_INLINE
            return
        _FileSink(self, node, path, room if self._pack_tails else -1).run(data)


class _FileSink:
    """Streams one regular file into the data area as block-aligned runs; whole blocks of zeros
    that arrive as `Hole`s are not stored."""

    def __init__(self, w: ImageWriter, node: Inode, path: bytes, tail_room: int) -> None:
        self.w, self.node, self.path, self.tail_room = w, node, path, tail_room
        self.runs: list[tuple[int, int, int]] = []  # (file offset, image offset, stored length)
        self.run_file = -1  # file offset of the open run, -1 if none
        self.run_img = 0
        self.written = 0  # bytes of the open run already in the image
        self.pending = bytearray()

    def _end(self) -> int:
        return self.run_file + self.written + len(self.pending)

    def _open(self, pos: int) -> None:
        self.run_file = pos - pos % BS
        self.run_img = self.w._pos
        self.written = 0
        self.pending = bytearray(pos % BS)

    def _flush(self, keep_tail: bool = False) -> None:
        n = len(self.pending) // BS * BS if keep_tail else len(self.pending)
        if not n:
            return
        self.w._write(memoryview(self.pending)[:n])
        self.written += n
        del self.pending[:n]

    def _close(self) -> None:
        pad = (-len(self.pending)) % BS
        self.pending += _ZEROS[:pad]
        self._flush()
        self.runs.append((self.run_file, self.run_img, self.written))
        self.w._end_extent(self.run_img, self.written)
        self.run_file = -1

    def run(self, data: Data) -> None:
        pos = 0
        size = self.node.size
        for item in data:
            if isinstance(item, Hole):
                if item.length < 0:
                    raise BadInput(f"{self.path!r}: negative hole")
                pos += item.length
                continue
            n = len(item)
            if not n:
                continue
            if pos + n > size:
                raise BadInput(f"{self.path!r}: data is longer than the entry's size {size}")
            if self.run_file < 0:
                self._open(pos)
            else:
                end = self._end()
                if pos > end:
                    if pos - pos % BS > fmt.align(end, BS):  # a whole block of zeros: leave it out
                        self._close()
                        self._open(pos)
                    else:
                        self.pending += bytes(pos - end)
            self.pending += item
            pos += n
            if len(self.pending) >= _FLUSH:
                self._flush(keep_tail=True)
        if pos != size:
            raise BadInput(f"{self.path!r}: data is {pos} bytes, entry says {size}")
        node = self.node
        whole = self.run_file == 0 and not self.runs and fmt.align(self._end(), BS) >= size
        if whole:
            self.pending += bytes(size - self._end())
            tail = size % BS
            if 0 < tail <= self.tail_room:
                self._flush(keep_tail=True)
                node.inline = bytes(self.pending)
                node.layout = fmt.LAYOUT_FLAT_INLINE
                node.blkaddr = self.run_img // BS
                if self.written:
                    self.w._end_extent(self.run_img, self.written)
                return
            self._close()
            node.blkaddr = self.run_img // BS
            return
        if self.run_file >= 0:
            self._close()
        self._chunk_map()

    def _chunk_map(self) -> None:
        node = self.node
        size = node.size
        bits = _best_chunk_bits(self.runs, size, _readable(self.w._out))
        chunk = BS << bits
        nchunks = (size + chunk - 1) // chunk
        runs = self.runs
        if any(f % chunk or (f + n < size and (f + n) % chunk) for f, _i, n in runs):
            runs = self._relayout(chunk)
        blockmap = [fmt.NULL_ADDR] * nchunks
        for f_off, img, length in runs:
            for c in range(f_off // chunk, min(nchunks, (f_off + length + chunk - 1) // chunk)):
                blockmap[c] = (img + c * chunk - f_off) // BS
        node.layout = fmt.LAYOUT_CHUNK_BASED
        node.chunkbits = bits
        node.blockmap = blockmap

    def _relayout(self, chunk: int) -> list[tuple[int, int, int]]:
        """Rewrite this file's runs (the last thing in the data area) as whole chunks, so the
        block map can use bigger chunks. Only done for runs small enough to hold in memory."""
        w = self.w
        start = self.runs[0][1]
        out = w._out
        out.flush()
        pieces = []
        for f_off, img, length in self.runs:
            out.seek(img)
            pieces.append((f_off, out.read(length)))
        del w._extents[-len(self.runs):]
        del w._digests[-len(self.runs):]
        out.seek(start)
        w._pos = start
        size = self.node.size
        new_runs: list[tuple[int, int, int]] = []
        chunks: dict[int, bytearray] = {}
        for f_off, data in pieces:
            for c in range(f_off // chunk, (f_off + len(data) + chunk - 1) // chunk):
                lo = max(f_off, c * chunk)
                hi = min(f_off + len(data), (c + 1) * chunk)
                buf = chunks.setdefault(c, bytearray(min(chunk, fmt.align(size - c * chunk, BS))))
                buf[lo - c * chunk:hi - c * chunk] = data[lo - f_off:hi - f_off]
        for c in sorted(chunks):
            if new_runs and new_runs[-1][0] + new_runs[-1][2] == c * chunk:
                f, i, n = new_runs[-1]
                new_runs[-1] = (f, i, n + len(chunks[c]))
            else:
                if new_runs:
                    w._end_extent(new_runs[-1][1], new_runs[-1][2])
                new_runs.append((c * chunk, w._pos, len(chunks[c])))
            w._write(chunks[c])
        if new_runs:
            w._end_extent(new_runs[-1][1], new_runs[-1][2])
        return new_runs


_RELAYOUT_MAX = 64 << 20


def _readable(out: BinaryIO) -> bool:
    try:
        return out.readable()
    except (AttributeError, ValueError):
        return False


def _best_chunk_bits(runs: list[tuple[int, int, int]], size: int, can_rewrite: bool) -> int:
    """The chunk size (as blkbits) that minimises stored bytes plus block-map bytes. Chunks
    bigger than the runs' own alignment store some zeros; that is allowed only while the
    file's stored data is small enough to be rewritten from memory."""
    stored = sum(n for _f, _i, n in runs)
    native = 31
    for f_off, _img, length in runs:
        for edge in (f_off, f_off + length):
            if edge < size:
                while native and edge % (BS << native):
                    native -= 1
    best, best_cost = 0, None
    for bits in range(32):
        chunk = BS << bits
        if bits > native and (stored > _RELAYOUT_MAX or not can_rewrite):
            break
        used = set()
        for f_off, _img, length in runs:
            used.update(range(f_off // chunk, (f_off + length + chunk - 1) // chunk))
        nchunks = (size + chunk - 1) // chunk
        cost = 4 * nchunks + sum(min(chunk, fmt.align(size - c * chunk, BS)) for c in used)
        if best_cost is None or cost < best_cost:
            best, best_cost = bits, cost
        if nchunks == 1:
            break
    return best


def _drain_empty(data: Data | None, path: bytes) -> None:
    if data is None:
        return
    for item in data:
        if isinstance(item, Hole) and item.length == 0:
            continue
        if not isinstance(item, Hole) and not len(item):
            continue
        raise BadInput(f"{path!r}: data given for an entry that holds none")


def walk(root: Inode) -> Iterator[tuple[Inode, Inode]]:
    """(inode, parent directory) in depth-first order, names sorted; each inode once."""
    seen: set[int] = set()
    yield root, root
    seen.add(id(root))
    stack = [(root, iter(sorted(root.children.items())))]  # type: ignore[union-attr]
    while stack:
        parent, it = stack[-1]
        for _name, child in it:
            if id(child) in seen:
                continue
            seen.add(id(child))
            yield child, parent
            if child.children is not None:
                stack.append((child, iter(sorted(child.children.items()))))
            break
        else:
            stack.pop()


def build_time_of(nodes: list[Inode]) -> tuple[int, int]:
    """The most common (mtime, nsec): those inodes can be compact. Ties go to the earliest."""
    counts = Counter((n.mtime, n.nsec) for n in nodes)
    best = max(counts.values())
    return min(k for k, v in counts.items() if v == best)




# -- metadata ---------------------------------------------------------------------------------
_FTYPE = {Kind.REG: fmt.FT_REG, Kind.DIR: fmt.FT_DIR, Kind.CHR: fmt.FT_CHR, Kind.BLK: fmt.FT_BLK,
          Kind.FIFO: fmt.FT_FIFO, Kind.SOCK: fmt.FT_SOCK, Kind.SYMLINK: fmt.FT_SYMLINK}
# stable groups: content-defined, between MIN and MAX bytes, about TARGET on average
GROUP_MIN, GROUP_TARGET, GROUP_MAX = 16 << 10, 64 << 10, 256 << 10


class _Rec:
    __slots__ = ("node", "parent", "extended", "xbody", "extra", "total", "pos", "names", "raw")

    def __init__(self, node: Inode, parent: Inode) -> None:
        self.node, self.parent = node, parent
        self.pos = 0
        self.names: list[bytes] = []
        self.raw = b""


def _shared_xattrs(nodes: list[Inode]) -> tuple[bytes, dict[tuple[bytes, bytes], int]]:
    """(name, value) pairs that more than one inode carries go to the shared area once."""
    counts = Counter((k, v) for n in nodes for k, v in n.xattrs.items())
    area = bytearray()
    ids: dict[tuple[bytes, bytes], int] = {}
    for (k, v) in sorted(kv for kv, c in counts.items() if c > 1):
        ids[(k, v)] = len(area) // 4
        area += fmt.xattr_entry(*fmt.split_xattr_name(k), v)
    return bytes(area), ids


def _xattr_body(node: Inode, ids: dict[tuple[bytes, bytes], int]) -> bytes:
    items = sorted(node.xattrs.items())
    shared = sorted(ids[kv] for kv in items if kv in ids)[: fmt.MAX_SHARED_PER_INODE]
    chosen = set(shared)
    inline = [fmt.xattr_entry(*fmt.split_xattr_name(k), v) for k, v in items
              if ids.get((k, v)) not in chosen]
    return fmt.xattr_ibody(shared, inline)


class _Packer:
    """First-fit placement of inode records into blocks. A record never straddles a block
    unless it is bigger than one (then it starts on a block); inline data therefore never
    crosses a block boundary. Only the last few blocks stay open, which keeps it linear."""

    OPEN = 32

    def __init__(self, start: int) -> None:
        self.end = start  # block aligned: end of the blocks handed out so far
        self.open: list[list[int]] = []  # [block start, bytes used (32-aligned)]

    def place(self, total: int) -> int:
        if total > BS:
            pos = self.end
            self.end += fmt.align(total, BS)
            if total % BS:
                self.open.append([self.end - BS, fmt.align(total % BS, fmt.ISLOT)])
            return pos
        for blk in self.open:
            if blk[1] + total <= BS:
                pos = blk[0] + blk[1]
                blk[1] = fmt.align(blk[1] + total, fmt.ISLOT)
                return pos
        pos = self.end
        self.end += BS
        self.open.append([pos, fmt.align(total, fmt.ISLOT)])
        if len(self.open) > self.OPEN:
            self.open.pop(0)
        return pos

    def close(self) -> int:
        self.open.clear()
        return self.end


def _pack(rec: _Rec, nid_of: dict[int, int], i_u: int, ino: int) -> bytes:
    n = rec.node
    head = fmt.pack_inode(extended=rec.extended, layout=n.layout, xattr_icount=fmt.xattr_icount(len(rec.xbody)),
                          mode=n.kind.value | n.mode, nlink=n.nlink, size=n.size, i_u=i_u, ino=ino,
                          uid=n.uid, gid=n.gid, mtime=n.mtime, mtime_nsec=n.nsec)
    if n.layout == fmt.LAYOUT_CHUNK_BASED:
        extra = b"".join(x.to_bytes(4, "little") for x in n.blockmap)
    elif n.kind is Kind.DIR:
        extra = b""
        if n.layout == fmt.LAYOUT_FLAT_INLINE:
            extra = _dir_bytes(rec, nid_of)
    else:
        extra = n.inline
    return head + rec.xbody + extra


def _dir_bytes(rec: _Rec, nid_of: dict[int, int]) -> bytes:
    n = rec.node
    ents = []
    for name in rec.names:
        if name == b".":
            ents.append((name, nid_of[id(n)], fmt.FT_DIR))
        elif name == b"..":
            ents.append((name, nid_of[id(rec.parent)], fmt.FT_DIR))
        else:
            child = n.children[name]  # type: ignore[index]
            ents.append((name, nid_of[id(child)], _FTYPE[child.kind]))
    return fmt.pack_dir(ents)


def _finish_image(w: ImageWriter) -> ImageLayout:
    pairs = list(walk(w._root))
    nodes = [n for n, _ in pairs]
    bt = build_time_of(nodes)
    for n in nodes:
        if n.children is not None:
            n.nlink = 2 + sum(1 for c in n.children.values() if c.kind is Kind.DIR)
    area, ids = _shared_xattrs(nodes)
    recs = []
    for node, parent in pairs:
        rec = _Rec(node, parent)
        rec.extended = (node.size >= 1 << 32 or node.uid > 0xFFFF or node.gid > 0xFFFF or node.nlink > 0xFFFF
                        or (node.mtime, node.nsec) != bt)
        rec.xbody = _xattr_body(node, ids)
        isize = fmt.EXTENDED_SIZE if rec.extended else fmt.COMPACT_SIZE
        if node.children is not None:
            rec.names = sorted([*node.children, b".", b".."])
            node.size = fmt.dir_size(rec.names)
            inline = isize + len(rec.xbody) + node.size <= BS
            node.layout = fmt.LAYOUT_FLAT_INLINE if inline else fmt.LAYOUT_FLAT_PLAIN
            rec.extra = node.size if inline else 0
        elif node.layout == fmt.LAYOUT_CHUNK_BASED:
            rec.extra = 4 * len(node.blockmap)
        else:
            rec.extra = len(node.inline)
        rec.total = isize + len(rec.xbody) + rec.extra
        recs.append(rec)

    meta_start = w._pos
    segments: list[MetaSegment] = []
    nid_of: dict[int, int] = {}
    volatile = [r for r in recs if r.node.has_address]
    stable = [r for r in recs if not r.node.has_address]
    packer = _Packer(0)
    for rec in volatile:  # the root comes first: its nid must fit 16 bits
        rec.pos = packer.place(rec.total)
    cursor = packer.close()
    segments.append(MetaSegment(meta_start, cursor, False))
    group: list[_Rec] = []
    glen = 0
    for i, rec in enumerate(stable):
        rec.raw = _pack(rec, nid_of, rec.node.rdev, 0)
        crc = zlib.crc32(rec.raw)
        rec.raw = _pack(rec, nid_of, rec.node.rdev, crc)
        group.append(rec)
        glen += fmt.align(rec.total, fmt.ISLOT)
        last = i == len(stable) - 1
        cut_here = glen >= GROUP_MIN and crc < len(rec.raw) / (GROUP_TARGET - GROUP_MIN) * (1 << 32)
        if last or glen >= GROUP_MAX or cut_here:
            # first-fit decreasing inside the group: dense, and still a function of the group alone
            packer = _Packer(cursor)
            for r in sorted(group, key=lambda r: -r.total):
                r.pos = packer.place(r.total)
            end = packer.close()
            segments.append(MetaSegment(meta_start + cursor, end - cursor, True))
            cursor = end
            group, glen = [], 0
    tail_start = cursor
    for rec in recs:
        nid_of[id(rec.node)] = rec.pos // fmt.ISLOT
    dir_blocks: list[tuple[int, _Rec]] = []
    for rec in volatile:
        if rec.node.kind is Kind.DIR and rec.node.layout == fmt.LAYOUT_FLAT_PLAIN:
            dir_blocks.append((cursor, rec))
            cursor += fmt.align(rec.node.size, BS)
    xattr_blkaddr = (meta_start + cursor) // BS if area else 0
    cursor = fmt.align(cursor + len(area), BS)
    if cursor > tail_start:
        segments.append(MetaSegment(meta_start + tail_start, cursor - tail_start, False))

    meta = bytearray(cursor)
    dir_addr = {id(rec): (meta_start + off) // BS for off, rec in dir_blocks}
    for ino, rec in enumerate(volatile, 1):
        n = rec.node
        if n.layout == fmt.LAYOUT_CHUNK_BASED:
            i_u = n.chunkbits
        elif n.kind is Kind.DIR:
            i_u = dir_addr.get(id(rec), 0)
        else:
            i_u = n.blkaddr
        rec.raw = _pack(rec, nid_of, i_u, ino)
    for rec in recs:
        meta[rec.pos:rec.pos + len(rec.raw)] = rec.raw
    for off, rec in dir_blocks:
        data = _dir_bytes(rec, nid_of)
        meta[off:off + len(data)] = data
    if area:
        off = xattr_blkaddr * BS - meta_start
        meta[off:off + len(area)] = area

    size = meta_start + len(meta)
    h = blake3.blake3(b"layerstore-erofs-v1\0")
    h.update(b"".join(w._digests))
    h.update(meta)
    uuid = bytearray(h.digest()[:16])
    uuid[6] = (uuid[6] & 0x0F) | 0x80  # RFC 9562 version 8 (custom), variant 10
    uuid[8] = (uuid[8] & 0x3F) | 0x80
    chunked = any(n.layout == fmt.LAYOUT_CHUNK_BASED for n in nodes)
    sb = fmt.pack_superblock(root_nid=nid_of[id(w._root)], inos=len(nodes), build_time=bt[0], build_time_nsec=bt[1],
                             blocks=size // BS, meta_blkaddr=meta_start // BS, xattr_blkaddr=xattr_blkaddr,
                             uuid=bytes(uuid), feature_incompat=fmt.FEATURE_INCOMPAT_CHUNKED_FILE if chunked else 0)
    out = w._out
    out.seek(meta_start)
    out.write(meta)
    block0 = bytearray(BS)
    block0[fmt.SUPER_OFFSET:fmt.SUPER_OFFSET + len(sb)] = sb
    out.seek(0)
    out.write(block0)
    out.truncate(size)
    out.flush()
    return ImageLayout(size=size, data_start=BS, data_end=meta_start, extents=tuple(w._extents),
                       meta=tuple(segments), files=w._paths)
