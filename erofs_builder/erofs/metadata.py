"""The metadata area of an EROFS image (pure): inodes, directories, xattrs, superblock.

`ImageWriter` builds a tree of `Inode`s while it streams file data into the data area; at the
end, `plan` places every inode record in the metadata area and `pack` produces its bytes and
the superblock. In between, the writer stores the blocks of large directories and the shared
xattr area in the data area (they hold nids and xattr ids, which `plan` decides), so that the
metadata area holds no absolute address of its own and can move as a whole.

A fresh metadata area, every part in content-defined groups that each start on a block:

    root block         the root directory alone in the first block (its nid must fit 16 bits,
                       and the whole block is its room to grow in later builds)
    addressed records  inodes that hold an absolute address (files with data blocks,
                       chunk-based files, symlinks stored in a block); groups end by path hash
    stable groups      inodes that depend only on their entry (small files with all their data
                       inline, empty files, inline symlinks, devices, fifos, sockets); groups
                       end by record hash
    directories        every other directory (they hold nids); small groups, ending by path hash

Inside a group, records are packed first-fit decreasing, so a record's nid depends on its group
alone, and a group keeps its blocks unless it outgrows them: an edited file moves the nids of
its own group only, and only the directories that name those records change.

With a parent image (`ParentMeta`), its metadata area comes first, byte for byte. A directory
whose path the parent has keeps its nid when it still fits in its old room; any other record
keeps its nid only when it is unchanged. Everything else goes after the parent's area, laid out
as above: a changed file's record moves, so the only old bytes it disturbs are its directory's
entry (in the small directory records) instead of whatever shares its old block. See
docs/erofs-builder.md.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import blake3

from layerstore.chunkmap import METADATA

from ..chunking import Cut, MetaSegment
from ..tree import Kind
from . import format as fmt

BS = fmt.BLOCK_SIZE
_FTYPE = {Kind.REG: fmt.FT_REG, Kind.DIR: fmt.FT_DIR, Kind.CHR: fmt.FT_CHR, Kind.BLK: fmt.FT_BLK,
          Kind.FIFO: fmt.FT_FIFO, Kind.SOCK: fmt.FT_SOCK, Kind.SYMLINK: fmt.FT_SYMLINK}
# stable groups: content-defined, between MIN and MAX bytes, about TARGET on average
GROUP_MIN, GROUP_TARGET, GROUP_MAX = 16 << 10, 64 << 10, 256 << 10
UUID_TAG = b"layerstore-erofs-v2\0"
MAX_DEAD = 0.25  # the share of a parent's area that may be dead before it is laid out afresh


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


def walk(root: Inode) -> list[tuple[Inode, Inode, bytes]]:
    """(inode, parent directory, path) with each directory followed by its non-directory
    entries, then its subdirectories in turn; names sorted bytewise; each inode once (a hard
    link is reached under its first path in this order)."""
    out: list[tuple[Inode, Inode, bytes]] = []
    seen: set[int] = set()
    stack = [(root, root)]
    while stack:
        d, parent = stack.pop()
        out.append((d, parent, d.path))
        subdirs = []
        children = d.children
        assert children is not None
        prefix = d.path + b"/" if d.path else b""
        for name in sorted(children):
            child = children[name]
            if child.children is not None:
                subdirs.append(child)
            elif child.nlink == 1:
                out.append((child, d, prefix + name))
            elif id(child) not in seen:  # hard links: the first name in this order
                seen.add(id(child))
                out.append((child, d, prefix + name))
        stack.extend((sub, d) for sub in reversed(subdirs))
    return out


def build_time_of(nodes: list[Inode]) -> tuple[int, int]:
    """The most common (mtime, nsec): those inodes can be compact. Ties go to the earliest."""
    counts = Counter([(n.mtime, n.nsec) for n in nodes])
    best = max(counts.values())
    return min(k for k, v in counts.items() if v == best)


@dataclass(frozen=True, slots=True)
class Slot:
    """Where a parent image holds a live record: its position in the metadata area, the bytes
    it may use there (up to the next live record, never across a block unless it is bigger
    than one), and its bytes."""

    pos: int
    room: int
    raw: bytes


@dataclass(frozen=True)
class ParentMeta:
    """What a build keeps from its parent's metadata (parent.py reads it from the image)."""

    area: bytes  # the parent's metadata area, byte for byte (a whole number of blocks)
    slots: dict[bytes, Slot]  # live records by path; b"" is the root
    build_time: tuple[int, int]
    xattr_area: bytes  # the parent's shared xattr area: its ids stay valid here
    xattr_ids: dict[tuple[bytes, bytes], int]
    cuts: tuple[tuple[int, int], ...]  # the parent's metadata chunks, offsets relative to the area
    uuid: bytes


