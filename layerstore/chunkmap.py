"""Chunk maps: which chunks, in order, with offsets and lengths, make one blob (pure).

A blob (an EROFS image, or any file) is cut into contiguous, non-overlapping chunks that cover it
exactly. Each entry carries flags; `METADATA` marks the chunks a reader should fetch first (the
superblock, inodes, directories of an EROFS image).

Binary encoding, little-endian:

    header  magic b"LSCM" | version u8 | 3 reserved bytes | count u32 | blob size u64 | blob 32B
    entry   offset u64 | length u32 | flags u32 | chunk digest 32B          (48 bytes, x count)
    trailer blake3 of everything above, 32B

The blob's id is the blake3 of the whole blob, which a chunk map cannot prove on its own, so it
carries its own checksum and every structural rule is checked on decode.
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
VERSION = 1
METADATA = 1
KNOWN_FLAGS = METADATA
_HEAD = struct.Struct("<4sB3xIQ32s")
_ENTRY = struct.Struct("<QII32s")
_TRAILER = 32
MAX_CHUNK_LEN = 64 << 20


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
    def build(cls, blob: str, refs: Iterable[ChunkRef]) -> ChunkMap:
        refs = tuple(refs)
        size = refs[-1].end if refs else 0
        cm = cls(blob=digestmod.parse(blob), size=size, chunks=refs)
        cm.check()
        return cm

    def check(self) -> None:
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

    def encode(self) -> bytes:
        out = bytearray(_HEAD.pack(MAGIC, VERSION, len(self.chunks), self.size, digestmod.raw_of(self.blob)))
        for c in self.chunks:
            out += _ENTRY.pack(c.offset, c.length, c.flags, digestmod.raw_of(c.digest))
        out += blake3.blake3(out).digest()
        return bytes(out)

    @classmethod
    def decode(cls, data: bytes, blob: str) -> ChunkMap:
        where = f"chunk map of {blob}"
        if len(data) < _HEAD.size + _TRAILER:
            raise CorruptObject(f"{where}: truncated ({len(data)} bytes)")
        body, trailer = data[:-_TRAILER], data[-_TRAILER:]
        if blake3.blake3(body).digest() != trailer:
            raise CorruptObject(f"{where}: checksum mismatch")
        magic, version, count, size, raw_blob = _HEAD.unpack_from(body, 0)
        if magic != MAGIC:
            raise CorruptObject(f"{where}: bad magic {magic!r}")
        if version != VERSION:
            raise CorruptObject(f"{where}: unknown version {version}")
        if len(body) != _HEAD.size + count * _ENTRY.size:
            raise CorruptObject(f"{where}: {count} entries do not fit {len(body)} bytes")
        if digestmod.from_raw(raw_blob) != blob:
            raise CorruptObject(f"{where}: describes {digestmod.from_raw(raw_blob)} instead")
        refs = []
        for i in range(count):
            off, length, flags, raw = _ENTRY.unpack_from(body, _HEAD.size + i * _ENTRY.size)
            refs.append(ChunkRef(off, length, digestmod.from_raw(raw), flags))
        cm = cls(blob=blob, size=size, chunks=tuple(refs))
        cm.check()
        return cm

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
