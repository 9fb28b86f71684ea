"""A pure-Python EROFS image writer: 4 KiB blocks, uncompressed, reproducible.

`ImageWriter` keeps the entry bookkeeping (the tree of inodes, hard links, implicit parents,
validation) and streams regular-file data into the data area as entries are added; the image
file is the only buffer for file data. `finish` hands the tree to `metadata.lay_out` and writes
the metadata area after the data, then the superblock into block 0. Layout: see metadata.py and
docs/erofs-builder.md.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO

import blake3

from layerstore.errors import BadInput

from . import format as fmt
from .chunking import DataExtent, ImageLayout
from .metadata import Inode, pack, plan
from .parent import ParentImage
from .tree import Data, Entry, Hole, Kind, check_path

BS = fmt.BLOCK_SIZE
_FLUSH = 1 << 20
_ZEROS = bytes(BS)
PATH_MAX = 4096
PACK_TAILS = BS // 2


class ImageWriter:
    def __init__(self, out: BinaryIO, *, mtime_clamp: int | None = None, all_root: bool = False,
                 pack_tails: bool | int = PACK_TAILS, parent: ParentImage | None = None) -> None:
        """`pack_tails`: the last partial block of a multi-block file goes inline into its
        inode when it is at most this many bytes (True: whenever it fits, False: never). The
        default, half a block, packs a tail only when that saves at least as many bytes of
        padding as it moves into the metadata. With `parent`, the parent's data area is copied
        first and every run of data the parent already holds keeps its address."""
        self._out = out
        self._clamp = mtime_clamp
        self._all_root = all_root
        self._tail_max = BS if pack_tails is True else int(pack_tails)
        self._root = Inode(Kind.DIR, b"")
        self._root.mtime = mtime_clamp or 0
        self._explicit: set[bytes] = set()
        self._extents: list[DataExtent] = []
        self._cur = blake3.blake3()  # digest of the data run being written
        self._digests: list[bytes] = []  # one per extent
        self._pos = BS
        self._paths = 1
        self._finished = False
        # (blake3, length) of every stored run -> its image offset: identical runs (a file's
        # blocks, a symlink's, a directory's, the shared xattrs) are stored once
        self._runs: dict[tuple[bytes, int], int] = {}
        self._parent = parent
        out.seek(BS)
        if parent is not None:
            _copy_range(parent.path, BS, parent.data_end - BS, out)
            self._pos = parent.data_end
            self._runs.update(parent.runs)

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
        parent = self._parent
        p = plan(self._root, parent.meta if parent else None)
        # entries of large directories and the shared xattrs go to the data area: they hold
        # nids and xattr ids, but their own addresses then sit outside the metadata area
        dir_addr = {id(rec): self._store_run(_pad(data), rec.path) // BS for rec, data in p.dir_blocks}
        xattr_blkaddr = self._store_run(_pad(p.xattr_area), b"") // BS if p.xattr_area else 0
        meta_start = self._pos
        md = pack(p, dir_addr=dir_addr, xattr_blkaddr=xattr_blkaddr, meta_start=meta_start,
                  data_digests=self._digests)
        size = meta_start + len(md.meta)
        out = self._out
        out.seek(meta_start)
        out.write(md.meta)
        out.seek(0)
        out.write(md.block0)
        out.truncate(size)
        out.flush()
        extra = {"kept_records": p.kept, "records": len(p.recs)}
        return ImageLayout(size=size, data_start=BS, data_end=meta_start, extents=tuple(self._extents),
                           meta=md.segments, files=self._paths, extra=extra,
                           inherited_data=parent.data_cuts if parent else (), inherited_meta=md.inherited)

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

    def _commit_run(self, offset: int, length: int, path: bytes) -> int:
        """End the run just written at `offset` like `_end_extent`, unless the same bytes are
        already stored: then forget it (later data overwrites it) and return their offset."""
        key = (self._cur.digest(), length)
        have = self._runs.get(key)
        if have is not None:
            self._rewind(offset)
            return have
        self._runs[key] = offset
        self._end_extent(offset, length, path)
        return offset

    def _rewind(self, offset: int) -> None:
        self._out.seek(offset)
        self._pos = offset
        self._cur = blake3.blake3()

    def _settle(self, node: Inode, path: bytes, start: int, length: int, tail: bytes) -> None:
        """Place a file stored as the one run just written at `start` (its inline `tail`, if
        any, is already in `node`): share identical bytes stored before; else keep the blocks
        that the parent's file at the same path has identical at the same index (the file
        becomes chunk-based with 4 KiB chunks); else keep the new run."""
        if not length:
            return
        key = (self._cur.digest(), length)
        have = self._runs.get(key)
        if have is not None:
            self._rewind(start)
            node.blkaddr = have // BS
            return
        old = self._parent.blocks_of(path) if self._parent is not None else None
        if old and _readable(self._out) and self._keep_parent_blocks(node, path, old, start, length, tail):
            return
        self._runs[key] = start
        self._end_extent(start, length, path)
        node.blkaddr = start // BS

    def _keep_parent_blocks(self, node: Inode, path: bytes, old: list[int], start: int, length: int,
                            tail: bytes) -> bool:
        out = self._out
        out.flush()
        nblocks = length // BS
        same: dict[int, int] = {}
        for i in range(min(nblocks, len(old))):
            if old[i] == fmt.NULL_ADDR:
                continue
            out.seek(start + i * BS)
            new = out.read(BS)
            out.seek(old[i] * BS)
            if out.read(BS) == new:
                same[i] = old[i]
        if not same:
            out.seek(self._pos)
            return False
        if tail:  # a chunk-based file has no inline tail: it gets a block of its own
            out.seek(self._pos)
            self._write(_pad(tail))
            nblocks += 1
        cursor = start
        h = blake3.blake3()
        blockmap = []
        for i in range(nblocks):
            if i in same:
                blockmap.append(same[i])
                continue
            out.seek(start + i * BS)
            block = out.read(BS)
            if cursor != start + i * BS:
                out.seek(cursor)
                out.write(block)
            h.update(block)
            blockmap.append(cursor // BS)
            cursor += BS
        self._rewind(cursor)
        if cursor > start:
            self._digests.append(h.digest())
            self._extents.append(DataExtent(start, cursor - start, _hint(path)))
        node.layout = fmt.LAYOUT_CHUNK_BASED
        node.chunkbits = 0
        node.blockmap = blockmap
        node.inline = b""
        return True

    def _store_run(self, data: bytes, path: bytes) -> int:
        """Store `data` (block aligned) as one run; returns its image offset."""
        start = self._pos
        self._write(data)
        return self._commit_run(start, len(data), path)

    def _end_extent(self, offset: int, length: int, path: bytes) -> None:
        """Record the data run just written (its digest feeds the UUID). Its grouping hint
        comes from the file's name, not its content: an edited file then leaves the chunk
        boundaries where they were, and the same files under another prefix group alike."""
        digest = self._cur.digest()
        self._cur = blake3.blake3()
        self._digests.append(digest)
        self._extents.append(DataExtent(offset, length, _hint(path)))

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
            node.blkaddr = self._store_run(target + _ZEROS[: (-len(target)) % BS], path) // BS

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
        _FileSink(self, node, path, min(room, self._tail_max) if self._tail_max else -1).run(data)


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
        self.w._end_extent(self.run_img, self.written, self.path)
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
            packed = b""
            if 0 < tail <= self.tail_room:
                self._flush(keep_tail=True)
                packed = node.inline = bytes(self.pending)
                node.layout = fmt.LAYOUT_FLAT_INLINE
            else:
                self.pending += _ZEROS[:(-len(self.pending)) % BS]
                self._flush()
            self.w._settle(node, self.path, self.run_img, self.written, packed)
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
                    w._end_extent(new_runs[-1][1], new_runs[-1][2], self.path)
                new_runs.append((c * chunk, w._pos, len(chunks[c])))
            w._write(chunks[c])
        if new_runs:
            w._end_extent(new_runs[-1][1], new_runs[-1][2], self.path)
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


def _pad(data: bytes) -> bytes:
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


def _drain_empty(data: Data | None, path: bytes) -> None:
    if data is None:
        return
    for item in data:
        if isinstance(item, Hole) and item.length == 0:
            continue
        if not isinstance(item, Hole) and not len(item):
            continue
        raise BadInput(f"{path!r}: data given for an entry that holds none")
