"""The data area of an image being written: everything but block 0 and the metadata.

`DataArea` owns the image file's write position while entries are added: it streams regular
files into block-aligned runs (`FileSink`), stores each distinct run once (identical files,
symlink blocks, directory blocks and the shared xattrs share one copy), records the extents the
chunker groups, and, with a parent image, starts from a copy of the parent's data area so that
unchanged runs keep their addresses and changed files keep their unchanged blocks (reuse.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import blake3

from layerstore.errors import BadInput

from ..chunking import DataExtent
from ..tree import Data, Hole
from . import format as fmt
from .metadata import Inode
from .reuse import keep_blocks
from .runhash import RunHasher

if TYPE_CHECKING:
    from .parent import ParentImage

BS = fmt.BLOCK_SIZE
_FLUSH = 1 << 20
_ZEROS = bytes(BS)


class DataArea:
    def __init__(self, out: BinaryIO, parent: ParentImage | None = None) -> None:
        self.out = out
        self.pos = BS
        self.extents: list[DataExtent] = []
        self.digests: list[bytes] = []  # one per extent
        self._cur = RunHasher()  # the run being written
        # (blake3, length) of every stored run -> its image offset
        self._runs: dict[tuple[bytes, int], int] = {}
        self._parent = parent
        out.seek(BS)
        if parent is not None:
            _copy_range(parent.path, BS, parent.data_end - BS, out)
            self.pos = parent.data_end
            self._runs.update(parent.runs)

    def write(self, buf: bytes | bytearray | memoryview) -> None:
        self.out.write(buf)
        self._cur.update(buf)
        self.pos += len(buf)

    def commit_run(self, offset: int, length: int, path: bytes, meta: bool = False) -> int:
        """End the run just written at `offset` like `end_extent`, unless the same bytes are
        already stored: then forget it (later data overwrites it) and return their offset."""
        key = (self._cur.key(), length)
        have = self._runs.get(key)
        if have is not None:
            self.rewind(offset)
            return have
        self._runs[key] = offset
        self.end_extent(offset, length, path, meta, key[0])
        return offset

    def rewind(self, offset: int) -> None:
        self.out.seek(offset)
        self.pos = offset
        self._cur = RunHasher()

    def store_whole(self, node: Inode, buf: bytes | bytearray | memoryview, path: bytes, tail_room: int) -> None:
        """`store_file` for a file whose whole content is in `buf` (what `FileSink` does with
        one piece of data, without streaming it)."""
        size = len(buf)
        tail = size % BS
        start = self.pos
        if 0 < tail <= tail_room:  # size >= BS here: smaller files went inline whole
            view = memoryview(buf)
            node.inline = packed = bytes(view[size - tail:])
            node.layout = fmt.LAYOUT_FLAT_INLINE
            self.write(view[:size - tail])
        else:
            packed = b""
            self.write(buf)
            if tail:
                self.write(_ZEROS[:BS - tail])
        self.settle(node, path, start, self.pos - start, packed)

    def settle(self, node: Inode, path: bytes, start: int, length: int, tail: bytes) -> None:
        """Place a file stored as the one run just written at `start` (its inline `tail`, if
        any, is already in `node`): share identical bytes stored before; else keep the blocks
        that the parent's file at the same path has identical at the same index (the file
        becomes chunk-based, see reuse.py); else keep the new run."""
        if not length:
            return
        key = (self._cur.key(), length)
        have = self._runs.get(key)
        if have is not None:
            self.rewind(start)
            node.blkaddr = have // BS
            return
        old = self._parent.blocks_of(path) if self._parent is not None else None
        kept = keep_blocks(self.out, start, length // BS, old, tail) if old and _readable(self.out) else None
        if kept is not None:
            self.pos = kept.end
            self._cur = RunHasher()
            if kept.end > start:
                self.digests.append(kept.digest)
                self.extents.append(DataExtent(start, kept.end - start, _hint(path)))
            node.layout = fmt.LAYOUT_CHUNK_BASED
            node.chunkbits = kept.chunkbits
            node.blockmap = kept.blockmap
            node.inline = b""
            return
        self._runs[key] = start
        self.end_extent(start, length, path, key=key[0])
        node.blkaddr = start // BS

    def store_run(self, data: bytes, path: bytes, meta: bool = False) -> int:
        """Store `data` (block aligned) as one run; returns its image offset. `meta`: it is
        metadata (directory entries, shared xattrs) and is chunked as such."""
        start = self.pos
        self.write(data)
        return self.commit_run(start, len(data), path, meta)

    def end_extent(self, offset: int, length: int, path: bytes, meta: bool = False, key: bytes | None = None) -> None:
        """Record the data run just written (its digest feeds the UUID). Its grouping hint
        comes from the file's name, not its content: an edited file then leaves the chunk
        boundaries where they were, and the same files under another prefix group alike."""
        digest = key or self._cur.key()  # `key`: the caller computed it already
        slices = self._cur.slices()
        self._cur = RunHasher()
        self.digests.append(digest)
        self.extents.append(DataExtent(offset, length, _hint(path), meta, slices))

    def store_file(self, node: Inode, data: Data, path: bytes, tail_room: int) -> None:
        """Stream a regular file that does not fit inline; a tail of at most `tail_room` bytes
        goes inline (-1: none)."""
        FileSink(self, node, path, tail_room).run(data)


class FileSink:
    """Streams one regular file into the data area as block-aligned runs; whole blocks of zeros
    that arrive as `Hole`s are not stored."""

    def __init__(self, w: DataArea, node: Inode, path: bytes, tail_room: int) -> None:
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
        self.run_img = self.w.pos
        self.written = 0
        self.pending = bytearray(pos % BS)

    def _flush(self, keep_tail: bool = False) -> None:
        n = len(self.pending) // BS * BS if keep_tail else len(self.pending)
        if not n:
            return
        self.w.write(memoryview(self.pending)[:n])
        self.written += n
        del self.pending[:n]

    def _close(self) -> None:
        pad = (-len(self.pending)) % BS
        self.pending += _ZEROS[:pad]
        self._flush()
        self.runs.append((self.run_file, self.run_img, self.written))
        self.w.end_extent(self.run_img, self.written, self.path)
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
            if not self.pending and n >= BS:  # block aligned already: no copy through `pending`
                whole = n - n % BS
                self.w.write(memoryview(item)[:whole])
                self.written += whole
                self.pending += memoryview(item)[whole:]
            else:
                self.pending += item
                if len(self.pending) >= _FLUSH:
                    self._flush(keep_tail=True)
            pos += n
        if pos != size:
            raise BadInput(f"{self.path!r}: data is {pos} bytes, entry says {size}")
        node = self.node
        whole = self.run_file == 0 and not self.runs and fmt.align(self._end(), BS) >= size
        if whole:
            self.pending += bytes(size - self._end())
            tail = size % BS
            packed = b""
            if 0 < tail <= self.tail_room:
                self._flush(keep_tail=True)
                packed = node.inline = bytes(self.pending)
                node.layout = fmt.LAYOUT_FLAT_INLINE
            else:
                self.pending += _ZEROS[:(-len(self.pending)) % BS]
                self._flush()
            self.w.settle(node, self.path, self.run_img, self.written, packed)
            return
        if self.run_file >= 0:
            self._close()
        self._chunk_map()

    def _chunk_map(self) -> None:
        node = self.node
        size = node.size
        bits = _best_chunk_bits(self.runs, size, _readable(self.w.out))
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
        out = w.out
        out.flush()
        pieces = []
        for f_off, img, length in self.runs:
            out.seek(img)
            pieces.append((f_off, out.read(length)))
        del w.extents[-len(self.runs):]
        del w.digests[-len(self.runs):]
        out.seek(start)
        w.pos = start
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
                    w.end_extent(new_runs[-1][1], new_runs[-1][2], self.path)
                new_runs.append((c * chunk, w.pos, len(chunks[c])))
            w.write(chunks[c])
        if new_runs:
            w.end_extent(new_runs[-1][1], new_runs[-1][2], self.path)
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


def _hint(path: bytes) -> int:
    return int.from_bytes(blake3.blake3(path.rpartition(b"/")[2]).digest()[:4], "little")


def pad(data: bytes) -> bytes:
    return data + _ZEROS[: (-len(data)) % BS]


def _copy_range(src: Path, offset: int, length: int, out: BinaryIO) -> None:
    """Copy `length` bytes of `src` from `offset` to `out` at its position (in the kernel when
    both are files)."""
    with open(src, "rb") as f:
        try:
            dst = out.fileno()
        except (AttributeError, OSError, ValueError):
            dst = -1
        if dst >= 0:
            out.flush()
            pos = out.tell()
            done = 0
            while done < length:
                n = os.copy_file_range(f.fileno(), dst, length - done, offset + done, pos + done)
                if n <= 0:
                    raise BadInput(f"{src}: parent image is shorter than its superblock says")
                done += n
            out.seek(pos + length)
            return
        f.seek(offset)
        left = length
        while left:
            buf = f.read(min(left, _FLUSH))
            if not buf:
                raise BadInput(f"{src}: parent image is shorter than its superblock says")
            out.write(buf)
            left -= len(buf)
