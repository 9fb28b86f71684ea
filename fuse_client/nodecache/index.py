"""The node cache's persistent index (LMDB): which chunks of which blob are committed, when
each was last used, and the chunk map of every blob the node has seen.

    db "maps"    blob (32 raw bytes)            -> encoded chunk map (self-checking, see chunkmap)
    db "chunks"  blob (32 raw) + index (u32 BE) -> last use (f64, seconds since the epoch)
                                                [+ stored length (u32), in a zstd cache: `frames`]
    db "pins"    blob (32 raw) + holder (utf-8)  -> pinned since (f64, seconds since the epoch)
    db "meta"    b"format"                      -> b"1"

A pin says that a holder (e.g. the runtime shim, for one direct EROFS mount) uses the blob's data
file as an image: the daemon then never modifies that file (see `Pins.pin_blob`).

A record in "chunks" is the commit point of a chunk: it is written only after the chunk's bytes
are in the data file and synced, and it is deleted before those bytes are punched out. All writes
go through `apply`, one LMDB write transaction per batch, applied in order, so the daemon's
journal (in `cache`) is the only writer. LMDB commits atomically, so a crash leaves each batch
either wholly applied or not at all.

Every method blocks; the daemon calls them from worker threads.
"""

from __future__ import annotations

import errno
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import lmdb

from layerstore import digest as digestmod
from layerstore.errors import CorruptObject
from layerstore.fileio import LMDB_FILES, narrow_files, private_dir

FORMAT = b"1"
_IDX = struct.Struct(">I")
_USE = struct.Struct("<d")
_STORED = struct.Struct("<I")
DEFAULT_MAP_SIZE = 8 << 30  # address space only; the file grows as records are added


@dataclass(frozen=True, slots=True)
class PutChunk:
    """`stored`: the bytes a zstd cache wrote for the chunk (0 in a plain cache: not recorded)."""

    blob: str
    index: int
    last_use: float
    stored: int = 0


@dataclass(frozen=True, slots=True)
class DelChunk:
    blob: str
    index: int


@dataclass(frozen=True, slots=True)
class Touch:
    """Update the last use of a chunk, only if it is still committed."""

    blob: str
    index: int
    last_use: float


@dataclass(frozen=True, slots=True)
class PutMap:
    blob: str
    data: bytes


@dataclass(frozen=True, slots=True)
class PutPin:
    blob: str
    holder: str
    since: float


@dataclass(frozen=True, slots=True)
class DelPin:
    blob: str
    holder: str


@dataclass(frozen=True, slots=True)
class DelBlob:
    """Forget a blob entirely: its chunk records and its map."""

    blob: str


Op = PutChunk | DelChunk | Touch | PutMap | DelBlob | PutPin | DelPin


def is_disk_full(e: BaseException) -> bool:
    """Did an index write fail because the disk is full?"""
    return isinstance(e, lmdb.DiskError | lmdb.MapFullError) or (isinstance(e, OSError) and e.errno == errno.ENOSPC)


def chunk_key(blob: str, index: int) -> bytes:
    return digestmod.raw_of(blob) + _IDX.pack(index)


def pin_key(blob: str, holder: str) -> bytes:
    return digestmod.raw_of(blob) + holder.encode()


