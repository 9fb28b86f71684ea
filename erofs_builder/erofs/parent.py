"""Read a parent image: what a build needs to keep its addresses (see docs/erofs-builder.md).

A parent is an image this builder wrote, together with its chunk map (the chunk boundaries are
what must be repeated for its chunks to be shared; they cannot be recomputed from the image
once it has a parent of its own). `read_parent` walks the image with the one image reader
(read.py), the way the kernel would, and returns a `ParentImage`:

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
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import blake3

from layerstore.chunkmap import ChunkRef
from layerstore.errors import BadInput

from ..chunking import SLICE, Cut
from ..tree import Kind
from . import format as fmt
from .metadata import ParentMeta, Slot
from .read import ImageReader, Node, in_write_order, walk
from .runhash import run_key

BS = fmt.BLOCK_SIZE
_READ = 1 << 20


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


class _File:
    """The parent image file; once its metadata area is known, that area is read once and
    served from memory."""

    def __init__(self, fd: int, where: str) -> None:
        self.fd, self.where = fd, where
        self.data_end = 0
        self.meta = b""

    def load_meta(self, data_end: int, size: int) -> None:
        self.meta = self.pread(data_end, size - data_end)
        self.data_end = data_end

    def pread(self, offset: int, length: int) -> bytes:
        out = bytearray()
        while len(out) < length:
            buf = os.pread(self.fd, min(length - len(out), _READ), offset + len(out))
            if not buf:
                raise BadInput(f"parent image {self.where}: shorter than its superblock says")
            out += buf
        return bytes(out)

    def read(self, offset: int, length: int) -> bytes:
        """What the image reader reads: the metadata area from memory."""
        if self.data_end and offset >= self.data_end:
            return self.meta[offset - self.data_end:offset - self.data_end + length]
        return self.pread(offset, length)

    def check(self, blkaddr: int, length: int) -> int:
        start = blkaddr * BS
        if not (start >= BS and start + length <= self.data_end):
            raise BadInput(f"parent image {self.where}: blocks {blkaddr}+{fmt.blocks_of(length)} lie outside the "
                           "data area")
        return start

    def run_key(self, blkaddr: int, length: int) -> bytes:
        """The run's identity as the writer computes it (runhash.RunHasher)."""
        start = self.check(blkaddr, length)
        return run_key([blake3.blake3(self.pread(start + off, min(SLICE, length - off))).digest()
                        for off in range(0, length, SLICE)])


def read_parent(image: str | os.PathLike[str], refs: Sequence[ChunkRef | Cut]) -> ParentImage:
    """Read `image` (built by this builder) and its chunk map `refs`."""
    path = Path(image)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < BS:
            raise BadInput(f"parent image {path}: too small ({size} bytes)")
        return _read(f.fileno(), size, path, refs)


def _read(fd: int, size: int, path: Path, refs: Sequence[ChunkRef | Cut]) -> ParentImage:
    f = _File(fd, str(path))
    img = ImageReader(f.read, size, str(path), "parent image")
    sb = img.sb
    if sb.blocks * BS != size or not 1 <= sb.meta_blkaddr < sb.blocks:
        raise BadInput(f"parent image {path}: not laid out by this builder")
    data_end = sb.meta_blkaddr * BS
    f.load_meta(data_end, size)
    live = _Live(f)
    slots_raw: list[tuple[int, int, bytes]] = []  # (pos, record length, path)
    shared_ids: set[int] = set()
    seen: set[int] = set()
    for where, node in in_write_order(walk(img)):
        if node.nid in seen:
            continue  # a hard link: its record is under its first path
        seen.add(node.nid)
        slots_raw.append((node.nid * fmt.ISLOT, node.record, where))
        shared_ids.update(node.shared)
        live.visit(node, where)
    xattr_area, xattr_ids = _xattr_area(img, data_end, shared_ids)
    if xattr_area:
        live.share(sb.xattr_blkaddr, fmt.align(len(xattr_area), BS))
    slots = _slots(slots_raw, f.meta)
    data_cuts, meta_cuts = _split_cuts(refs, data_end, size, path)
    meta = ParentMeta(area=f.meta, slots=slots, build_time=(sb.build_time, sb.build_nsec), xattr_area=xattr_area,
                      xattr_ids=xattr_ids, cuts=meta_cuts, uuid=sb.uuid)
    return ParentImage(path=path, size=size, data_end=data_end, runs=live.runs, meta=meta, data_cuts=data_cuts,
                       dead_data=data_end - BS - _union(live.ranges), files=live.files)


class _Live:
    """What the parent's live inodes hold in its data area: the runs a new file may share by
    content, every referenced range, and each regular file's stored blocks."""

    def __init__(self, f: _File) -> None:
        self.f = f
        self.runs: dict[tuple[bytes, int], int] = {}
        self.ranges: list[tuple[int, int]] = []
        self.files: dict[bytes, tuple[tuple[int, int, int], ...]] = {}

    def share(self, blkaddr: int, length: int) -> None:
        if length:
            self.runs.setdefault((self.f.run_key(blkaddr, length), length), blkaddr * BS)
            self.ranges.append((blkaddr * BS, length))

    def visit(self, node: Node, where: bytes) -> None:
        if node.layout == fmt.LAYOUT_CHUNK_BASED:
            if node.chunk_indexes:
                raise BadInput(f"parent image {self.f.where}: nid {node.nid}: chunk indexes are not written by "
                               "this builder")
            chunk = 1 << node.chunkbits
            runs: list[tuple[int, int, int]] = []
            for c, addr in enumerate(node.chunks):
                if addr != fmt.NULL_ADDR:
                    n = min(chunk, fmt.align(node.size - c * chunk, BS))
                    self.f.check(addr, n)
                    self.ranges.append((addr * BS, n))
                    runs.append((c * chunk // BS, addr, n // BS))
            if node.kind is Kind.REG and runs:
                self.files[where] = tuple(runs)
        elif node.kind in (Kind.REG, Kind.SYMLINK, Kind.DIR) and node.size:
            stored = node.stored_blocks
            self.share(node.blkaddr, stored * BS)
            if node.kind is Kind.REG and stored:
                self.files[where] = ((0, node.blkaddr, stored),)


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


def _xattr_area(img: ImageReader, data_end: int, ids: set[int]) -> tuple[bytes, dict[tuple[bytes, bytes], int]]:
    """The shared xattr entries up to the last one any live inode uses, and their ids."""
    if not ids:
        return b"", {}
    start = img.sb.xattr_blkaddr * BS
    last = max(ids)
    off = 0
    found: dict[tuple[bytes, bytes], int] = {}
    starts: set[int] = set()
    while off // 4 <= last:
        if not BS <= start + off + fmt.XATTR_ENTRY.size <= data_end:
            raise img.bad("shared xattrs run past the data area")
        kv, length = img.shared_xattr(off // 4)
        if start + off + length > data_end:
            raise img.bad("shared xattrs run past the data area")
        found.setdefault(kv, off // 4)
        starts.add(off // 4)
        off += length
    if not ids <= starts:
        raise img.bad("an inode names a shared xattr id that starts no entry")
    return img.read(start, off), found


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
