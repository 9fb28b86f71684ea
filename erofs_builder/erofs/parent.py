"""Read a parent image: what a build needs to keep its addresses (see docs/erofs-builder.md).

A parent is an image this builder wrote, together with its chunk map (the chunk boundaries are
what must be repeated for its chunks to be shared; they cannot be recomputed from the image
once it has a parent of its own). `read_parent` walks its metadata from the superblock the way
the kernel would and returns a `ParentImage`:

- the data area's end, and every live run of data that a new file may share by content
  (whole-file runs, tail-packed heads, symlink blocks, directory blocks, the shared xattrs):
  (blake3, length) -> image offset;
- for the metadata, a `ParentMeta`: the area's bytes, every live record's slot by path, the
  build time, the shared xattr area and its ids, the metadata chunks;
- the parent's data chunks, and how many bytes of its data area nothing references any more.

Only images laid out by this builder are accepted (large directories and the shared xattrs in
the data area, records in the metadata area); anything else is a `BadInput`.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import blake3

from layerstore.chunkmap import ChunkRef
from layerstore.errors import BadInput

from ..chunking import SLICE, Cut
from . import format as fmt
from .metadata import ParentMeta, Slot
from .runhash import run_key

BS = fmt.BLOCK_SIZE
_CHUNK_INDEXES = 0x20
_READ = 1 << 20
_PREFIX_OF = {index: (prefix, whole) for prefix, index, whole in fmt.XATTR_PREFIXES}


@dataclass(frozen=True)
class ParentImage:
    path: Path
    size: int
    data_end: int  # the parent's meta_blkaddr * block size
    runs: dict[tuple[bytes, int], int]  # (blake3, length) of shareable runs -> image offset
    meta: ParentMeta
    data_cuts: tuple[Cut, ...]  # the parent's chunks of [block size, data_end)
    dead_data: int  # bytes of the data area that no live inode references
    # regular files' stored blocks by path: (first block index in the file, image block, count)
    files: dict[bytes, tuple[tuple[int, int, int], ...]] = field(default_factory=dict)

    def blocks_of(self, path: bytes) -> list[int] | None:
        """The image block of each of the parent's blocks of the file at `path` (NULL_ADDR
        for a hole), or None if it has no such file with stored blocks."""
        runs = self.files.get(path)
        if not runs:
            return None
        out = [fmt.NULL_ADDR] * max(first + n for first, _b, n in runs)
        for first, blk, n in runs:
            out[first:first + n] = range(blk, blk + n)
        return out


@dataclass(slots=True)
class _Ino:
    nid: int
    mode: int
    layout: int
    size: int
    i_u: int
    total: int  # record length: inode, xattrs, inline data or block map
    shared: list[int]


class _Reader:
    def __init__(self, fd: int, data_end: int, size: int, where: str) -> None:
        self.fd, self.data_end, self.size, self.where = fd, data_end, size, where
        self.meta = self.read(data_end, size - data_end)

    def read(self, offset: int, length: int) -> bytes:
        out = bytearray()
        while len(out) < length:
            buf = os.pread(self.fd, min(length - len(out), _READ), offset + len(out))
            if not buf:
                raise self.bad("shorter than its superblock says")
            out += buf
        return bytes(out)

    def bad(self, why: str) -> BadInput:
        return BadInput(f"parent image {self.where}: {why}")

    def inode(self, nid: int) -> _Ino:
        pos = nid * fmt.ISLOT
        if pos + fmt.COMPACT_SIZE > len(self.meta):
            raise self.bad(f"nid {nid} lies outside the metadata area")
        i_format = int.from_bytes(self.meta[pos:pos + 2], "little")
        layout = (i_format >> 1) & 0x7
        if i_format & 1:
            if pos + fmt.EXTENDED_SIZE > len(self.meta):
                raise self.bad(f"nid {nid} lies outside the metadata area")
            _f, xcount, mode, _r, size, i_u, *_rest = fmt.EXTENDED_INODE.unpack_from(self.meta, pos)
            isize = fmt.EXTENDED_SIZE
        else:
            _f, xcount, mode, _nlink, size, _r, i_u, *_rest = fmt.COMPACT_INODE.unpack_from(self.meta, pos)
            isize = fmt.COMPACT_SIZE
        xsize = fmt.XATTR_IBODY_HEADER + (xcount - 1) * 4 if xcount else 0
        shared: list[int] = []
        if xsize:
            if pos + isize + xsize > len(self.meta):
                raise self.bad(f"xattrs of nid {nid} run past the metadata area")
            count = self.meta[pos + isize + 4]
            shared = [int.from_bytes(self.meta[pos + isize + 12 + 4 * i:pos + isize + 16 + 4 * i], "little")
                      for i in range(count)]
        if layout == fmt.LAYOUT_FLAT_INLINE:
            extra = size - (fmt.blocks_of(size) - 1) * BS if size else 0
        elif layout == fmt.LAYOUT_CHUNK_BASED:
            if i_u & _CHUNK_INDEXES:
                raise self.bad(f"nid {nid}: chunk indexes are not written by this builder")
            chunk = BS << (i_u & fmt.CHUNK_BLKBITS_MASK)
            extra = 4 * ((size + chunk - 1) // chunk)
        elif layout == fmt.LAYOUT_FLAT_PLAIN:
            extra = 0
        else:
            raise self.bad(f"nid {nid}: data layout {layout} is not written by this builder")
        total = isize + xsize + extra
        if pos + total > len(self.meta):
            raise self.bad(f"nid {nid} runs past the metadata area")
        return _Ino(nid, mode, layout, size, i_u, total, shared)

    def tail(self, ino: _Ino) -> bytes:
        """The inline part of a record (inline data, inline dirents, or the block map)."""
        end = ino.nid * fmt.ISLOT + ino.total
        n = ino.size - (fmt.blocks_of(ino.size) - 1) * BS if ino.layout == fmt.LAYOUT_FLAT_INLINE else 0
        if ino.layout == fmt.LAYOUT_CHUNK_BASED:
            chunk = BS << (ino.i_u & fmt.CHUNK_BLKBITS_MASK)
            n = 4 * ((ino.size + chunk - 1) // chunk)
        return self.meta[end - n:end]

    def check(self, blkaddr: int, length: int) -> int:
        start = blkaddr * BS
        if not (start >= BS and start + length <= self.data_end):
            raise self.bad(f"blocks {blkaddr}+{fmt.blocks_of(length)} lie outside the data area")
        return start

    def data(self, blkaddr: int, length: int) -> bytes:
        return self.read(self.check(blkaddr, length), length)

    def run_key(self, blkaddr: int, length: int) -> bytes:
        """The run's identity as the writer computes it (runhash.RunHasher)."""
        start = self.check(blkaddr, length)
        return run_key([blake3.blake3(self.read(start + off, min(SLICE, length - off))).digest()
                        for off in range(0, length, SLICE)])

    def dirents(self, ino: _Ino) -> Iterator[tuple[bytes, int, int]]:
        if ino.layout == fmt.LAYOUT_FLAT_INLINE:
            raw = self.tail(ino)
        elif ino.layout == fmt.LAYOUT_FLAT_PLAIN:
            raw = self.data(ino.i_u, ino.size)
        else:
            raise self.bad(f"directory nid {ino.nid} has layout {ino.layout}")
        for off in range(0, len(raw), BS):
            blk = raw[off:off + BS]
            if len(blk) < fmt.DIRENT_SIZE:
                raise self.bad(f"directory nid {ino.nid} is truncated")
            count = fmt.DIRENT.unpack_from(blk, 0)[1] // fmt.DIRENT_SIZE
            if not 0 < count <= len(blk) // fmt.DIRENT_SIZE:
                raise self.bad(f"directory nid {ino.nid} has a corrupt block")
            heads = [fmt.DIRENT.unpack_from(blk, i * fmt.DIRENT_SIZE) for i in range(count)]
            for i, (nid, nameoff, ftype) in enumerate(heads):
                end = heads[i + 1][1] if i + 1 < count else len(blk)
                name = bytes(blk[nameoff:end])
                if i + 1 == count:
                    name = name.split(b"\0", 1)[0]
                if not name or b"/" in name or len(name) > fmt.NAME_LEN:
                    raise self.bad(f"directory nid {ino.nid} has a bad name {name[:40]!r}")
                yield name, nid, ftype


