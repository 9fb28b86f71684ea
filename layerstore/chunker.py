"""Generic chunkers for blobs that carry no structure of their own (pure).

The EROFS builder chooses file-aware boundaries itself; anything else is cut at fixed offsets.
"""

from __future__ import annotations

from collections.abc import Iterator

DEFAULT_CHUNK_SIZE = 1 << 20


def fixed_boundaries(size: int, chunk_size: int = DEFAULT_CHUNK_SIZE) -> Iterator[tuple[int, int]]:
    """(offset, length) pairs covering [0, size) in pieces of `chunk_size`."""
    if chunk_size <= 0:
        raise ValueError("chunk size must be positive")
    for off in range(0, size, chunk_size):
        yield off, min(chunk_size, size - off)
