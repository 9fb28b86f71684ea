"""Chunk maps: which chunks, in order, with offsets and lengths, make one blob (pure).

A blob (an EROFS image, or any file) is cut into contiguous, non-overlapping chunks that cover it
exactly. Each entry carries flags; `METADATA` marks the chunks a reader should fetch first (the
superblock, inodes, directories of an EROFS image).

A blob's id is a tree hash that its chunk map proves by itself:

    blob id = blake3(b"layerstore chunk list v2\0" | blob size u64 | count u64 | entry x count)
    entry   = offset u64 | length u32 | flags u32 | chunk digest 32B                 (48 bytes)

(little-endian). Every chunk's id is the blake3 of its bytes, checked on every fetch, so the blob
id names every byte of the blob: whoever can write the store cannot swap or forge the map of a
signed layer, because `decode` recomputes the id and refuses a map that is not `blob`'s.

Binary encoding of a map (format 2), little-endian:

    header  magic b"LSCM" | version u8 (2) | 3 zero bytes | count u32 | blob size u64
    entries count x entry (as above)

Format 1 named a blob by the blake3 of its whole content, which a map cannot prove; such maps
are refused with a message that says to rebuild and push the layer (or `layerctl store migrate`).
"""

from __future__ import annotations

import bisect
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import blake3

from . import digest as digestmod
from .errors import CorruptObject

MAGIC = b"LSCM"
VERSION = 2
VERSION_WHOLE_FILE = 1  # the old format: the blob id was the blake3 of the whole file
METADATA = 1
KNOWN_FLAGS = METADATA
ID_DOMAIN = b"layerstore chunk list v2\0"
_HEAD = struct.Struct("<4sB3sIQ")
_HEAD_1 = struct.Struct("<4sB3xIQ32s")  # format 1: ... | blob's whole-file digest
_ID_HEAD = struct.Struct("<QQ")
_ENTRY = struct.Struct("<QII32s")
HEADER_SIZE = _HEAD.size  # 20
ENTRY_SIZE = _ENTRY.size  # 48
MAX_CHUNK_LEN = 64 << 20
# More entries than this are refused on encode and decode: it bounds what a reader allocates
# for a map (192 MiB), and a writer cannot make a map that readers refuse.
MAX_ENTRIES = 1 << 22
MAX_ENCODED = _HEAD.size + MAX_ENTRIES * _ENTRY.size
# A blob may have more than SMALL_MAP entries only if they average at least MIN_AVG_CHUNK bytes
# (`max_entries`). Every map our writers make passes: the EROFS builder cuts whole 4 KiB blocks
# (data runs are padded to a block and start on one, metadata groups are whole blocks) and
# `Store.put_blob` cuts fixed pieces of 1 MiB by default (4 KiB at the least the tests use).
MIN_AVG_CHUNK = 4096
SMALL_MAP = 4096
# What a decoded entry costs in memory (a ChunkRef, its digest string, the offsets' list, the
# set of unique digests): measured 250-315 bytes on CPython 3.11 (tracemalloc, 100k entries)
DECODED_ENTRY = 320
MAX_ENCODED_1 = _HEAD_1.size + MAX_ENTRIES * _ENTRY.size + 32  # a format-1 map, read only to migrate it


