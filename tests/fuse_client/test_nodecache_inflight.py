"""The cache's in-flight API (`NodeCache.begin_fetch` -> `FetchWriter`): a fetch holds its
positions until it commits (servable, recorded) or aborts (nothing served, the waiters told)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import trio

from fuse_client.nodecache import open_cache
from fuse_client.nodecache.limiter import DEMAND
from layerstore.errors import CorruptObject
from layerstore.store import Store

from .test_fuse_handlers import CHUNK, put_blob


@pytest.mark.trio
async def test_a_fetch_writer_holds_its_positions_until_commit_or_abort(store: Store, tmp_path: Path) -> None:
    piece = bytes(range(256)) * (CHUNK // 256)
    cmap = put_blob(store, piece * 2 + b"x" * CHUNK)  # chunks 0 and 1 share a digest
    with contextlib.ExitStack() as stack:
        cache = open_cache(tmp_path / "cache", None, stack)
        entry = cache.add_blob(cmap)

        w = cache.begin_fetch(entry, [0, 1], DEMAND)
        assert cache.in_flight(cmap.blob, 0) is w.flight is cache.in_flight(cmap.blob, 1)
        assert cache.in_flight(cmap.blob, 2) is None
        with pytest.raises(AssertionError):  # one fetch a position
            cache.begin_fetch(entry, [1], DEMAND)
        await trio.to_thread.run_sync(w.write, piece)
        assert not entry.present[0] and not entry.present[1]  # written is not servable
        w.commit()
        assert w.done and w.flight.error is None
        assert entry.present[0] and entry.present[1] and cache.usage == 2 * CHUNK
        assert cache.in_flight(cmap.blob, 0) is None
        assert entry.read_sync(0, 2 * CHUNK) == piece * 2

        w = cache.begin_fetch(entry, [2], DEMAND)
        await trio.to_thread.run_sync(w.write, b"y" * CHUNK)  # not what the map says: never committed
        w.abort(CorruptObject("bad"))
        w.abort()  # idempotent: the waiters keep the first answer
        assert isinstance(w.flight.error, CorruptObject)
        assert not entry.present[2] and cache.in_flight(cmap.blob, 2) is None and cache.usage == 2 * CHUNK