class _Rec:
    __slots__ = ("node", "parent", "path", "extended", "xbody", "extra", "total", "pos", "names", "raw")

    def __init__(self, node: Inode, parent: Inode, path: bytes) -> None:
        self.node, self.parent, self.path = node, parent, path
        self.pos = 0
        self.names: list[bytes] = []
        self.raw = b""


def _shared_xattrs(nodes: list[Inode], parent: ParentMeta | None) -> tuple[bytes, dict[tuple[bytes, bytes], int]]:
    """(name, value) pairs that more than one inode carries go to the shared area once. A
    parent's area is kept as it is (its ids stay valid) and new pairs are appended."""
    counts = Counter([kv for n in nodes if n.xattrs for kv in n.xattrs.items()])
    area = bytearray(parent.xattr_area if parent else b"")
    ids = dict(parent.xattr_ids) if parent else {}
    for (k, v) in sorted(kv for kv, c in counts.items() if c > 1 and kv not in ids):
        ids[(k, v)] = len(area) // 4
        area += fmt.xattr_entry(*fmt.split_xattr_name(k), v)
    return bytes(area), ids


def _xattr_body(node: Inode, ids: dict[tuple[bytes, bytes], int]) -> bytes:
    if not node.xattrs:
        return b""
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
        self.open: list[list[int]] = []  # the last OPEN blocks: [block start, bytes used (32-aligned)]
        self.room: list[list[int]] = []  # those of them not full yet, in the same order

    def place(self, total: int) -> int:
        if total > BS:
            pos = self.end
            self.end += fmt.align(total, BS)
            if total % BS:
                self._open([self.end - BS, fmt.align(total % BS, fmt.ISLOT)], trim=False)
            return pos
        limit = BS - total
        for blk in self.room:
            if blk[1] <= limit:
                pos = blk[0] + blk[1]
                blk[1] = used = (blk[1] + total + fmt.ISLOT - 1) & -fmt.ISLOT
                if used >= BS:
                    self.room.remove(blk)
                return pos
        pos = self.end
        self.end += BS
        self._open([pos, fmt.align(total, fmt.ISLOT)])
        return pos

    def _open(self, blk: list[int], trim: bool = True) -> None:
        self.open.append(blk)
        if blk[1] < BS:
            self.room.append(blk)
        if trim and len(self.open) > self.OPEN:
            old = self.open.pop(0)
            if self.room and self.room[0] is old:
                self.room.pop(0)

    def close(self) -> int:
        self.open.clear()
        self.room.clear()
        return self.end


