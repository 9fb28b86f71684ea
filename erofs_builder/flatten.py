"""One root device for a full VM: an environment's layers merged into one EROFS image.

Two ways, both from the composed view of the layers (compose.py, overlay semantics):

`build_multidevice`  a metadata image whose extra devices are the layer blobs themselves. Its
                     directories, inodes, xattrs and symlinks are its own; every file's data
                     stays where its layer has it: the file is chunk-based with chunk indexes
                     whose device id names its layer (1..N, in the order given) and whose block
                     address is the layer's own. Only what cannot be pointed at is copied: small
                     files whose whole content is inline, and, for a file whose last block its
                     layer packed inline after the inode, the last chunk of the file (the chunk
                     size is chosen per file to minimise index bytes plus copied bytes). Reading
                     the layers' metadata is all it costs; the layers stay shared and lazily
                     fetched. Mount with `device=` per layer, in order.
`build_flattened`    a real, self-contained image written by `ImageWriter` from the composed
                     view: every visible file's data is read from its layer and copied.

docs/vm-flattened.md has the measurements that chose between them, and the device layout.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from layerstore.errors import BadInput
from layerstore.fileio import fsync_dir

from .compose import Composed, compose, link_counts
from .erofs import format as fmt
from .erofs.dataarea import DataArea, pad
from .erofs.metadata import Inode, pack, plan
from .erofs.read import LayerImage, Node, data_pieces, read_layer
from .erofs.writer import ImageWriter
from .tree import Data, Entry, Hole, Kind

BS = fmt.BLOCK_SIZE
DEVT_SLOT_SIZE = 128
DEVT_SLOTOFF = (fmt.SUPER_OFFSET + fmt.SUPERBLOCK.size) // DEVT_SLOT_SIZE  # right after the superblock
MAX_DEVICES = (BS - DEVT_SLOTOFF * DEVT_SLOT_SIZE) // DEVT_SLOT_SIZE  # the table stays in block 0
TAG_LEN = 64
_SB_INCOMPAT = fmt.SUPER_OFFSET + 80
_SB_EXTRA_DEVICES = fmt.SUPER_OFFSET + 86
_SB_DEVT_SLOTOFF = fmt.SUPER_OFFSET + 88
_READ = 1 << 20
MAX_CHUNKBITS = fmt.CHUNK_BLKBITS_MASK  # chunk size up to 2^(12+31)


@dataclass
class FlattenResult:
    path: Path
    kind: str  # "multidevice" | "flat"
    size: int  # bytes of the image written
    files: int  # visible paths, the root included
    layer_bytes_read: int  # bytes read from the layer blobs to build it
    copied_bytes: int  # file data copied into the image (multidevice: tails and inline files)
    seconds: float
    devices: list[Path] = field(default_factory=list)  # extra devices, in order (multidevice)


class _Layer:
    """A layer blob opened for reading, counting the bytes read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self.size = os.fstat(self.fd).st_size
        self.read_bytes = 0

    def read(self, offset: int, length: int) -> bytes:
        out = bytearray()
        while len(out) < length:
            buf = os.pread(self.fd, min(length - len(out), _READ), offset + len(out))
            if not buf:
                break
            out += buf
        self.read_bytes += len(out)
        return bytes(out)

    def close(self) -> None:
        os.close(self.fd)


@contextlib.contextmanager
def _opened(paths: Sequence[Path]) -> Iterator[tuple[list[_Layer], list[LayerImage]]]:
    if not paths:
        raise BadInput("flattening needs at least one layer")
    layers: list[_Layer] = []
    try:
        for p in paths:
            layers.append(_Layer(Path(p)))
        images = [read_layer(lay.read, lay.size, str(lay.path)) for lay in layers]
        yield layers, images
    finally:
        for lay in layers:
            lay.close()


