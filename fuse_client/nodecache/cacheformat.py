"""How a node cache stores its chunks: one `CacheFormat` object, chosen once when the cache is
opened (its directory's recorded format, `cachedir`), instead of branches on the format's name.

- `PlainFormat`: each chunk's verified payload at its offset in the blob's data file; the file
  is the blob's image (a direct mount can use it, pages can be mapped); a chunk occupies its
  length.
- `ZstdFormat`: each chunk as the store's verified zstd frame (or the plain bytes where the frame
  is not smaller: `frames.to_store`), at the chunk's offset; `BlobEntry.stored` keeps each
  chunk's stored length (recorded in the index), a read decompresses and re-hashes it through the
  cache's LRU of plain chunks (`frames`); no plain image, no mapping.

The read path's own test (`Reader.read_cached`) stays the entry's `stored is not None`: one
attribute, no call on the hit path.
"""

from __future__ import annotations

from layerstore.chunkmap import ChunkMap

from . import frames
from .entry import BlobEntry
from .source import ChunkSource


class CacheFormat:
    name = ""
    compressed = False  # chunks kept as their store frames
    direct_image = True  # the data file is the blob's plain image (mountable directly, mappable)

    def new_entry(self, cmap: ChunkMap, fd: int) -> BlobEntry:
        return BlobEntry(cmap, fd, compressed=self.compressed)

    def new_lru(self, lru_bytes: int) -> frames.ChunkLRU | None:
        """The cache of decompressed chunks (trio thread only), if this format needs one."""
        return None

    def fetch(self, source: ChunkSource, digest: str, length: int) -> tuple[bytes, bytes | memoryview | None]:
        """Worker thread: the verified payload of a chunk of `length` bytes and what to store with
        it (`FetchWriter.write`)."""
        raise NotImplementedError

    def frame_of(self, obj: bytes | memoryview) -> bytes | memoryview | None:
        """The frame to store of a chunk object read raw (a batched read), once it is verified."""
        raise NotImplementedError

    @staticmethod
    def stored_length(entry: BlobEntry, i: int) -> int:
        """What a chunk's record keeps of its stored length (0: its length, nothing to keep)."""
        stored = entry.stored
        return stored[i] if stored is not None else 0


class PlainFormat(CacheFormat):
    name = frames.PLAIN

    def fetch(self, source: ChunkSource, digest: str, length: int) -> tuple[bytes, bytes | memoryview | None]:
        return source.get_chunk(digest, length), None

    def frame_of(self, obj: bytes | memoryview) -> bytes | memoryview | None:
        return None


class ZstdFormat(CacheFormat):
    name = frames.ZSTD
    compressed = True
    direct_image = False

    def new_lru(self, lru_bytes: int) -> frames.ChunkLRU | None:
        return frames.ChunkLRU(lru_bytes)

    def fetch(self, source: ChunkSource, digest: str, length: int) -> tuple[bytes, bytes | memoryview | None]:
        return source.get_chunk_frame(digest, length)

    def frame_of(self, obj: bytes | memoryview) -> bytes | memoryview | None:
        return frames.frame_of(obj)


FORMATS: dict[str, CacheFormat] = {f.name: f for f in (PlainFormat(), ZstdFormat())}


def format_named(name: str) -> CacheFormat:
    """The format of that name (`frames.FORMATS`); `frames.check_format` has vetted it."""
    return FORMATS[name]