class CacheIndex:
    def __init__(self, path: Path, *, map_size: int = DEFAULT_MAP_SIZE, readonly: bool = False) -> None:
        path = Path(path)
        if not readonly:
            private_dir(path, parents=True)  # (0700 also if it existed wider)
            narrow_files(path, LMDB_FILES)  # (made 0644 by an older version)
        self.env = lmdb.open(str(path), subdir=True, max_dbs=8, map_size=map_size, readonly=readonly,
                             sync=True, metasync=True, lock=True, create=not readonly, mode=0o600)
        self._maps = self.env.open_db(b"maps", create=not readonly)
        self._chunks = self.env.open_db(b"chunks", create=not readonly)
        self._meta = self.env.open_db(b"meta", create=not readonly)
        self._pins = self.env.open_db(b"pins", create=not readonly)
        if not readonly:
            with self.env.begin(write=True) as txn:
                fmt = txn.get(b"format", db=self._meta)
                if fmt is None:
                    txn.put(b"format", FORMAT, db=self._meta)
                elif fmt != FORMAT:
                    raise CorruptObject(f"cache index {path}: unknown format {fmt!r}")

    def close(self) -> None:
        self.env.close()

    # -- reads ---------------------------------------------------------------------------
    def maps(self) -> Iterator[tuple[str, bytes]]:
        with self.env.begin() as txn:
            for raw, data in txn.cursor(db=self._maps):
                yield digestmod.from_raw(bytes(raw)), bytes(data)

    def get_map(self, blob: str) -> bytes | None:
        with self.env.begin() as txn:
            data = txn.get(digestmod.raw_of(blob), db=self._maps)
            return bytes(data) if data is not None else None

    def committed(self) -> dict[str, dict[int, float]]:
        """Every committed chunk: blob -> {index: last use}."""
        out: dict[str, dict[int, float]] = {}
        with self.env.begin() as txn:
            for key, val in txn.cursor(db=self._chunks):
                key = bytes(key)
                blob = digestmod.from_raw(key[:32])
                out.setdefault(blob, {})[_IDX.unpack(key[32:])[0]] = _USE.unpack_from(bytes(val))[0]
        return out

    def pins(self) -> dict[str, dict[str, float]]:
        """Every pin: blob -> {holder: pinned since}."""
        out: dict[str, dict[str, float]] = {}
        with self.env.begin() as txn:
            for key, val in txn.cursor(db=self._pins):
                key = bytes(key)
                out.setdefault(digestmod.from_raw(key[:32]), {})[key[32:].decode()] = _USE.unpack_from(bytes(val))[0]
        return out

    def stored_lengths(self) -> dict[str, dict[int, int]]:
        """The stored length of every committed chunk that has one (a zstd cache): blob -> {index: length}."""
        out: dict[str, dict[int, int]] = {}
        with self.env.begin() as txn:
            for key, val in txn.cursor(db=self._chunks):
                if len(val) == _USE.size + _STORED.size:
                    key = bytes(key)
                    out.setdefault(digestmod.from_raw(key[:32]), {})[_IDX.unpack(key[32:])[0]] = \
                        _STORED.unpack(bytes(val)[_USE.size:])[0]
        return out

    def committed_of(self, blob: str) -> dict[int, float]:
        raw = digestmod.raw_of(blob)
        out: dict[int, float] = {}
        with self.env.begin() as txn:
            cur = txn.cursor(db=self._chunks)
            if cur.set_range(raw):
                for key, val in cur:
                    key = bytes(key)
                    if key[:32] != raw:
                        break
                    out[_IDX.unpack(key[32:])[0]] = _USE.unpack_from(bytes(val))[0]
        return out

    # -- the one writer ------------------------------------------------------------------
    def apply(self, ops: Iterable[Op]) -> None:
        with self.env.begin(write=True) as txn:
            for op in ops:
                if isinstance(op, PutChunk):
                    val = _USE.pack(op.last_use)
                    if op.stored:
                        val += _STORED.pack(op.stored)
                    txn.put(chunk_key(op.blob, op.index), val, db=self._chunks)
                elif isinstance(op, DelChunk):
                    txn.delete(chunk_key(op.blob, op.index), db=self._chunks)
                elif isinstance(op, Touch):
                    key = chunk_key(op.blob, op.index)
                    old = txn.get(key, db=self._chunks)
                    if old is not None:  # (a stored length after the time stays)
                        txn.put(key, _USE.pack(op.last_use) + bytes(old)[_USE.size:], db=self._chunks)
                elif isinstance(op, PutMap):
                    txn.put(digestmod.raw_of(op.blob), op.data, db=self._maps)
                elif isinstance(op, PutPin):
                    txn.put(pin_key(op.blob, op.holder), _USE.pack(op.since), db=self._pins)
                elif isinstance(op, DelPin):
                    txn.delete(pin_key(op.blob, op.holder), db=self._pins)
                elif isinstance(op, DelBlob):  # a blob's pins are its holders': they stay
                    raw = digestmod.raw_of(op.blob)
                    cur = txn.cursor(db=self._chunks)
                    if cur.set_range(raw):
                        while bytes(cur.key())[:32] == raw:
                            if not cur.delete():
                                break
                    txn.delete(raw, db=self._maps)
                else:  # pragma: no cover - the Op union is closed
                    raise TypeError(f"unknown cache index op {op!r}")