@contextlib.contextmanager
def _atomic(out: Path) -> Iterator[tuple[int, Path]]:
    """A temporary file beside `out`, renamed into place only when complete (and fsynced)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        yield fd, Path(tmp)
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
        fsync_dir(out.parent)
    finally:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


# -- (b) a real flattened image ---------------------------------------------------------------
def build_flattened(layer_paths: Sequence[str | os.PathLike[str]], out: str | os.PathLike[str]) -> FlattenResult:
    """Write the composed view of the layers (bottom first) as one self-contained image."""
    start = time.perf_counter()
    out = Path(out)
    with _opened([Path(p) for p in layer_paths]) as (layers, images), _atomic(out) as (fd, _tmp):
        view = compose(images)
        copied = 0
        with os.fdopen(os.dup(fd), "w+b", buffering=1 << 20) as f:
            writer = ImageWriter(f)
            first: dict[tuple[int, int], bytes] = {}
            for e in view:
                n = e.node
                if n.kind is not Kind.DIR and e.identity in first:
                    writer.add(Entry(e.path, n.kind, hardlink=first[e.identity]))
                    continue
                first[e.identity] = e.path
                data = None
                if n.kind is Kind.REG:
                    data = _file_data(layers[e.layer], n)
                    copied += n.size
                writer.add(Entry(e.path, n.kind, mode=n.mode, uid=n.uid, gid=n.gid, mtime=n.mtime, mtime_nsec=n.nsec,
                                 size=n.size, symlink=n.symlink, rdev=n.rdev, xattrs=e.xattrs), data)
            layout = writer.finish()
        size = layout.size
    read = sum(lay.read_bytes for lay in layers)
    return FlattenResult(out, "flat", size, len(view), read, copied, time.perf_counter() - start)


def _file_data(layer: _Layer, node: Node) -> Data:
    for piece in data_pieces(node):
        if isinstance(piece, bytes):
            yield piece
            continue
        blk, length = piece
        if blk == fmt.NULL_ADDR:
            yield Hole(length)
            continue
        if blk * BS + length > layer.size:
            raise BadInput(f"layer {layer.path}: file data past its end")
        for off in range(0, length, _READ):
            yield layer.read(blk * BS + off, min(_READ, length - off))


# -- (a) a metadata image over the layer blobs ------------------------------------------------
def build_multidevice(layer_paths: Sequence[str | os.PathLike[str]], out: str | os.PathLike[str], *,
                      tags: Sequence[bytes] | None = None) -> FlattenResult:
    """Write a metadata image whose extra devices 1..N are the layers (bottom first). `tags`
    (e.g. the blobs' digests, at most 64 bytes each) go into the device table."""
    start = time.perf_counter()
    out = Path(out)
    paths = [Path(p) for p in layer_paths]
    if len(paths) > MAX_DEVICES:
        raise BadInput(f"{len(paths)} layers: a multi-device image here holds at most {MAX_DEVICES}")
    if tags is not None and (len(tags) != len(paths) or any(len(t) > TAG_LEN for t in tags)):
        raise BadInput("one device tag of at most 64 bytes per layer")
    with _opened(paths) as (layers, images), _atomic(out) as (fd, _tmp):
        view = compose(images)
        with os.fdopen(os.dup(fd), "w+b", buffering=1 << 20) as f:
            b = _MultiDevice(f, layers)
            size = b.build(view, images, tags or [b""] * len(paths))
    read = sum(lay.read_bytes for lay in layers)
    return FlattenResult(out, "multidevice", size, len(view), read, b.copied, time.perf_counter() - start,
                         devices=paths)


class _MultiDevice:
    def __init__(self, f: BinaryIO, layers: list[_Layer]) -> None:
        self.f = f
        self.layers = layers
        self.area = DataArea(f)
        self.copied = 0

    def build(self, view: list[Composed], images: list[LayerImage], tags: Sequence[bytes]) -> int:
        links = link_counts(view)
        root = Inode(Kind.DIR, b"")
        dirs: dict[bytes, Inode] = {b"": root}
        inodes: dict[tuple[int, int], Inode] = {}
        for e in view:
            n = e.node
            if e.path == b"":
                self._meta(root, e)
                continue
            parent = dirs[e.path.rpartition(b"/")[0]]
            name = e.path.rpartition(b"/")[2]
            if n.kind is not Kind.DIR and e.identity in inodes:
                parent.children[name] = inodes[e.identity]  # type: ignore[index]
                continue
            node = Inode(n.kind, e.path)
            self._meta(node, e)
            if n.kind is Kind.DIR:
                dirs[e.path] = node
            else:
                node.nlink = links[e.identity]
                inodes[e.identity] = node
                self._content(node, e)
            parent.children[name] = node  # type: ignore[index]
        p = plan(root)
        # chunk indexes start 8-aligned after the inode and its xattrs: a 4-byte pad word in front
        # when the xattr body leaves them 4 off (the xattr body is known once the plan is made)
        redo = False
        for rec in p.recs:
            node = rec.node
            if node.layout == fmt.LAYOUT_CHUNK_BASED and node.chunkbits & fmt.CHUNK_INDEXES:
                isize = fmt.EXTENDED_SIZE if rec.extended else fmt.COMPACT_SIZE
                if (isize + len(rec.xbody)) % 8:
                    node.blockmap.insert(0, 0)
                    redo = True
        if redo:
            p = plan(root)
        area = self.area
        dir_addr = {id(rec): area.store_run(pad(raw), rec.path, meta=True) // BS for rec, raw in p.dir_blocks}
        xattr_blkaddr = area.store_run(pad(p.xattr_area), b"", meta=True) // BS if p.xattr_area else 0
        meta_start = area.pos
        md = pack(p, dir_addr=dir_addr, xattr_blkaddr=xattr_blkaddr, meta_start=meta_start,
                  data_digests=[*area.digests, *(t.ljust(TAG_LEN, b"\0") for t in tags)])
        f = self.f
        f.seek(meta_start)
        f.write(md.meta)
        block0 = bytearray(md.block0)
        incompat = int.from_bytes(block0[_SB_INCOMPAT:_SB_INCOMPAT + 4], "little") | fmt.FEATURE_INCOMPAT_DEVICE_TABLE
        block0[_SB_INCOMPAT:_SB_INCOMPAT + 4] = incompat.to_bytes(4, "little")
        block0[_SB_EXTRA_DEVICES:_SB_EXTRA_DEVICES + 2] = len(self.layers).to_bytes(2, "little")
        block0[_SB_DEVT_SLOTOFF:_SB_DEVT_SLOTOFF + 2] = DEVT_SLOTOFF.to_bytes(2, "little")
        size = meta_start + len(md.meta)
        # each device also gets its place in one address space after the primary's blocks (the
        # mapped_blkaddr mkfs.erofs writes): a mount given no `device=` then reads past the
        # image's end and fails, instead of reading the layers' block addresses from the image
        uniaddr = size // BS
        if uniaddr + sum(img.blocks for img in images) >= 1 << 32:
            raise BadInput("the layers are too large for one 32-bit block address space")
        for i, (img, tag) in enumerate(zip(images, tags, strict=True)):
            slot = (tag.ljust(TAG_LEN, b"\0") + img.blocks.to_bytes(4, "little") + uniaddr.to_bytes(4, "little")
                    + bytes(56))
            uniaddr += img.blocks
            at = DEVT_SLOTOFF * DEVT_SLOT_SIZE + i * DEVT_SLOT_SIZE
            block0[at:at + DEVT_SLOT_SIZE] = slot
        f.seek(0)
        f.write(block0)
        f.truncate(size)
        f.flush()
        return size

    @staticmethod
    def _meta(node: Inode, e: Composed) -> None:
        n = e.node
        node.mode, node.uid, node.gid, node.mtime, node.nsec = n.mode, n.uid, n.gid, n.mtime, n.nsec
        node.xattrs = e.xattrs

    def _content(self, node: Inode, e: Composed) -> None:
        n = e.node
        node.size = n.size
        if n.kind in (Kind.CHR, Kind.BLK):
            node.rdev = fmt.encode_dev(*n.rdev)
        elif n.kind is Kind.SYMLINK:
            assert n.symlink is not None
            node.symlink = n.symlink
            node.size = len(n.symlink)
            if len(n.symlink) <= _inline_room(node):
                node.inline = n.symlink
                node.layout = fmt.LAYOUT_FLAT_INLINE
            else:
                node.blkaddr = self.area.store_run(pad(n.symlink), e.path) // BS
        elif n.kind is Kind.REG and n.size:
            self._file(node, e)

    def _file(self, node: Inode, e: Composed) -> None:
        n = e.node
        dev = e.layer + 1
        if n.layout != fmt.LAYOUT_CHUNK_BASED and n.stored_blocks == 0:  # the whole content inline
            if len(n.tail) <= _inline_room(node):
                node.inline = n.tail
                node.layout = fmt.LAYOUT_FLAT_INLINE
            else:  # it no longer fits beside a bigger record: one block of the metadata image
                node.blkaddr = self._copy(n.tail, e.path)
            return
        node.layout = fmt.LAYOUT_CHUNK_BASED
        if n.layout == fmt.LAYOUT_CHUNK_BASED:
            bits = n.chunkbits - fmt.BLOCK_BITS
            words: list[int] = []
            for blk in n.chunks:
                words += [0, fmt.NULL_ADDR] if blk == fmt.NULL_ADDR else [dev << 16, blk]
        else:
            bits, words = self._flat_chunks(n, dev, e.path)
        node.chunkbits = bits | fmt.CHUNK_INDEXES
        node.blockmap = words

    def _flat_chunks(self, n: Node, dev: int, path: bytes) -> tuple[int, list[int]]:
        """Chunk indexes for a flat file: its stored blocks are contiguous in its layer. Without
        an inline tail, chunks as large as the file; with one, the last chunk is copied into
        the metadata image, so choose the chunk size that costs the fewest bytes."""
        size, blocks = n.size, n.stored_blocks
        if not n.tail:
            bits = min(max(0, (blocks - 1).bit_length()), MAX_CHUNKBITS)
            step = 1 << bits
            return bits, [w for i in range(0, blocks, step) for w in (dev << 16, n.blkaddr + i)]
        best = None
        for bits in range(0, min(max(0, (blocks - 1).bit_length()) + 1, MAX_CHUNKBITS) + 1):
            chunk = BS << bits
            count = -(-size // chunk)
            last = size - (count - 1) * chunk
            cost = 8 * count + fmt.align(last, BS)
            if best is None or cost < best[0]:
                best = (cost, bits, count, last)
        assert best is not None
        _cost, bits, count, last = best
        step = 1 << bits
        words = [w for i in range(count - 1) for w in (dev << 16, n.blkaddr + i * step)]
        layer = self.layers[dev - 1]
        head_blocks = (count - 1) * step
        body = layer.read((n.blkaddr + head_blocks) * BS, (blocks - head_blocks) * BS)
        if len(body) != (blocks - head_blocks) * BS:
            raise BadInput(f"layer {layer.path}: {path!r} has data past its end")
        data = body + n.tail
        assert len(data) == last
        words += [0, self._copy(data, path)]
        return bits, words

    def _copy(self, data: bytes, path: bytes) -> int:
        self.copied += len(data)
        return self.area.store_run(pad(data), path) // BS


def _inline_room(node: Inode) -> int:
    """Bytes left in one block after an extended inode and all its xattrs inline."""
    x = 0
    if node.xattrs:
        x = fmt.XATTR_IBODY_HEADER + sum(len(fmt.xattr_entry(*fmt.split_xattr_name(k), v))
                                         for k, v in node.xattrs.items())
    return BS - fmt.EXTENDED_SIZE - x


def mount_options(devices: Sequence[str | os.PathLike[str]]) -> str:
    """The EROFS mount options that attach a multi-device image's extra devices, in order."""
    for d in devices:
        if "," in os.fspath(d):
            raise BadInput(f"device path {os.fspath(d)!r} contains a comma")
    return ",".join(f"device={os.fspath(d)}" for d in devices)
