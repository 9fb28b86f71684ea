"""Read an EROFS image as a tree of inodes, with where each file's data lives: the one reader.

Its users: flattening (compose.py, flatten.py) composes layers without copying their data; a
parent build (parent.py) keeps the addresses of an earlier image; the benchmarks look at a
layer's layouts. For every path, the inode's metadata (type, mode, owner, times, xattrs, device
numbers, symlink target), its identity in the image (the nid: paths that share it are hard
links), its record in the metadata area (length, shared xattr ids), and its data's place: block
runs in the image, an inline tail (the last block packed after the inode), or a chunk table
(chunk-based files: holes and block runs). File contents are not read here.

Uncompressed images with 4 KiB blocks and no extra devices: what `ImageWriter` writes, and
mkfs.erofs's uncompressed output. Anything else is refused with `BadInput`. The image is read
through a `read(offset, length)` callable, so this module does no I/O of its own; every offset
read is bounded by the image size, and every tree walk by the number of directories seen.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from layerstore.errors import BadInput

from ..tree import Kind
from . import format as fmt

BS = fmt.BLOCK_SIZE
_KNOWN_INCOMPAT = fmt.FEATURE_INCOMPAT_CHUNKED_FILE
_PREFIX_OF = {index: (prefix, whole) for prefix, index, whole in fmt.XATTR_PREFIXES}
_KIND_OF = {k.value: k for k in Kind}
MAX_DEPTH = 4096

Read = Callable[[int, int], bytes]


@dataclass(frozen=True, slots=True)
class Superblock:
    root_nid: int
    build_time: int
    build_nsec: int
    blocks: int  # as the superblock says (the image's size is the caller's)
    meta_blkaddr: int
    xattr_blkaddr: int
    uuid: bytes
    incompat: int


@dataclass(frozen=True, slots=True)
class Node:
    """One inode of an image. `chunks` (chunk-based files) holds one block address per chunk
    of `1 << chunkbits` bytes, `fmt.NULL_ADDR` for a hole. For flat files, directories and
    symlinks, `blkaddr` is the first of the stored blocks and `tail` the inline last block
    (FLAT_INLINE). `record` is the length of its record in the metadata area (inode, xattr
    body, inline data or chunk table) and `shared` the ids of its shared xattrs."""

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
    chunk_indexes: bool = False  # the chunk table holds 8-byte indexes, not 4-byte block addresses
    record: int = 0
    shared: tuple[int, ...] = ()

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
    sb: Superblock | None = None


def decode_dev(dev: int) -> tuple[int, int]:
    """Linux `new_decode_dev`."""
    return (dev & 0xFFF00) >> 8, (dev & 0xFF) | ((dev >> 12) & 0xFFF00)


class ImageReader:
    """An image's superblock, inodes, xattrs and directories, each parsed here only.
    `what` names the image in errors ("layer image", "parent image")."""

    def __init__(self, read: Read, size: int, where: str, what: str = "layer image") -> None:
        self.rd, self.size, self.where, self.what = read, size, where, what
        if size < 2 * BS:
            raise self.bad("too small to be an EROFS image")
        raw = self.read(fmt.SUPER_OFFSET, fmt.SUPERBLOCK.size)
        (magic, _csum, _compat, blkszbits, _ext, root_nid, _inos, build_time, build_nsec, blocks, meta_blkaddr,
         xattr_blkaddr, uuid, _vol, incompat, _u1) = fmt.SUPERBLOCK.unpack(raw)
        if magic != fmt.MAGIC:
            raise self.bad("not an EROFS image (no superblock)")
        if blkszbits != fmt.BLOCK_BITS:
            raise self.bad(f"block size 2^{blkszbits} (only 4 KiB blocks are read)")
        if incompat & ~_KNOWN_INCOMPAT:
            raise self.bad(f"features {incompat:#x} (compression or extra devices) are not supported")
        self.sb = Superblock(root_nid, build_time, build_nsec, blocks, meta_blkaddr, xattr_blkaddr, bytes(uuid),
                             incompat)
        self.blocks = size // BS
        self._shared: dict[int, tuple[tuple[bytes, bytes], int]] = {}  # many inodes name the same few

    def bad(self, why: str) -> BadInput:
        return BadInput(f"{self.what} {self.where}: {why}")

    def read(self, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise self.bad(f"reads {length} bytes at {offset}, past its end")
        buf = self.rd(offset, length)
        if len(buf) != length:
            raise self.bad("short read")
        return buf

    def xattr(self, raw: bytes, pos: int) -> tuple[tuple[bytes, bytes], int]:
        """The xattr entry at `pos` of `raw` as (full name, value), and where the next starts."""
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

    def shared_xattr(self, sid: int) -> tuple[tuple[bytes, bytes], int]:
        """The shared xattr with id `sid` (its position in the shared area / 4), and its length
        there (4-aligned)."""
        found = self._shared.get(sid)
        if found is None:
            at = self.sb.xattr_blkaddr * BS + sid * 4
            name_len, _index, value_len = fmt.XATTR_ENTRY.unpack(self.read(at, fmt.XATTR_ENTRY.size))
            found = self._shared[sid] = self.xattr(self.read(at, fmt.XATTR_ENTRY.size + name_len + value_len), 0)
        return found

    def node(self, nid: int) -> Node:
        pos = self.sb.meta_blkaddr * BS + nid * fmt.ISLOT
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
            mtime, nsec = self.sb.build_time, self.sb.build_nsec
        kind = _KIND_OF.get(mode & 0o170000)
        if kind is None:
            raise self.bad(f"nid {nid}: file type {mode:#o}")
        xattrs, shared, xsize = self._xattrs(nid, pos + isize, xcount)
        end = pos + isize + xsize
        common = dict(nid=nid, kind=kind, mode=mode & 0o7777, uid=uid, gid=gid, mtime=mtime, nsec=nsec, size=size,
                      xattrs=xattrs, shared=shared, record=isize + xsize)
        if kind in (Kind.CHR, Kind.BLK):
            return Node(**common, rdev=decode_dev(i_u))
        if kind in (Kind.FIFO, Kind.SOCK):
            return Node(**common)
        if layout == fmt.LAYOUT_CHUNK_BASED:
            node = self._chunked(common, pos, end, i_u)
        elif layout in (fmt.LAYOUT_FLAT_PLAIN, fmt.LAYOUT_FLAT_INLINE):
            node = self._flat(common, end, layout, i_u)
        else:
            raise self.bad(f"nid {nid}: data layout {layout} (compressed?) is not supported")
        if kind is Kind.SYMLINK:
            target = read_data(self.read, node)
            if not target or b"\0" in target:
                raise self.bad(f"nid {nid}: bad symlink target")
            node = replace(node, symlink=target)
        return node

    def _xattrs(self, nid: int, at: int, xcount: int) -> tuple[tuple[tuple[bytes, bytes], ...], tuple[int, ...], int]:
        """(xattrs sorted, shared ids, xattr body size) of the body at `at`."""
        if not xcount:
            return (), (), 0
        xsize = fmt.XATTR_IBODY_HEADER + (xcount - 1) * 4
        body = self.read(at, xsize)
        count = body[4]
        if fmt.XATTR_IBODY_HEADER + 4 * count > xsize:
            raise self.bad(f"nid {nid}: more shared xattrs than its xattr body holds")
        shared = tuple(int.from_bytes(body[12 + 4 * i:16 + 4 * i], "little") for i in range(count))
        xattrs = [self.shared_xattr(sid)[0] for sid in shared]
        p = fmt.XATTR_IBODY_HEADER + 4 * count
        while p < xsize:
            kv, p = self.xattr(body, p)
            xattrs.append(kv)
        return tuple(sorted(xattrs)), shared, xsize

    def _chunked(self, common: dict[str, Any], pos: int, end: int, i_u: int) -> Node:
        nid = common["nid"]
        if i_u & ~(fmt.CHUNK_INDEXES | fmt.CHUNK_BLKBITS_MASK):
            raise self.bad(f"nid {nid}: chunk format {i_u:#x}")
        chunkbits = fmt.BLOCK_BITS + (i_u & fmt.CHUNK_BLKBITS_MASK)
        count = -(-common["size"] // (1 << chunkbits))
        indexes = bool(i_u & fmt.CHUNK_INDEXES)
        if indexes:
            at = fmt.align(end, fmt.CHUNK_INDEX.size)
            raw = self.read(at, count * fmt.CHUNK_INDEX.size)
            chunks = []
            for _adv, dev, blk in fmt.CHUNK_INDEX.iter_unpack(raw):
                if dev and blk != fmt.NULL_ADDR:
                    raise self.bad(f"nid {nid}: a chunk on device {dev} (extra devices are not supported)")
                chunks.append(blk)
        else:
            at = fmt.align(end, 4)
            raw = self.read(at, count * 4)
            chunks = [int.from_bytes(raw[i:i + 4], "little") for i in range(0, len(raw), 4)]
        for blk in chunks:
            if blk != fmt.NULL_ADDR and (blk << fmt.BLOCK_BITS) >= self.size:
                raise self.bad(f"nid {nid}: a chunk at block {blk}, past the image")
        return Node(**{**common, "record": at + len(raw) - pos}, layout=fmt.LAYOUT_CHUNK_BASED, chunkbits=chunkbits,
                    chunks=tuple(chunks), chunk_indexes=indexes)

    def _flat(self, common: dict[str, Any], end: int, layout: int, i_u: int) -> Node:
        nid, size = common["nid"], common["size"]
        tail = b""
        if layout == fmt.LAYOUT_FLAT_INLINE and size:
            tail = self.read(end, size - (fmt.blocks_of(size) - 1) * BS)
            if (end % BS) + len(tail) > BS:
                raise self.bad(f"nid {nid}: inline data crosses a block")
        node = Node(**{**common, "record": common["record"] + len(tail)}, layout=layout, blkaddr=i_u, tail=tail)
        if node.stored_blocks and (i_u + node.stored_blocks) * BS > self.size:
            raise self.bad(f"nid {nid}: data blocks past the image")
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
    return walk(ImageReader(read, size, where))


def walk(img: ImageReader) -> LayerImage:
    """Every path of the image `img` reads, from its root directory, as the kernel would."""
    nodes: dict[bytes, Node] = {}
    children: dict[bytes, tuple[bytes, ...]] = {}
    cache: dict[int, Node] = {}
    root = img.node(img.sb.root_nid)
    if root.kind is not Kind.DIR:
        raise img.bad("the root is not a directory")
    nodes[b""] = root
    stack = [(b"", root, 0)]
    seen_dirs = {img.sb.root_nid}
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
    return LayerImage(size=img.size, blocks=img.blocks, nodes=nodes, children=children, sb=img.sb)


def in_write_order(image: LayerImage) -> Iterator[tuple[bytes, Node]]:
    """Every path of `image` in the order this builder writes a tree: a directory, then its
    other entries, then each of its subdirectories in turn; names sorted bytewise."""
    stack = [b""]
    while stack:
        path = stack.pop()
        yield path, image.nodes[path]
        subdirs = []
        for name in image.children[path]:
            cpath = path + b"/" + name if path else name
            node = image.nodes[cpath]
            if node.kind is Kind.DIR:
                subdirs.append(cpath)
            else:
                yield cpath, node
        stack.extend(reversed(subdirs))
