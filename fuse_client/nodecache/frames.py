"""How a cache directory stores chunk bytes: its format, fixed when the directory is created.

- `plain`: every chunk's plain bytes at its offset in the blob's sparse data file. The data
  file *is* the blob: the kernel can mount a complete one directly (pins) and the fanotify data
  path reads it with no daemon in between.
- `zstd`: every chunk as fetched: the verified zstd frame of the store's chunk object (or the
  plain bytes, when the store keeps the chunk raw or its frame is not smaller than the chunk),
  written at the chunk's offset in the blob's sparse data file. The disk holds the compressed
  bytes; extents, hole punching and eviction still work per chunk (a chunk's range covers its
  frame). The index records each chunk's stored length: equal to the chunk's length means raw.
  A read decompresses (on a miss of the small in-memory `ChunkLRU`) and re-hashes what it
  decompressed before serving it.

Pure helpers and the LRU; the only I/O is the pread of `read_stored` (any thread).
"""

from __future__ import annotations

import errno
import os
import threading
from collections import OrderedDict

import blake3
import zstandard

from layerstore import chunkobj
from layerstore import digest as digestmod
from layerstore.chunkmap import ChunkRef

PLAIN = "plain"
ZSTD = "zstd"
FORMATS = (PLAIN, ZSTD)
DEFAULT_LRU_BYTES = 32 << 20  # decompressed chunks kept in memory (a few dozen 1 MiB chunks)


class StoredChunkCorrupt(OSError):
    """A chunk's stored bytes in a zstd cache do not decompress to its digest (the disk or someone
    changed them). An OSError (EIO) so that every reader of the data files treats it like a read
    error of the file: never served."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.EIO, message)


def to_store(payload: bytes | memoryview, frame: bytes | memoryview | None) -> bytes | memoryview:
    """What a zstd cache writes for a chunk: its frame if there is one and it is smaller than the
    chunk (a frame as large as the chunk or larger would cost more disk than the plain bytes; its
    stored length would also read as "raw"), else the plain bytes."""
    if frame is not None and len(frame) < len(payload):
        return frame
    return payload


def frame_of(obj: bytes | memoryview) -> memoryview | None:
    """The zstd frame of a chunk object (`layerstore.chunkobj`) the caller has just decoded, or
    None if the store keeps that chunk raw."""
    if chunkobj.HEADER.unpack_from(obj)[2] != chunkobj.COMP_ZSTD:
        return None
    return memoryview(obj)[chunkobj.HEADER_SIZE:]


# The C backend (measured here: 1.3 ms per MiB of Python sources against 1.6 for the cffi
# backend, and no less parallel in two threads).
_local = threading.local()


def _decompressor() -> zstandard.ZstdDecompressor:
    """One per thread: a decompression context is not thread-safe."""
    d: zstandard.ZstdDecompressor | None = getattr(_local, "dctx", None)
    if d is None:
        d = _local.dctx = zstandard.ZstdDecompressor()
    return d


def decode(stored: bytes, ref: ChunkRef, blob: str, index: int) -> bytes:
    """The chunk's plain bytes from what a zstd cache stored for it, checked against its digest
    (`StoredChunkCorrupt` otherwise). Raw when the stored length is the chunk's."""
    if len(stored) == ref.length:
        data = stored
    else:
        try:
            # The frame declares its size and the decompressor allocates that much: a frame that
            # declares another size than the chunk's is refused before it is decompressed.
            declared = zstandard.frame_content_size(stored)
            if declared != ref.length:
                raise StoredChunkCorrupt(f"blob {blob} chunk {index}: the cached frame declares {declared} bytes, "
                                         f"the chunk has {ref.length}")
            data = _decompressor().decompress(stored, max_output_size=ref.length)
        except zstandard.ZstdError as e:
            raise StoredChunkCorrupt(f"blob {blob} chunk {index}: the cached frame does not decompress: {e}") from None
        if len(data) != ref.length:
            raise StoredChunkCorrupt(f"blob {blob} chunk {index}: the cached frame decompresses to {len(data)} "
                                     f"bytes, the chunk has {ref.length}")
    if digestmod.PREFIX + blake3.blake3(data).hexdigest() != ref.digest:
        raise StoredChunkCorrupt(f"blob {blob} chunk {index}: the cached bytes do not match the digest")
    return data


def read_stored(fd: int, ref: ChunkRef, stored_len: int, blob: str, index: int) -> bytes:
    """Any thread: the chunk's plain bytes, read from a zstd cache's data file and checked."""
    if not 0 < stored_len <= ref.length:
        raise StoredChunkCorrupt(f"blob {blob} chunk {index}: no stored length recorded")
    raw = os.pread(fd, stored_len, ref.offset)
    if len(raw) != stored_len:
        raise StoredChunkCorrupt(f"blob {blob} chunk {index}: the cached frame is cut short")
    return decode(raw, ref, blob, index)


class ChunkLRU:
    """Decompressed chunks of a zstd cache, least recently used dropped first, at most `limit`
    bytes (0: none kept). A sequential reader asks for a 1 MiB chunk in 128 KiB (or smaller)
    requests: without this each request would decompress and re-hash the whole chunk. Keys are
    (blob, chunk index) and a chunk's bytes never change (content addressed), so an entry never
    goes stale: an evicted chunk is not served from here because readers test presence first.
    Trio thread only."""

    __slots__ = ("limit", "size", "_items", "hits", "misses")

    def __init__(self, limit: int = DEFAULT_LRU_BYTES) -> None:
        self.limit = max(0, int(limit))
        self.size = 0
        self._items: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key: tuple[str, int]) -> bytes | None:
        data = self._items.get(key)
        if data is None:
            self.misses += 1
            return None
        self._items.move_to_end(key)
        self.hits += 1
        return data

    def put(self, key: tuple[str, int], data: bytes) -> None:
        if len(data) > self.limit:
            return
        old = self._items.pop(key, None)
        if old is not None:
            self.size -= len(old)
        self._items[key] = data
        self.size += len(data)
        while self.size > self.limit:
            _, dropped = self._items.popitem(last=False)
            self.size -= len(dropped)

    def discard(self, key: tuple[str, int]) -> None:
        old = self._items.pop(key, None)
        if old is not None:
            self.size -= len(old)

    def __len__(self) -> int:
        return len(self._items)
