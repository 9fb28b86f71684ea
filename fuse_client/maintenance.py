"""Cache commands when no daemon runs: the same `NodeCache` code, opened under the cache lock
(so a daemon cannot start meanwhile), driven by a short trio run."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import trio

from layerstore import digest as digestmod
from layerstore.errors import NotFound

from .cache import BlobIncomplete, NodeCache, check_holder
from .control import evict, pin_blob, unpin_blob
from .daemon import INDEX_DIR, open_cache

T = TypeVar("T")


def _offline(cache_dir: Path, fn: Callable[[NodeCache], Awaitable[T]]) -> T:
    if not (Path(cache_dir) / INDEX_DIR).is_dir():
        raise NotFound(f"{cache_dir} is not a node cache (no daemon has used it)")
    with contextlib.ExitStack() as stack:
        cache = open_cache(Path(cache_dir), None, stack)
        return trio.run(fn, cache)


def ls(cache_dir: Path) -> dict[str, Any]:
    async def go(cache: NodeCache) -> dict[str, Any]:
        return cache.ls()

    return _offline(cache_dir, go)


def verify(cache_dir: Path) -> dict[str, Any]:
    return _offline(cache_dir, NodeCache.verify)


def evict_offline(cache_dir: Path, req: dict[str, Any]) -> dict[str, Any]:
    async def go(cache: NodeCache) -> dict[str, Any]:
        return await evict(cache, req)

    return _offline(cache_dir, go)


def pin_offline(cache_dir: Path, blob: str, holder: str) -> Path | None:
    """`control.pin` without a daemon: the path of the complete blob's data file, or None."""
    blob, holder = digestmod.parse(blob), check_holder(holder)

    async def go(cache: NodeCache) -> Path | None:
        try:
            return Path((await pin_blob(cache, blob, holder))["path"])
        except BlobIncomplete:
            return None

    if not (Path(cache_dir) / INDEX_DIR).is_dir():
        return None
    return _offline(cache_dir, go)


def unpin_offline(cache_dir: Path, blob: str, holder: str) -> bool:
    """`control.unpin` without a daemon (e.g. after it died): False if there was no such pin."""
    blob, holder = digestmod.parse(blob), check_holder(holder)

    async def go(cache: NodeCache) -> bool:
        return bool((await unpin_blob(cache, blob, holder))["removed"])

    if not (Path(cache_dir) / INDEX_DIR).is_dir():
        return False
    return _offline(cache_dir, go)