def max_entries(size: int) -> int:
    """The most entries the map of a blob of `size` bytes may have: SMALL_MAP for any blob, more
    only at an average of MIN_AVG_CHUNK bytes an entry, never more than MAX_ENTRIES. A map over
    it is refused from its header (`check_head`), before its body is read or decoded: what a
    reader spends on a map is then proportional to the blob it describes."""
    return min(MAX_ENTRIES, max(SMALL_MAP, -(-size // MIN_AVG_CHUNK)))


def encoded_size(count: int) -> int:
    """The length of an encoded (format 2) map of `count` entries."""
    return _HEAD.size + count * _ENTRY.size


def check_head(data: bytes | bytearray | memoryview, blob: str) -> tuple[int, int]:
    """(entry count, blob size) of a map's header (its first HEADER_SIZE bytes, or more):
    `CorruptObject` for a header that is not format 2, or whose count is over `max_entries` of
    its size, or too few for its chunks (at most MAX_CHUNK_LEN each) to cover that size. Costs
    nothing whatever the map's size: callers check it before they read or decode the rest."""
    where = f"chunk map of {blob}"
    if len(data) < 5:
        raise CorruptObject(f"{where}: truncated ({len(data)} bytes)")
    if bytes(data[:4]) != MAGIC:
        raise CorruptObject(f"{where}: bad magic {bytes(data[:4])!r}")
    if data[4] == VERSION_WHOLE_FILE:
        raise CorruptObject(f"{where}: written by an older layerstore (chunk map format 1, which does not "
                            "prove its blob): rebuild the layer and push it again, or run "
                            "`layerctl store migrate`")
    if data[4] != VERSION:
        raise CorruptObject(f"{where}: unknown version {data[4]}")
    if len(data) < _HEAD.size:
        raise CorruptObject(f"{where}: truncated ({len(data)} bytes)")
    _magic, _version, reserved, count, size = _HEAD.unpack_from(data, 0)
    if reserved != bytes(3):
        raise CorruptObject(f"{where}: reserved header bytes set")
    if count > max_entries(size):
        raise CorruptObject(f"{where}: {count} entries for a blob of {size} bytes, more than "
                            f"{max_entries(size)} (at most {SMALL_MAP}, or one per {MIN_AVG_CHUNK} bytes)")
    if size > count * MAX_CHUNK_LEN:
        raise CorruptObject(f"{where}: {count} entries cannot cover a blob of {size} bytes")
    return count, size


def blob_id(size: int, refs: Sequence[ChunkRef]) -> str:
    """The id of the blob of `size` bytes cut into `refs` (in order)."""
    h = blake3.blake3(ID_DOMAIN)
    h.update(_ID_HEAD.pack(size, len(refs)))
    h.update(_entries(refs))
    return digestmod.PREFIX + h.hexdigest()


def _entries(refs: Sequence[ChunkRef]) -> bytes:
    return b"".join(_ENTRY.pack(c.offset, c.length, c.flags, digestmod.raw_of(c.digest)) for c in refs)


@dataclass(frozen=True, slots=True)
class ChunkRef:
    offset: int
    length: int
    digest: str
    flags: int = 0

    @property
    def metadata(self) -> bool:
        return bool(self.flags & METADATA)

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class ChunkMap:
    blob: str
    size: int
    chunks: tuple[ChunkRef, ...]
    _starts: list[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_starts", [c.offset for c in self.chunks])

    @classmethod
    def build(cls, refs: Iterable[ChunkRef]) -> ChunkMap:
        """The map of the blob that `refs` cover, under the id they give it (`blob_id`)."""
        refs = tuple(refs)
        size = refs[-1].end if refs else 0
        cm = cls(blob=blob_id(size, refs), size=size, chunks=refs)
        cm.check_structure()
        return cm

    def check_structure(self) -> None:
        """The chunks cover the blob contiguously, with sane lengths and known flags."""
        if len(self.chunks) > max_entries(self.size):
            raise CorruptObject(f"chunk map of {self.blob}: {len(self.chunks)} entries for a blob of {self.size} "
                                f"bytes, more than {max_entries(self.size)}")
        pos = 0
        for i, c in enumerate(self.chunks):
            if c.offset != pos:
                raise CorruptObject(f"chunk map of {self.blob}: entry {i} starts at {c.offset}, want {pos}")
            if not 0 < c.length <= MAX_CHUNK_LEN:
                raise CorruptObject(f"chunk map of {self.blob}: entry {i} has length {c.length}")
            if c.flags & ~KNOWN_FLAGS:
                raise CorruptObject(f"chunk map of {self.blob}: entry {i} has unknown flags")
            pos = c.end
        if pos != self.size:
            raise CorruptObject(f"chunk map of {self.blob}: chunks cover {pos} of {self.size} bytes")

    def check(self) -> None:
        """The structure, and that the chunk list is the one `blob` names."""
        self.check_structure()
        actual = blob_id(self.size, self.chunks)
        if actual != self.blob:
            raise CorruptObject(f"chunk map does not belong to blob {self.blob} (its chunk list is {actual})")

    def encode(self) -> bytes:
        return _HEAD.pack(MAGIC, VERSION, bytes(3), len(self.chunks), self.size) + _entries(self.chunks)

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview, blob: str) -> ChunkMap:
        """The map of `blob`; `CorruptObject` unless `data` is a well-formed map whose chunk list
        hashes to `blob` (so a forged or swapped map never decodes)."""
        where = f"chunk map of {blob}"
        count, size = check_head(data, blob)
        if len(data) != _HEAD.size + count * _ENTRY.size:
            raise CorruptObject(f"{where}: {count} entries do not fit {len(data)} bytes")
        h = blake3.blake3(ID_DOMAIN)
        h.update(_ID_HEAD.pack(size, count))
        h.update(memoryview(data)[_HEAD.size:])
        actual = digestmod.PREFIX + h.hexdigest()
        if actual != blob:
            raise CorruptObject(f"chunk map does not belong to blob {blob} (its chunk list is {actual})")
        refs = tuple(ChunkRef(off, length, digestmod.from_raw(raw), flags)
                     for off, length, flags, raw in _ENTRY.iter_unpack(memoryview(data)[_HEAD.size:]))
        cm = cls(blob=blob, size=size, chunks=refs)
        cm.check_structure()
        return cm

    @staticmethod
    def decode_format_1(data: bytes | bytearray | memoryview, blob: str) -> tuple[ChunkRef, ...]:
        """The chunk list of a format-1 map (header with the blob's whole-file digest, entries,
        trailing blake3 of the rest). It proves nothing about the blob: only a migration that
        then checks the whole blob's bytes against `blob` may use it."""
        where = f"format-1 chunk map of {blob}"
        if len(data) < _HEAD_1.size + 32:
            raise CorruptObject(f"{where}: truncated ({len(data)} bytes)")
        body = memoryview(data)[:-32]
        if blake3.blake3(body).digest() != bytes(data[-32:]):
            raise CorruptObject(f"{where}: checksum mismatch")
        magic, version, count, size, raw_blob = _HEAD_1.unpack_from(body, 0)
        if magic != MAGIC or version != VERSION_WHOLE_FILE or digestmod.from_raw(raw_blob) != blob:
            raise CorruptObject(f"{where}: not a format-1 map of this blob")
        if count > MAX_ENTRIES or len(body) != _HEAD_1.size + count * _ENTRY.size:
            raise CorruptObject(f"{where}: {count} entries do not fit {len(body)} bytes")
        refs = tuple(ChunkRef(off, length, digestmod.from_raw(raw), flags)
                     for off, length, flags, raw in _ENTRY.iter_unpack(body[_HEAD_1.size:]))
        ChunkMap(blob=blob, size=size, chunks=refs).check_structure()
        return refs

    # -- lookups (the FUSE read path uses these) ------------------------------------------
    def index_at(self, offset: int) -> int:
        """Index of the chunk that holds byte `offset` (which must be < size)."""
        return bisect.bisect_right(self._starts, offset) - 1

    def span(self, offset: int, length: int) -> range:
        """Indexes of the chunks that hold bytes [offset, offset+length), clipped to the blob."""
        end = min(offset + length, self.size)
        if offset >= end:
            return range(0)
        return range(self.index_at(offset), self.index_at(end - 1) + 1)

    def metadata_chunks(self) -> Sequence[ChunkRef]:
        return [c for c in self.chunks if c.metadata]

    def unique_digests(self) -> set[str]:
        return {c.digest for c in self.chunks}
