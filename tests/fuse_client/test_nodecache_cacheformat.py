"""The cache-format objects (`cacheformat`): chosen once when a cache opens, they say how a chunk
is fetched and stored, where the fetcher and the cache used to branch on the format's name."""

from __future__ import annotations

import contextlib
from pathlib import Path

from fuse_client.nodecache import open_cache
from fuse_client.nodecache.cacheformat import PlainFormat, ZstdFormat, format_named
from fuse_client.nodecache.frames import PLAIN, ZSTD
from layerstore import chunkobj
from layerstore.store import Store

from .test_fuse_handlers import put_blob


def test_each_format_fetches_and_keeps_what_its_files_hold(store: Store, tmp_path: Path) -> None:
    data = b"compressible " * 8000
    cmap = put_blob(store, data, chunk=len(data))
    digest, length = cmap.chunks[0].digest, cmap.chunks[0].length
    raw = store.backend.load(store.chunk_key(digest))
    assert chunkobj.HEADER.unpack_from(raw)[2] == chunkobj.COMP_ZSTD  # the store keeps it compressed

    plain, zstd = format_named(PLAIN), format_named(ZSTD)
    assert isinstance(plain, PlainFormat) and isinstance(zstd, ZstdFormat)
    assert plain.fetch(store, digest, length) == (data, None) and plain.frame_of(raw) is None
    payload, frame = zstd.fetch(store, digest, length)
    assert payload == data and frame is not None and bytes(frame) == bytes(zstd.frame_of(raw) or b"")
    assert len(frame) < length
    assert (plain.direct_image, zstd.direct_image) == (True, False)

    for name in (PLAIN, ZSTD):
        with contextlib.ExitStack() as stack:
            cache = open_cache(tmp_path / name, None, stack, cache_format=name)
            assert cache.chunk_format is format_named(name) and cache.format == name
            entry = cache.add_blob(cmap)
            assert entry.mappable == (name == PLAIN) and (entry.stored is None) == (name == PLAIN)
            assert (cache.lru is None) == (name == PLAIN)
