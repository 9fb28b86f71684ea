"""The fetcher's seam to the store: every call it makes of one, declared (no probing).

`layerstore.store.Store` satisfies `ChunkSource` (its `reads_in_batches` and `load_many` are its
backend's: the HTTP service reads several objects a request, the others one). A source that
answers one chunk a call (a test's fake, a wrapper) subclasses `SingleChunkSource` and writes
only `get_chunk_map` and `get_chunk`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol, runtime_checkable

from layerstore.chunkmap import ChunkMap
from layerstore.errors import LayerstoreError


@runtime_checkable
class ChunkSource(Protocol):
    """What the fetcher needs of a store."""

    def get_chunk_map(self, blob: str) -> ChunkMap: ...

    def get_chunk(self, chunk: str, max_length: int = ...) -> bytes:
        """The verified payload; refused if its object says it is longer than `max_length`."""
        ...

    def get_chunk_frame(self, chunk: str, max_length: int = ...) -> tuple[bytes, bytes | memoryview | None]:
        """The verified payload and the zstd frame it was decompressed from (None: stored raw)."""
        ...

    @property
    def reads_in_batches(self) -> bool:
        """Does `load_many` read several objects a request (else the fetcher never batches)?"""
        ...

    def chunk_key(self, chunk: str) -> str:
        """The key `load_many` answers a chunk's object under."""
        ...

    def load_many(self, keys: Sequence[str], *, max_size: int | None = None
                  ) -> Iterator[tuple[str, bytes | LayerstoreError]]:
        """Each chunk object of `keys` (raw, not yet verified), in order, or its error."""
        ...


class SingleChunkSource:
    """A `ChunkSource` that answers one chunk a call: subclasses write `get_chunk_map` and
    `get_chunk`; it keeps no frames (a zstd cache stores what it gets raw) and never batches."""

    reads_in_batches = False

    def get_chunk_map(self, blob: str) -> ChunkMap:
        raise NotImplementedError

    def get_chunk(self, chunk: str, max_length: int = 1 << 26) -> bytes:
        raise NotImplementedError

    def get_chunk_frame(self, chunk: str, max_length: int = 1 << 26) -> tuple[bytes, bytes | memoryview | None]:
        return self.get_chunk(chunk, max_length), None

    def chunk_key(self, chunk: str) -> str:
        return chunk

    def load_many(self, keys: Sequence[str], *, max_size: int | None = None
                  ) -> Iterator[tuple[str, bytes | LayerstoreError]]:
        raise NotImplementedError(f"{type(self).__name__} reads one chunk a call (reads_in_batches is False)")
