"""Read a layer's EROFS image as a tree of inodes, with where each file's data lives.

What flattening needs to compose layers without copying their data: for every path, the inode's
metadata (type, mode, owner, times, xattrs, device numbers, symlink target), its identity in the
image (the nid: paths that share it are hard links), and its data's place: block runs in the
image, an inline tail (the last block packed after the inode), or a chunk table (chunk-based
files: holes and block runs). File contents are not read here (flatten.py reads them, or not).

Uncompressed images with 4 KiB blocks and no extra devices: what `ImageWriter` writes, and
mkfs.erofs's uncompressed output. Anything else is refused with `BadInput`. The image is read
through a `read(offset, length)` callable, so this module does no I/O of its own; every offset
read is bounded by the image size, and every tree walk by the number of directories seen.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from layerstore.errors import BadInput

from ..tree import Kind
from . import format as fmt

BS = fmt.BLOCK_SIZE
CHUNK_INDEXES = 0x20
FEATURE_INCOMPAT_DEVICE_TABLE = 0x8
_KNOWN_INCOMPAT = fmt.FEATURE_INCOMPAT_CHUNKED_FILE
_PREFIX_OF = {index: (prefix, whole) for prefix, index, whole in fmt.XATTR_PREFIXES}
_DEVICES = struct.Struct("<HH")  # extra_devices, devt_slotoff (after the packed superblock fields)
_INDEX = struct.Struct("<HHI")  # chunk index: advise, device id, block address
_KIND_OF = {k.value: k for k in Kind}
MAX_DEPTH = 4096

Read = Callable[[int, int], bytes]


@dataclass(frozen=True, slots=True)
class Node:
    """One inode of a layer image. `chunks` (chunk-based files) holds one block address per
    chunk of `1 << chunkbits` bytes, `fmt.NULL_ADDR` for a hole. For flat files, `blkaddr` is
    the first of the file's stored blocks and `tail` the inline last block (FLAT_INLINE)."""

    nid: int
    kind: Kind
    mode: int  # permission bits only
    uid: int
    gid: int
    mtime: int
    nsec: int
    size: int
    rdev: tuple[int, int] = (0, 0)
    xattrs: tuple[tuple[bytes, bytes], ...] = ()
    symlink: bytes | None = None
    layout: int = fmt.LAYOUT_FLAT_PLAIN
    blkaddr: int = 0
    tail: bytes = b""
    chunkbits: int = 0
    chunks: tuple[int, ...] = ()

    @property
    def stored_blocks(self) -> int:
        """Blocks of a flat file in the image's data area (the inline tail excluded)."""
        if self.layout == fmt.LAYOUT_FLAT_PLAIN:
            return fmt.blocks_of(self.size)
        if self.layout == fmt.LAYOUT_FLAT_INLINE:
            return (self.size - len(self.tail)) // BS
        return 0


@dataclass(frozen=True)
class LayerImage:
    """Every path of an image (b"" is the root), parents before children, names sorted."""

    size: int
    blocks: int
    nodes: dict[bytes, Node]
    children: dict[bytes, tuple[bytes, ...]]  # directory path -> child names, sorted


def decode_dev(dev: int) -> tuple[int, int]:
    """Linux `new_decode_dev`."""
    return (dev & 0xFFF00) >> 8, (dev & 0xFF) | ((dev >> 12) & 0xFFF00)


