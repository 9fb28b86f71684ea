"""Blob ids as the store gives them, for tests that check one: the id of a blob is its chunk
list's (`layerstore.chunkmap.blob_id`), not the blake3 of its bytes."""

from __future__ import annotations

from pathlib import Path

from layerstore import digest as digestmod
from layerstore.chunker import DEFAULT_CHUNK_SIZE, fixed_boundaries
from layerstore.chunkmap import ChunkMap, ChunkRef
from layerstore.store import Store


def fixed_chunk_map(data: bytes, chunk_size: int = DEFAULT_CHUNK_SIZE) -> ChunkMap:
    """The chunk map `Store.put_blob` makes of `data` (cut at fixed offsets)."""
    return ChunkMap.build(ChunkRef(off, n, digestmod.of(data[off:off + n]))
                          for off, n in fixed_boundaries(len(data), chunk_size))


def put_blob_id(data: bytes | Path, chunk_size: int = DEFAULT_CHUNK_SIZE) -> str:
    """The id `Store.put_blob` (`layerctl store put-blob`) gives a file with these bytes."""
    if isinstance(data, Path):
        data = data.read_bytes()
    return fixed_chunk_map(data, chunk_size).blob


def is_blob_file(store: Store, blob: str, path: Path) -> bool:
    """Is the file at `path` the blob `blob` of `store`: its chunk map decodes (so its chunk
    list is the one the id names), and the file has the map's size and every chunk's bytes?"""
    cm = store.get_chunk_map(blob)
    data = path.read_bytes()
    return len(data) == cm.size and all(digestmod.of(data[c.offset:c.end]) == c.digest for c in cm.chunks)
