"""Cut an EROFS image into content-defined chunks (pure).

The writer describes its image as an `ImageLayout`: the superblock block, the data extents
(one per stored run of a regular file, each starting on a block boundary), and the metadata
segments (volatile ones that hold absolute addresses, and stable groups whose bytes depend only
on the entries they describe). `cut` turns that into chunk boundaries so that identical content
gives identical chunks in different images:

- a big extent (>= `big`) is cut alone at fixed offsets from its own start, `max_chunk` apart;
- small extents are grouped without ever splitting one; a group ends after an extent whose
  hint (a hash of the file's name) falls under a threshold proportional to its length (so an
  insertion or a change disturbs only its own group, and an edit that keeps the name moves no
  boundary), or before it would outgrow `max_group`;
- large directories' blocks and the shared xattrs, which sit in the data area, form METADATA
  chunks of their own (up to `meta_chunk`);
- metadata groups (content-defined groups of records, see metadata.py) are merged with their
  neighbours of the same kind into chunks of about `meta_target`, up to `max_chunk` (up to
  `dir_chunk` for directories, which a parent build rewrites in place), ending after a group
  whose hash falls under a threshold proportional to its length; other metadata is cut at
  fixed offsets;
- cuts inherited from a parent image are repeated as they are;
- every metadata chunk carries the METADATA flag; the chunks cover the image contiguously.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from layerstore.chunkmap import METADATA

SLICE = 1 << 20  # the default `max_chunk`: data runs are hashed in pieces this long as they are written


@dataclass(frozen=True, slots=True)
class DataExtent:
    offset: int
    length: int
    hint: int  # 32-bit hash used for group boundaries (of the file's name)
    meta: bool = False  # blocks of a large directory, or the shared xattrs: chunked as metadata
    slices: tuple[bytes, ...] = ()  # blake3 of each SLICE piece from `offset`, when known


@dataclass(frozen=True, slots=True)
class MetaSegment:
    offset: int
    length: int
    stable: bool  # a content-defined group of position-independent inode records
    hint: int = 0  # stable groups: a 32-bit hash of the group's bytes (where merged chunks end)
    dirs: bool = False  # directories (the records a parent build rewrites in place)
    grouped: bool = False  # a content-defined group of records (stable or not): merged with its like


@dataclass(frozen=True, slots=True)
class Cut:
    offset: int
    length: int
    flags: int = 0


@dataclass(frozen=True)
class ImageLayout:
    size: int
    data_start: int
    data_end: int  # == start of the metadata region
    extents: tuple[DataExtent, ...] = ()
    meta: tuple[MetaSegment, ...] = ()
    files: int = 0
    extra: dict[str, int] = field(default_factory=dict)
    # cuts taken over from a parent image: its data area (from `data_start`) and its metadata
    # area (right after `data_end`), which this image holds byte for byte or nearly so
    inherited_data: tuple[Cut, ...] = ()
    inherited_meta: tuple[Cut, ...] = ()


@dataclass(frozen=True)
class ChunkPolicy:
    """Chunk sizes; docs/benchmarks-build.md has the measured trade-off between chunk count and
    deduplication behind the defaults."""

    max_chunk: int = SLICE  # big files are cut this far apart, from their own start
    big: int = 64 << 10  # a run at least this long is chunked alone
    min_group: int = 32 << 10
    target_group: int = 128 << 10
    max_group: int = 256 << 10
    # metadata (docs/benchmarks-build.md: the fewer chunks, the fewer requests a cold mount makes)
    meta_chunk: int = SLICE  # records that hold addresses are cut at fixed offsets this far apart
    dir_chunk: int = 64 << 10  # ... the directories among them this far apart (a parent build rewrites them)
    meta_target: int = 256 << 10  # stable groups merged into content-defined chunks this long (0: not merged)


def _boundary_after(ext: DataExtent, policy: ChunkPolicy) -> bool:
    span = max(1, policy.target_group - policy.min_group)
    # multiplicative mixing spreads crc-like hints; the threshold makes the expected group
    # size about `target_group` whatever the file sizes are
    mixed = (ext.hint * 0x9E3779B1) & 0xFFFFFFFF
    return mixed < min(1.0, ext.length / span) * 0xFFFFFFFF


class DataCutter:
    """The data area's part of `cut`, one extent at a time, in the order the writer lays them
    out (the only implementation of it: `cut` feeds it the finished layout's extents, and a
    build that compresses while it writes feeds it each extent as soon as it is written).
    `feed` appends the cuts it closes; a cut, once closed, never changes, since it depends only
    on the extents before it and the one that closed it. `finish` closes the open group, up to
    the end of the data area."""

    def __init__(self, start: int, policy: ChunkPolicy | None = None) -> None:
        self.policy = policy or ChunkPolicy()
        self.group_start = start
        self.group_len = 0
        self.group_flags = 0

    def feed(self, ext: DataExtent, out: list[Cut]) -> None:
        p = self.policy
        if ext.offset != self.group_start + self.group_len:  # defensive: an unexpected gap joins the group
            self.group_len = ext.offset - self.group_start
        flags = METADATA if ext.meta else 0
        if flags != self.group_flags:
            self._flush(out)
            self.group_flags = flags
        end = ext.offset + ext.length
        if ext.meta:  # consecutive metadata extents share chunks of up to meta_chunk
            if ext.length > p.meta_chunk:
                self._flush(out)
                out.extend(_fixed(ext.offset, ext.length, p.meta_chunk, METADATA))
                self.group_start = end
                return
            if self.group_len + ext.length > p.meta_chunk:
                self._flush(out)
            self.group_len += ext.length
            return
        if ext.length >= p.big:
            self._flush(out)
            out.extend(_fixed(ext.offset, ext.length, p.max_chunk, 0))
            self.group_start = end
            return
        if self.group_len and self.group_len + ext.length > p.max_group:
            self._flush(out)
        self.group_len += ext.length
        if self.group_len >= p.min_group and _boundary_after(ext, p):
            self._flush(out)

    def finish(self, data_end: int, out: list[Cut]) -> None:
        if data_end > self.group_start + self.group_len:
            self.group_len = data_end - self.group_start
        self._flush(out)

    def _flush(self, out: list[Cut]) -> None:
        if self.group_len:
            out.append(Cut(self.group_start, self.group_len, self.group_flags))
            self.group_start += self.group_len
            self.group_len = 0


def _meta_boundary_after(seg: MetaSegment, target: int) -> bool:
    """Whether a chunk of merged metadata groups ends after `seg`: a threshold on the group's
    hash, proportional to its length, so chunks are ~`target` long and resynchronise after a
    changed group."""
    mixed = (seg.hint * 0x9E3779B1) & 0xFFFFFFFF
    return mixed < min(1.0, seg.length / target) * 0xFFFFFFFF


def _fixed(offset: int, length: int, step: int, flags: int) -> Iterable[Cut]:
    for off in range(offset, offset + length, step):
        yield Cut(off, min(step, offset + length - off), flags)


def cut(layout: ImageLayout, policy: ChunkPolicy | None = None) -> list[Cut]:
    policy = policy or ChunkPolicy()
    out: list[Cut] = []
    pos = 0

    def emit(c: Cut) -> None:
        nonlocal pos
        assert c.offset == pos and c.length > 0, (c, pos)
        out.append(c)
        pos = c.offset + c.length

    if layout.data_start:
        emit(Cut(0, layout.data_start, METADATA))
    for c in layout.inherited_data:
        emit(c)

    data: list[Cut] = []
    cutter = DataCutter(pos, policy)
    for ext in layout.extents:
        cutter.feed(ext, data)
    cutter.finish(layout.data_end, data)
    for c in data:
        emit(c)

    for c in layout.inherited_meta:
        emit(c)
    run_start = run_len = 0  # consecutive groups of one kind being merged into one chunk
    run_kind: tuple[bool, bool] = (False, False)

    def end_run() -> None:
        nonlocal run_len
        if run_len:
            emit(Cut(run_start, run_len, METADATA))
            run_len = 0

    for seg in layout.meta:
        grouped = seg.stable or seg.grouped
        kind = (seg.stable, seg.dirs)
        # directories' chunks stay small (a parent build rewrites them in place); the others
        # merge up to max_chunk
        cap, target = (policy.dir_chunk, policy.dir_chunk) if seg.dirs else (policy.max_chunk, policy.meta_target)
        mergeable = grouped and seg.length <= cap
        if not (mergeable and run_len and kind == run_kind and seg.offset == run_start + run_len):
            end_run()
        if not run_len and seg.offset > pos:  # defensive: bytes between segments become their own chunk
            emit(Cut(pos, seg.offset - pos, METADATA))
        if mergeable:
            if run_len + seg.length > cap:
                end_run()
            if not run_len:
                run_start, run_kind = seg.offset, kind
            run_len += seg.length
            if not target or _meta_boundary_after(seg, target):
                end_run()
        else:
            step = cap if grouped else policy.dir_chunk if seg.dirs else policy.meta_chunk
            for c in _fixed(seg.offset, seg.length, step, METADATA):
                emit(c)
    end_run()
    if layout.size > pos:
        for c in _fixed(pos, layout.size - pos, policy.max_chunk, METADATA):
            emit(c)
    return out


def check_cover(cuts: list[Cut], size: int) -> None:
    pos = 0
    for c in cuts:
        if c.offset != pos or c.length <= 0:
            raise ValueError(f"chunk at {c.offset} (+{c.length}) does not follow {pos}")
        pos += c.length
    if pos != size:
        raise ValueError(f"chunks cover {pos} of {size} bytes")