class _Image:
    def __init__(self, read: Read, size: int, where: str) -> None:
        self.rd, self.size, self.where = read, size, where
        if size < 2 * BS:
            raise self.bad("too small to be an EROFS image")
        sb = read(fmt.SUPER_OFFSET, fmt.SUPERBLOCK.size)
        (magic, _csum, _compat, blkszbits, _ext, self.root_nid, _inos, self.build_time, self.build_nsec,
         _blocks, self.meta_blkaddr, self.xattr_blkaddr, _uuid, _vol, incompat, _u1) = fmt.SUPERBLOCK.unpack(sb)
        if magic != fmt.MAGIC:
            raise self.bad("no EROFS superblock")
        if blkszbits != fmt.BLOCK_BITS:
            raise self.bad(f"block size 2^{blkszbits} (only 4 KiB blocks are read)")
        if incompat & ~_KNOWN_INCOMPAT:
            raise self.bad(f"features {incompat:#x} (compression or extra devices) are not supported")
        self.blocks = size // BS

    def bad(self, why: str) -> BadInput:
        return BadInput(f"layer image {self.where}: {why}")

    def read(self, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise self.bad(f"reads {length} bytes at {offset}, past its end")
        buf = self.rd(offset, length)
        if len(buf) != length:
            raise self.bad("short read")
        return buf

    def xattr(self, raw: bytes, pos: int) -> tuple[tuple[bytes, bytes], int]:
        name_len, index, value_len = fmt.XATTR_ENTRY.unpack_from(raw, pos)
        if index not in _PREFIX_OF:
            raise self.bad(f"xattr name index {index} is unknown")
        prefix, whole = _PREFIX_OF[index]
        start = pos + fmt.XATTR_ENTRY.size
        end = start + name_len + value_len
        if end > len(raw):
            raise self.bad("xattr entry runs past its area")
        suffix = raw[start:start + name_len]
        if whole and suffix:
            raise self.bad("ACL xattr with a name suffix")
        return (prefix + suffix, raw[start + name_len:end]), fmt.align(end, 4)

    def node(self, nid: int) -> Node:
        pos = self.meta_blkaddr * BS + nid * fmt.ISLOT
        head = self.read(pos, fmt.COMPACT_SIZE)
        i_format = int.from_bytes(head[:2], "little")
        layout = (i_format >> 1) & 0x7
        if i_format & 1:
            head = self.read(pos, fmt.EXTENDED_SIZE)
            (_f, xcount, mode, _r, size, i_u, _ino, uid, gid, mtime, nsec,
             _nlink) = fmt.EXTENDED_INODE.unpack(head)
            isize = fmt.EXTENDED_SIZE
        else:
            _f, xcount, mode, _nlink, size, _r, i_u, _ino, uid, gid, _r2 = fmt.COMPACT_INODE.unpack(head)
            isize = fmt.COMPACT_SIZE
            mtime, nsec = self.build_time, self.build_nsec
        kind = _KIND_OF.get(mode & 0o170000)
        if kind is None:
            raise self.bad(f"nid {nid}: file type {mode:#o}")
        end = pos + isize
        xattrs: list[tuple[bytes, bytes]] = []
        if xcount:
            xsize = fmt.XATTR_IBODY_HEADER + (xcount - 1) * 4
            body = self.read(end, xsize)
            shared = body[4]
            if fmt.XATTR_IBODY_HEADER + 4 * shared > xsize:
                raise self.bad(f"nid {nid}: more shared xattrs than its xattr body holds")
            for i in range(shared):
                sid = int.from_bytes(body[12 + 4 * i:16 + 4 * i], "little")
                at = self.xattr_blkaddr * BS + sid * 4
                raw = self.read(at, fmt.XATTR_ENTRY.size)
                name_len, _index, value_len = fmt.XATTR_ENTRY.unpack(raw)
                xattrs.append(self.xattr(self.read(at, fmt.XATTR_ENTRY.size + name_len + value_len), 0)[0])
            p = fmt.XATTR_IBODY_HEADER + 4 * shared
            while p < xsize:
                kv, p = self.xattr(body, p)
                xattrs.append(kv)
            end += xsize
        common = dict(nid=nid, kind=kind, mode=mode & 0o7777, uid=uid, gid=gid, mtime=mtime, nsec=nsec, size=size,
                      xattrs=tuple(sorted(xattrs)))
        if kind in (Kind.CHR, Kind.BLK):
            return Node(**common, rdev=decode_dev(i_u))
        if kind in (Kind.FIFO, Kind.SOCK):
            return Node(**common)
        if layout == fmt.LAYOUT_CHUNK_BASED:
            if i_u & ~(CHUNK_INDEXES | fmt.CHUNK_BLKBITS_MASK):
                raise self.bad(f"nid {nid}: chunk format {i_u:#x}")
            chunkbits = fmt.BLOCK_BITS + (i_u & fmt.CHUNK_BLKBITS_MASK)
            count = -(-size // (1 << chunkbits))
            if i_u & CHUNK_INDEXES:
                raw = self.read(fmt.align(end, _INDEX.size), count * _INDEX.size)
                chunks = []
                for _adv, dev, blk in _INDEX.iter_unpack(raw):
                    if dev and blk != fmt.NULL_ADDR:
                        raise self.bad(f"nid {nid}: a chunk on device {dev} (extra devices are not supported)")
                    chunks.append(blk)
            else:
                raw = self.read(fmt.align(end, 4), count * 4)
                chunks = [int.from_bytes(raw[i:i + 4], "little") for i in range(0, len(raw), 4)]
            for blk in chunks:
                if blk != fmt.NULL_ADDR and (blk << fmt.BLOCK_BITS) >= self.size:
                    raise self.bad(f"nid {nid}: a chunk at block {blk}, past the image")
            node = Node(**common, layout=layout, chunkbits=chunkbits, chunks=tuple(chunks))
        elif layout in (fmt.LAYOUT_FLAT_PLAIN, fmt.LAYOUT_FLAT_INLINE):
            tail = b""
            if layout == fmt.LAYOUT_FLAT_INLINE and size:
                tail = self.read(end, size - (fmt.blocks_of(size) - 1) * BS)
                if (end % BS) + len(tail) > BS:
                    raise self.bad(f"nid {nid}: inline data crosses a block")
            node = Node(**common, layout=layout, blkaddr=i_u, tail=tail)
            if node.stored_blocks and (i_u + node.stored_blocks) * BS > self.size:
                raise self.bad(f"nid {nid}: data blocks past the image")
        else:
            raise self.bad(f"nid {nid}: data layout {layout} (compressed?) is not supported")
        if kind is Kind.SYMLINK:
            target = read_data(self.read, node)
            if not target or b"\0" in target:
                raise self.bad(f"nid {nid}: bad symlink target")
            node = Node(**common, symlink=target)
        return node

    def dirents(self, node: Node) -> Iterator[tuple[bytes, int]]:
        raw = read_data(self.read, node)
        for off in range(0, len(raw), BS):
            blk = raw[off:off + BS]
            if len(blk) < fmt.DIRENT_SIZE:
                raise self.bad(f"directory nid {node.nid} is truncated")
            count = fmt.DIRENT.unpack_from(blk, 0)[1] // fmt.DIRENT_SIZE
            if not 0 < count <= len(blk) // fmt.DIRENT_SIZE:
                raise self.bad(f"directory nid {node.nid} has a corrupt block")
            heads = [fmt.DIRENT.unpack_from(blk, i * fmt.DIRENT_SIZE) for i in range(count)]
            for i, (nid, nameoff, _ftype) in enumerate(heads):
                end = heads[i + 1][1] if i + 1 < count else len(blk)
                if not count * fmt.DIRENT_SIZE <= nameoff <= end <= len(blk):
                    raise self.bad(f"directory nid {node.nid} has a corrupt name offset")
                name = bytes(blk[nameoff:end])
                if i + 1 == count:
                    name = name.split(b"\0", 1)[0]
                if not name or b"/" in name or len(name) > fmt.NAME_LEN:
                    raise self.bad(f"directory nid {node.nid} has a bad name {name[:40]!r}")
                yield name, nid


def read_data(read: Read, node: Node) -> bytes:
    """A (small) inode's whole content: directories and symlinks; files in tests."""
    out = bytearray()
    for piece in data_pieces(node):
        if isinstance(piece, bytes):
            out += piece
        else:
            blk, length = piece
            out += bytes(length) if blk == fmt.NULL_ADDR else read(blk * BS, length)
    return bytes(out)


def data_pieces(node: Node) -> Iterator[bytes | tuple[int, int]]:
    """A file's content in order: (image block, length) runs (`fmt.NULL_ADDR`: a hole of that
    length) and inline bytes."""
    size = node.size
    if node.layout == fmt.LAYOUT_CHUNK_BASED:
        chunk = 1 << node.chunkbits
        for i, blk in enumerate(node.chunks):
            yield blk, min(chunk, size - i * chunk)
        return
    body = size - len(node.tail)
    if body:
        yield node.blkaddr, body
    if node.tail:
        yield node.tail


def read_layer(read: Read, size: int, where: str = "") -> LayerImage:
    """Walk the image from its root directory, as the kernel would."""
    img = _Image(read, size, where)
    nodes: dict[bytes, Node] = {}
    children: dict[bytes, tuple[bytes, ...]] = {}
    cache: dict[int, Node] = {}
    root = img.node(img.root_nid)
    if root.kind is not Kind.DIR:
        raise img.bad("the root is not a directory")
    nodes[b""] = root
    stack = [(b"", root, 0)]
    seen_dirs = {img.root_nid}
    while stack:
        path, dnode, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise img.bad("directories nested too deep")
        names = []
        subdirs = []
        for name, nid in img.dirents(dnode):
            if name in (b".", b".."):
                continue
            child = cache.get(nid)
            if child is None:
                child = cache[nid] = img.node(nid)
            if child.kind is Kind.DIR:
                if nid in seen_dirs:
                    raise img.bad(f"directory nid {nid} is reachable twice (a loop?)")
                seen_dirs.add(nid)
            cpath = path + b"/" + name if path else name
            nodes[cpath] = child
            names.append(name)
            if child.kind is Kind.DIR:
                subdirs.append((cpath, child, depth + 1))
        if len(set(names)) != len(names):
            raise img.bad(f"directory {path!r} names an entry twice")
        children[path] = tuple(sorted(names))
        stack.extend(reversed(subdirs))
    return LayerImage(size=size, blocks=img.blocks, nodes=nodes, children=children)