def _pack(rec: _Rec, nid_of: dict[int, int], i_u: int) -> bytes:
    """The record's bytes. `i_ino` is a CRC of the record itself, not a position: the kernel
    derives inode numbers from nids, and a position would change the bytes whenever anything
    before the record moves."""
    n = rec.node
    layout = n.layout
    if layout == fmt.LAYOUT_CHUNK_BASED:
        extra = b"".join([x.to_bytes(4, "little") for x in n.blockmap])
    elif n.children is not None:
        extra = dir_bytes(rec, nid_of) if layout == fmt.LAYOUT_FLAT_INLINE else b""
    else:
        extra = n.inline
    xbody = rec.xbody
    icount = fmt.xattr_icount(len(xbody)) if xbody else 0
    mode = n.kind.value | n.mode
    if rec.extended:  # i_ino (0 here) is filled in below, as a CRC of the rest
        head = fmt.EXTENDED_INODE.pack(fmt.VERSION_EXTENDED | (layout << 1), icount, mode, 0, n.size, i_u, 0,
                                       n.uid, n.gid, n.mtime, n.nsec, n.nlink)
    else:
        head = fmt.COMPACT_INODE.pack(layout << 1, icount, mode, n.nlink, n.size, 0, i_u, 0, n.uid, n.gid, 0)
    tail = xbody + extra if xbody else extra
    crc = zlib.crc32(tail, zlib.crc32(head))
    return b"".join((head[:fmt.INO_OFFSET], crc.to_bytes(4, "little"), head[fmt.INO_OFFSET + 4:], tail))


def dir_bytes(rec: _Rec, nid_of: dict[int, int]) -> bytes:
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


def _i_u(rec: _Rec) -> int:
    n = rec.node
    if n.layout == fmt.LAYOUT_CHUNK_BASED:
        return n.chunkbits
    if n.kind in (Kind.CHR, Kind.BLK):
        return n.rdev
    return n.blkaddr


@dataclass
class Plan:
    """Every record placed (`pos` relative to the metadata area), the non-directory records
    packed. `dir_blocks` are the directories whose entries need blocks of their own; the writer
    stores those, and the shared xattr area, in the data area and then calls `pack`."""

    recs: list[_Rec]
    nid_of: dict[int, int]
    build_time: tuple[int, int]
    xattr_area: bytes
    length: int  # of the metadata area, block aligned
    segments: list[MetaSegment]  # offsets relative to the area
    parent: ParentMeta | None
    dir_blocks: list[tuple[_Rec, bytes]] = field(default_factory=list)
    kept: int = 0  # records that kept the parent's nid


_COMPACT_UID_MAX = 0xFFFF


def _record(node: Inode, parent: Inode, path: bytes, bt: tuple[int, int], ids: dict[tuple[bytes, bytes], int]) -> _Rec:
    rec = _Rec(node, parent, path)
    rec.extended = extended = (node.mtime != bt[0] or node.nsec != bt[1] or node.uid > _COMPACT_UID_MAX
                               or node.gid > _COMPACT_UID_MAX or node.size >= 1 << 32 or node.nlink > 0xFFFF)
    rec.xbody = xbody = _xattr_body(node, ids) if node.xattrs else b""
    head = (fmt.EXTENDED_SIZE if extended else fmt.COMPACT_SIZE) + len(xbody)
    if node.children is not None:
        rec.names = names = sorted([*node.children, b".", b".."])
        node.size = fmt.dir_size(names)
        inline = head + node.size <= BS
        node.layout = fmt.LAYOUT_FLAT_INLINE if inline else fmt.LAYOUT_FLAT_PLAIN
        rec.extra = node.size if inline else 0
    elif node.layout == fmt.LAYOUT_CHUNK_BASED:
        rec.extra = 4 * len(node.blockmap)
    else:
        rec.extra = len(node.inline)
    rec.total = head + rec.extra
    return rec


