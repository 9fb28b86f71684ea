"""The metadata area of an EROFS image (pure): inodes, directories, xattrs, superblock.

`lay_out` takes the tree of `Inode`s that `ImageWriter` built while it streamed file data into
the data area, and returns the bytes of the metadata area plus the superblock:

    volatile records   the root directory first (nid 0), then every inode that holds an
                       absolute address (directories, files with data blocks, chunk-based
                       files, symlinks stored in a block)
    stable groups      inodes that depend only on their entry (small files with all their data
                       inline, empty files, inline symlinks, devices, fifos, sockets), in
                       content-defined groups that each start on a block
    directory blocks   of directories too big to be inline
    shared xattrs      (name, value) pairs carried by more than one inode

See docs/erofs-builder.md for why the records are split that way.
"""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import blake3

from . import format as fmt
from .chunking import MetaSegment
from .tree import Kind

BS = fmt.BLOCK_SIZE


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


@dataclass(frozen=True)
class Metadata:
    """What `lay_out` produces: the metadata area (written at `meta_start`), the superblock's
    block (block 0) and the metadata segments the chunker needs."""

    meta: bytes
    block0: bytes
    segments: tuple[MetaSegment, ...]


def lay_out(root: Inode, meta_start: int, data_digests: Sequence[bytes]) -> Metadata:
    """Lay out every inode reachable from `root` into a metadata area starting at byte
    `meta_start` (block aligned, right after the data area). Pure: no I/O."""
    pairs = list(walk(root))
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
    h.update(b"".join(data_digests))
    h.update(meta)
    uuid = bytearray(h.digest()[:16])
    uuid[6] = (uuid[6] & 0x0F) | 0x80  # RFC 9562 version 8 (custom), variant 10
    uuid[8] = (uuid[8] & 0x3F) | 0x80
    chunked = any(n.layout == fmt.LAYOUT_CHUNK_BASED for n in nodes)
    sb = fmt.pack_superblock(root_nid=nid_of[id(root)], inos=len(nodes), build_time=bt[0], build_time_nsec=bt[1],
                             blocks=size // BS, meta_blkaddr=meta_start // BS, xattr_blkaddr=xattr_blkaddr,
                             uuid=bytes(uuid), feature_incompat=fmt.FEATURE_INCOMPAT_CHUNKED_FILE if chunked else 0)
    block0 = bytearray(BS)
    block0[fmt.SUPER_OFFSET:fmt.SUPER_OFFSET + len(sb)] = sb
    return Metadata(meta=bytes(meta), block0=bytes(block0), segments=tuple(segments))
