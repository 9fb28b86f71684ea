"""Cache commands when no daemon runs: the same `NodeCache` code, opened under the cache lock
(so a daemon cannot start meanwhile: `CacheBusy` if one holds it), driven by a short trio run."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import trio

from layerstore import digest as digestmod
from layerstore.errors import NotFound

from .cache import NodeCache, check_holder
from .cachedir import is_cache_dir, open_cache
from .errors import BlobIncomplete

T = TypeVar("T")


def _offline(cache_dir: Path, fn: Callable[[NodeCache], Awaitable[T]]) -> T:
    if not is_cache_dir(cache_dir):
        raise NotFound(f"{cache_dir} is not a node cache (no daemon has used it)")
    with contextlib.ExitStack() as stack:
        cache = open_cache(Path(cache_dir), None, stack)
        return trio.run(fn, cache)


def ls(cache_dir: Path) -> dict[str, Any]:
    async def go(cache: NodeCache) -> dict[str, Any]:
        return cache.ls()

    return _offline(cache_dir, go)


def verify(cache_dir: Path) -> dict[str, Any]:
    async def go(cache: NodeCache) -> dict[str, Any]:
        return await cache.verifier.verify()

    return _offline(cache_dir, go)


def evict_offline(cache_dir: Path, *, blob: str | None = None, all_chunks: bool = False,
                  to_bytes: int | None = None) -> dict[str, Any]:
    """`Evictor.evict` without a daemon."""

    async def go(cache: NodeCache) -> dict[str, Any]:
        return await cache.evictor.evict(blob=blob, all_chunks=all_chunks, to_bytes=to_bytes)

    return _offline(cache_dir, go)


def pin_offline(cache_dir: Path, blob: str, holder: str) -> Path | None:
    """A durable pin without a daemon: the path of the complete blob's data file, or None (and
    no pin) if the blob is not complete in the cache."""
    blob, holder = digestmod.parse(blob), check_holder(holder)

    async def go(cache: NodeCache) -> Path | None:
        try:
            return await cache.pins.pin_blob(blob, holder)
        except BlobIncomplete:
            return None

    if not is_cache_dir(cache_dir):
        return None
    return _offline(cache_dir, go)


def unpin_offline(cache_dir: Path, blob: str, holder: str) -> bool:
    """Drop a pin without a daemon (e.g. after it died): False if there was no such pin."""
    blob, holder = digestmod.parse(blob), check_holder(holder)

    async def go(cache: NodeCache) -> bool:
        return await cache.pins.unpin_blob(blob, holder)

    if not is_cache_dir(cache_dir):
        return False
    return _offline(cache_dir, go)


def gc_offline(cache_dir: Path, *, older_than: float, dry_run: bool = False) -> dict[str, Any]:
    """`Forgetting.gc_unused` without a daemon (no open handles then; pins are durable and kept)."""

    async def go(cache: NodeCache) -> dict[str, Any]:
        return await cache.forgetting.gc_unused(older_than, dry_run=dry_run)

    return _offline(cache_dir, go)