def plan(root: Inode, parent: ParentMeta | None = None, max_dead: float = MAX_DEAD) -> Plan:
    """Place every inode reachable from `root`. With `parent`, records keep the parent's nids
    where they can (see the module docstring). The parent's area is set aside (the metadata
    laid out afresh) if the root cannot keep its nid, or if fewer than 1 - `max_dead` of its
    blocks would still hold a record."""
    triples = walk(root)
    nodes = [n for n, _p, _path in triples]
    for n in nodes:
        if n.children is not None:
            n.nlink = 2 + sum(1 for c in n.children.values() if c.kind is Kind.DIR)
    bt = parent.build_time if parent else build_time_of(nodes)
    area, ids = _shared_xattrs(nodes, parent)
    recs = [_record(n, p, path, bt, ids) for n, p, path in triples]
    for rec in recs:
        if rec.node.kind is not Kind.DIR:
            rec.raw = _pack(rec, {}, _i_u(rec))
    if parent is not None and (b"" not in parent.slots or recs[0].total > parent.slots[b""].room):
        parent = None  # the root must keep a nid that fits the superblock: lay out afresh
    keep: dict[int, int] = {}
    if parent is not None:
        for rec in recs:
            slot = parent.slots.get(rec.path)
            if slot is not None and rec.total <= slot.room and (rec.node.kind is Kind.DIR or rec.raw == slot.raw):
                keep[id(rec)] = slot.pos
        live = {b for rec in recs if id(rec) in keep
                for b in range(keep[id(rec)] // BS, (keep[id(rec)] + rec.total - 1) // BS + 1)}
        if len(live) < (1 - max_dead) * (len(parent.area) // BS):
            parent, keep = None, {}
    segments: list[MetaSegment] = []
    if parent is None:
        recs[0].pos = 0  # the root alone in the first block
        start = fmt.align(recs[0].total, BS)
        segments.append(MetaSegment(0, start, False, dirs=True))
        rest = recs[1:]
    else:
        start = len(parent.area)
        rest = []
        for rec in recs:
            if id(rec) in keep:
                rec.pos = keep[id(rec)]
            else:
                rest.append(rec)
    cursor = _append(rest, start, segments)
    # fsck.erofs (1.5) reads an xattr header after every inode, xattrs or not: a record that
    # ends at the very end of the image fails its check, so give it a block to read
    if max(r.pos + r.total for r in recs) + fmt.XATTR_IBODY_HEADER > cursor:
        segments.append(MetaSegment(cursor, BS, False))
        cursor += BS
    nid_of = {id(rec.node): rec.pos // fmt.ISLOT for rec in recs}
    p = Plan(recs=recs, nid_of=nid_of, build_time=bt, xattr_area=area, length=cursor, segments=segments,
             parent=parent, kept=len(keep))
    for rec in recs:
        if rec.node.kind is Kind.DIR and rec.node.layout == fmt.LAYOUT_FLAT_PLAIN:
            p.dir_blocks.append((rec, dir_bytes(rec, nid_of)))
    return p


def _append(recs: list[_Rec], cursor: int, segments: list[MetaSegment]) -> int:
    """Lay out records from `cursor` (block aligned) in content-defined groups, each starting on
    a block: first the records that hold an address, then the position-independent (stable)
    ones, then the directories. Returns the new end.

    A group's records are packed first-fit decreasing, so where a record lands depends on its
    group alone, and a group keeps its blocks unless it outgrows them: a changed record moves
    only the nids of its own group, and only the directories that name those change. The
    directories go last because they change size most often (a file added or removed)."""
    dirs: list[_Rec] = []
    addressed: list[_Rec] = []
    stable: list[_Rec] = []
    for r in recs:
        if r.node.children is not None:
            dirs.append(r)
        elif r.node.has_address:
            addressed.append(r)
        else:
            stable.append(r)
    cursor = _groups(addressed, cursor, segments, kind=_ADDRESSED)
    cursor = _groups(stable, cursor, segments, kind=_STABLE)
    return _groups(dirs, cursor, segments, kind=_DIRS)


# group sizes (min, target, max) by kind; directory groups stay small (a parent build rewrites
# directories in place, and a chunk is the unit it rewrites)
_ADDRESSED, _STABLE, _DIRS = 0, 1, 2
_GROUP_SIZES = {_ADDRESSED: (GROUP_MIN, GROUP_TARGET, GROUP_MAX), _STABLE: (GROUP_MIN, GROUP_TARGET, GROUP_MAX),
                _DIRS: (8 << 10, 32 << 10, 64 << 10)}


def _groups(recs: list[_Rec], cursor: int, segments: list[MetaSegment], kind: int) -> int:
    """Place `recs` in content-defined groups from `cursor`. A group ends after a record whose
    key hash falls under a threshold proportional to its size (so groups are about `target`
    long whatever the record sizes): for stable records the key is the record itself, for the
    others (whose bytes change when data or nids move) its path."""
    gmin, target, gmax = _GROUP_SIZES[kind]
    scale = (1 << 32) / (target - gmin)
    group: list[_Rec] = []
    glen = ghash = 0
    last = len(recs) - 1
    for i, rec in enumerate(recs):
        group.append(rec)
        size = fmt.align(rec.total, fmt.ISLOT)
        glen += size
        key = zlib.crc32(rec.raw) if kind == _STABLE else (zlib.crc32(rec.path) * 0x9E3779B1) & 0xFFFFFFFF
        ghash = zlib.crc32(key.to_bytes(4, "little"), ghash)
        length = len(rec.raw) if kind == _STABLE else size
        if i == last or glen >= gmax or (glen >= gmin and key < length * scale):
            # first-fit decreasing inside the group: dense, and still a function of the group alone
            packer = _Packer(cursor)
            for r in sorted(group, key=lambda r: -r.total):
                r.pos = packer.place(r.total)
            end = packer.close()
            segments.append(MetaSegment(cursor, end - cursor, kind == _STABLE, ghash, dirs=kind == _DIRS,
                                        grouped=True))
            cursor = end
            group, glen, ghash = [], 0, 0
    return cursor


@dataclass(frozen=True)
class Metadata:
    """What `pack` produces: the metadata area (written at `meta_start`), the superblock's
    block (block 0), the metadata segments and the cuts inherited from a parent (absolute)."""

    meta: bytes | bytearray
    block0: bytes
    segments: tuple[MetaSegment, ...]
    inherited: tuple[Cut, ...]


def pack(p: Plan, *, dir_addr: dict[int, int], xattr_blkaddr: int, meta_start: int,
         data_digests: Sequence[bytes]) -> Metadata:
    """The metadata area's bytes (records at their places, over the parent's area if any) and
    the superblock. `dir_addr` maps id(directory record) to the block of its entries."""
    meta = bytearray(p.length)
    if p.parent is not None:
        meta[:len(p.parent.area)] = p.parent.area
    for rec in p.recs:
        if rec.node.kind is Kind.DIR:
            rec.node.blkaddr = dir_addr.get(id(rec), 0)
            rec.raw = _pack(rec, p.nid_of, rec.node.blkaddr)
        meta[rec.pos:rec.pos + len(rec.raw)] = rec.raw
    size = meta_start + len(meta)
    h = blake3.blake3(UUID_TAG)
    if p.parent is not None:
        h.update(p.parent.uuid)
    h.update(b"".join(data_digests))
    h.update(meta)
    uuid = bytearray(h.digest()[:16])
    uuid[6] = (uuid[6] & 0x0F) | 0x80  # RFC 9562 version 8 (custom), variant 10
    uuid[8] = (uuid[8] & 0x3F) | 0x80
    chunked = any(r.node.layout == fmt.LAYOUT_CHUNK_BASED for r in p.recs)
    bt = p.build_time
    sb = fmt.pack_superblock(root_nid=p.nid_of[id(p.recs[0].node)], inos=len(p.recs), build_time=bt[0],
                             build_time_nsec=bt[1], blocks=size // BS, meta_blkaddr=meta_start // BS,
                             xattr_blkaddr=xattr_blkaddr, uuid=bytes(uuid),
                             feature_incompat=fmt.FEATURE_INCOMPAT_CHUNKED_FILE if chunked else 0)
    block0 = bytearray(BS)
    block0[fmt.SUPER_OFFSET:fmt.SUPER_OFFSET + len(sb)] = sb
    inherited = tuple(Cut(meta_start + off, n, METADATA) for off, n in p.parent.cuts) if p.parent else ()
    segments = tuple(dataclasses.replace(s, offset=meta_start + s.offset) for s in p.segments)
    return Metadata(meta=meta, block0=bytes(block0), segments=segments, inherited=inherited)