def read_parent(image: str | os.PathLike[str], refs: Sequence[ChunkRef | Cut]) -> ParentImage:
    """Read `image` (built by this builder) and its chunk map `refs`."""
    path = Path(image)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < BS:
            raise BadInput(f"parent image {path}: too small ({size} bytes)")
        return _read(f.fileno(), size, path, refs)


def _read(fd: int, size: int, path: Path, refs: Sequence[ChunkRef | Cut]) -> ParentImage:
    sb = os.pread(fd, fmt.SUPERBLOCK.size, fmt.SUPER_OFFSET).ljust(fmt.SUPERBLOCK.size, b"\0")
    (magic, _csum, _compat, blkbits, _ext, root_nid, _inos, bt, bt_nsec, blocks, meta_blkaddr, xattr_blkaddr,
     uuid, _vol, incompat, _u1) = fmt.SUPERBLOCK.unpack(sb)
    if magic != fmt.MAGIC or blkbits != fmt.BLOCK_BITS:
        raise BadInput(f"parent image {path}: not an EROFS image with 4 KiB blocks")
    if incompat & ~fmt.FEATURE_INCOMPAT_CHUNKED_FILE or blocks * BS != size or not 1 <= meta_blkaddr < blocks:
        raise BadInput(f"parent image {path}: not laid out by this builder")
    data_end = meta_blkaddr * BS
    r = _Reader(fd, data_end, size, str(path))
    slots_raw: list[tuple[int, int, bytes]] = []  # (pos, total, path)
    runs: dict[tuple[bytes, int], int] = {}
    live: list[tuple[int, int]] = []
    shared_ids: set[int] = set()
    files: dict[bytes, tuple[tuple[int, int, int], ...]] = {}

    def share(blkaddr: int, length: int) -> None:
        if length:
            runs.setdefault((r.run_key(blkaddr, length), length), blkaddr * BS)
            live.append((blkaddr * BS, length))

    def visit(ino: _Ino, where: bytes) -> None:
        slots_raw.append((ino.nid * fmt.ISLOT, ino.total, where))
        shared_ids.update(ino.shared)
        kind = stat.S_IFMT(ino.mode)
        if ino.layout == fmt.LAYOUT_CHUNK_BASED:
            chunk = BS << (ino.i_u & fmt.CHUNK_BLKBITS_MASK)
            blockmap = r.tail(ino)
            runs: list[tuple[int, int, int]] = []
            for c in range(len(blockmap) // 4):
                addr = int.from_bytes(blockmap[4 * c:4 * c + 4], "little")
                if addr != fmt.NULL_ADDR:
                    n = min(chunk, fmt.align(ino.size - c * chunk, BS))
                    r.check(addr, n)
                    live.append((addr * BS, n))
                    runs.append((c * chunk // BS, addr, n // BS))
            if kind == stat.S_IFREG and runs:
                files[where] = tuple(runs)
        elif kind in (stat.S_IFREG, stat.S_IFLNK, stat.S_IFDIR) and ino.size:
            stored = fmt.blocks_of(ino.size) - (ino.layout == fmt.LAYOUT_FLAT_INLINE)
            share(ino.i_u, stored * BS)
            if kind == stat.S_IFREG and stored:
                files[where] = ((0, ino.i_u, stored),)

    root = r.inode(root_nid)
    if not stat.S_ISDIR(root.mode):
        raise BadInput(f"parent image {path}: the root is not a directory")
    seen = {root_nid}
    visit(root, b"")
    stack: list[tuple[_Ino, bytes, Iterator[tuple[bytes, int]]]] = []

    def enter(d: _Ino, where: bytes) -> None:
        subdirs = []
        for name, nid, ftype in r.dirents(d):
            if name in (b".", b".."):
                continue
            child = where + b"/" + name if where else name
            if ftype == fmt.FT_DIR:
                subdirs.append((child, nid))
            elif nid not in seen:
                seen.add(nid)
                visit(r.inode(nid), child)
        stack.append((d, where, iter(subdirs)))

    enter(root, b"")
    while stack:
        for child, nid in stack[-1][2]:
            if nid in seen:
                raise BadInput(f"parent image {path}: directory {child!r} is reached twice")
            seen.add(nid)
            ino = r.inode(nid)
            if not stat.S_ISDIR(ino.mode):
                raise BadInput(f"parent image {path}: {child!r} is listed as a directory but is not one")
            visit(ino, child)
            enter(ino, child)
            break
        else:
            stack.pop()

    xattr_area, xattr_ids = _xattr_area(r, xattr_blkaddr, shared_ids)
    if xattr_area:
        share(xattr_blkaddr, fmt.align(len(xattr_area), BS))
    slots = _slots(slots_raw, r.meta)
    data_cuts, meta_cuts = _split_cuts(refs, data_end, size, path)
    meta = ParentMeta(area=r.meta, slots=slots, build_time=(bt, bt_nsec), xattr_area=xattr_area,
                      xattr_ids=xattr_ids, cuts=meta_cuts, uuid=bytes(uuid))
    return ParentImage(path=path, size=size, data_end=data_end, runs=runs, meta=meta, data_cuts=data_cuts,
                       dead_data=data_end - BS - _union(live), files=files)


def _slots(recs: list[tuple[int, int, bytes]], meta: bytes) -> dict[bytes, Slot]:
    """Each live record's room: up to the next live record, and within its block unless it
    already spans blocks (only records without inline data do)."""
    out: dict[bytes, Slot] = {}
    ordered = sorted(recs)
    for i, (pos, total, where) in enumerate(ordered):
        limit = ordered[i + 1][0] if i + 1 < len(ordered) else len(meta)
        if pos + total > limit:
            raise BadInput(f"parent image: records at {pos} and {limit} overlap")
        if pos % BS + total <= BS:
            limit = min(limit, pos - pos % BS + BS)
        out[where] = Slot(pos=pos, room=limit - pos, raw=bytes(meta[pos:pos + total]))
    return out


def _xattr_area(r: _Reader, blkaddr: int, ids: set[int]) -> tuple[bytes, dict[tuple[bytes, bytes], int]]:
    """The shared xattr entries up to the last one any live inode uses, and their ids."""
    if not ids:
        return b"", {}
    start = blkaddr * BS
    last = max(ids)
    off = 0
    found: dict[tuple[bytes, bytes], int] = {}
    starts: set[int] = set()
    while off // 4 <= last:
        if not BS <= start + off + 4 <= r.data_end:
            raise r.bad("shared xattrs run past the data area")
        name_len, index, value_len = fmt.XATTR_ENTRY.unpack(r.read(start + off, 4))
        if start + off + 4 + name_len + value_len > r.data_end:
            raise r.bad("shared xattrs run past the data area")
        body = r.read(start + off + 4, name_len + value_len)
        if index not in _PREFIX_OF:
            raise r.bad(f"shared xattr with name index {index}")
        prefix, whole = _PREFIX_OF[index]
        name = prefix if whole else prefix + body[:name_len]
        found.setdefault((name, body[name_len:]), off // 4)
        starts.add(off // 4)
        off += fmt.align(4 + name_len + value_len, 4)
    if not ids <= starts:
        raise r.bad("an inode names a shared xattr id that starts no entry")
    return r.read(start, off), found


def _split_cuts(refs: Sequence[ChunkRef | Cut], data_end: int, size: int,
                path: Path) -> tuple[tuple[Cut, ...], tuple[tuple[int, int], ...]]:
    data: list[Cut] = []
    meta: list[tuple[int, int]] = []
    pos = 0
    for ref in sorted(refs, key=lambda c: c.offset):
        if ref.offset != pos or (ref.offset < data_end < ref.offset + ref.length) or (
                ref.offset < BS < ref.offset + ref.length):
            raise BadInput(f"parent image {path}: its chunk map does not match the image")
        if BS <= ref.offset < data_end:
            data.append(Cut(ref.offset, ref.length, ref.flags))
        elif ref.offset >= data_end:
            meta.append((ref.offset - data_end, ref.length))
        pos = ref.offset + ref.length
    if pos != size:
        raise BadInput(f"parent image {path}: its chunk map covers {pos} of {size} bytes")
    return tuple(data), tuple(meta)


def _union(ranges: list[tuple[int, int]]) -> int:
    total = end = 0
    for start, length in sorted(ranges):
        if start + length <= end:
            continue
        total += start + length - max(start, end)
        end = start + length
    return total
