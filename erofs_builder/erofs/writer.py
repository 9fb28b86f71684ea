"""A pure-Python EROFS image writer: 4 KiB blocks, uncompressed, reproducible.

`ImageWriter` keeps the entry bookkeeping (the tree of inodes, hard links, implicit parents,
validation) and hands regular-file data to the data area (dataarea.py) as entries are added; the
image file is the only buffer for file data. `finish` has metadata.py place every inode, stores
large directories and the shared xattrs in the data area, writes the metadata area after it and
the superblock into block 0. Layout: docs/erofs-builder.md.
"""

from __future__ import annotations

from typing import BinaryIO

from layerstore.errors import BadInput

from ..chunking import DataExtent, ImageLayout
from ..tree import Data, Entry, Hole, Kind, check_path
from . import format as fmt
from .dataarea import DataArea, pad
from .metadata import MAX_DEAD, Inode, pack, plan
from .parent import ParentImage

BS = fmt.BLOCK_SIZE
PATH_MAX = 4096
PACK_TAILS = BS // 2


class ImageWriter:
    def __init__(self, out: BinaryIO, *, mtime_clamp: int | None = None, all_root: bool = False,
                 pack_tails: bool | int = PACK_TAILS, parent: ParentImage | None = None,
                 max_dead: float = MAX_DEAD) -> None:
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
        self._dirs: dict[bytes, Inode] = {b"": self._root}  # every directory by path
        self._paths = 1
        self._finished = False
        self._parent = parent
        self._max_dead = max_dead
        self._data = DataArea(out, parent)

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
        if node.kind is Kind.DIR:
            self._dirs[path] = node
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
        parent = path.rpartition(b"/")[0]
        node = self._dirs.get(parent)  # most entries follow their directory: no walk from the root
        if node is not None:
            return node
        node = self._root
        done = []
        for comp in parent.split(b"/"):
            done.append(comp)
            nxt = node.children.get(comp)  # type: ignore[union-attr]
            if nxt is None:
                nxt = Inode(Kind.DIR, b"/".join(done))
                nxt.mtime = self._clamp or 0
                node.children[comp] = nxt  # type: ignore[index]
                self._dirs[nxt.path] = nxt
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

    @property
    def data_extents(self) -> list[DataExtent]:
        """The data area's extents so far (the live list: it only grows while entries are added,
        and an extent never changes once `add` has returned)."""
        return self._data.extents

    @property
    def data_pos(self) -> int:
        """Where the next data run goes."""
        return self._data.pos

    def data_layout(self) -> ImageLayout:
        """The data area written so far, as a layout (for hashing its chunks early: `finish`
        only appends to it)."""
        par, data = self._parent, self._data
        return ImageLayout(size=data.pos, data_start=BS, data_end=data.pos, extents=tuple(data.extents),
                           inherited_data=par.data_cuts if par else ())

    def finish(self) -> ImageLayout:
        """Write the metadata and the superblock; the image is complete afterwards."""
        if self._finished:
            raise BadInput("image writer already finished")
        self._finished = True
        parent = self._parent
        p = plan(self._root, parent.meta if parent else None, max_dead=self._max_dead)
        # entries of large directories and the shared xattrs go to the data area: they hold
        # nids and xattr ids, but their own addresses then sit outside the metadata area
        data = self._data
        dir_addr = {id(rec): data.store_run(pad(raw), rec.path, meta=True) // BS for rec, raw in p.dir_blocks}
        xattr_blkaddr = data.store_run(pad(p.xattr_area), b"", meta=True) // BS if p.xattr_area else 0
        meta_start = data.pos
        md = pack(p, dir_addr=dir_addr, xattr_blkaddr=xattr_blkaddr, meta_start=meta_start,
                  data_digests=data.digests)
        size = meta_start + len(md.meta)
        out = self._out
        out.seek(meta_start)
        out.write(md.meta)
        out.seek(0)
        out.write(md.block0)
        out.truncate(size)
        out.flush()
        extra = {"kept_records": p.kept, "records": len(p.recs)}
        return ImageLayout(size=size, data_start=BS, data_end=meta_start, extents=tuple(data.extents),
                           meta=md.segments, files=self._paths, extra=extra,
                           inherited_data=parent.data_cuts if parent else (), inherited_meta=md.inherited)

    # -- content --------------------------------------------------------------------------
    def _inline_room(self, node: Inode) -> int:
        """Bytes left in one block after the inode and all its xattrs inline (worst case)."""
        x = 0
        if node.xattrs:
            x = fmt.XATTR_IBODY_HEADER + sum(
                len(fmt.xattr_entry(*fmt.split_xattr_name(k), v)) for k, v in node.xattrs.items())
        return BS - fmt.EXTENDED_SIZE - x

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
            node.blkaddr = self._data.store_run(pad(target), path) // BS

    def _store_file(self, node: Inode, data: Data, path: bytes) -> None:
        size = node.size
        if size == 0:
            _drain_empty(data, path)
            return
        room = self._inline_room(node)
        # the whole content in one buffer (small files from a directory): no streaming needed
        whole = (type(data) is tuple and len(data) == 1 and not isinstance(data[0], Hole)
                 and len(data[0]) == size)
        if size < BS and size <= room:
            node.inline = bytes(data[0]) if whole else _gather(data, size, path)  # type: ignore[index]
            node.layout = fmt.LAYOUT_FLAT_INLINE
            return
        tail_room = min(room, self._tail_max) if self._tail_max else -1
        if whole:
            self._data.store_whole(node, data[0], path, tail_room)  # type: ignore[index]
        else:
            self._data.store_file(node, data, path, tail_room)


def _gather(data: Data, size: int, path: bytes) -> bytes:
    """The `size` bytes of a small file's data, checked against its announced size."""
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
    return bytes(buf)


def _drain_empty(data: Data | None, path: bytes) -> None:
    if data is None:
        return
    for item in data:
        if isinstance(item, Hole) and item.length == 0:
            continue
        if not isinstance(item, Hole) and not len(item):
            continue
        raise BadInput(f"{path!r}: data given for an entry that holds none")
