"""The node cache, a library with no transport: everything that owns cached chunks.

It knows nothing of FUSE, fanotify or HTTP; the FUSE file system (`fuse_client.fuse`), the fanotify
front end (`fuse_client.fanotify`) and the control socket (`fuse_client.control`) sit beside each
other on this API:

- open: `open_cache(dir, budget, stack)` locks the directory (`CacheBusy`), opens the index and
  recovers (`recovery.recover`); `NodeCache.run` starts its background tasks (journal, touches,
  page release, watermark eviction), `shutdown_flush` commits the last batch.
- online: `LazyCache(cache, store, nursery=...)` fills it from the store: `entry(blob)`,
  `blobs()`, `open_reader(entry)` -> `Reader` (`read_cached(off, size)`: the inline hot path,
  data or None; `read_missing(off, size)`: fetch, then serve; `close()`), `ensure`,
  `ensure_metadata`, `prefetch`, `pin_blob`.
- maintenance (`NodeCache`, also offline through `maintenance`): `ls`, `gauges`, `pin` / `unpin`
  (a reader's chunks), and its parts: `pins` (`pin_blob` / `unpin_blob` / `holders`: durable pins;
  `protect` / `unprotect`), `verifier` (`verify`), `evictor` (`evict`), `forgetting`
  (`gc_unused`); `BlobEntry`: `size`, `cmap`, `metadata_missing`, `metadata_near`, `read_sync`, `touch`.
- errors (`errors`): `BlobIncomplete`, `BlobPinned`, `CacheIOError`, `CacheBusy`, `NoPlainImage`.
- formats (`frames`, fixed per cache directory by `cachedir`): `plain`, or `zstd` (chunks kept as
  the store's verified frames, decompressed and re-hashed on a read; no direct mounts, no fanotify).
- in use (`inuse`): `NodeLease`, the lease that reports the node's blobs to the store's
  collector (`LazyCache(guard=NodeLease.guard)`, `rotate`, `release`; docs/gc.md, the node side).

The names below load their module on first use, so that importing `errors` (what the blocking
control client needs) does not import trio.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .cache import NodeCache, check_holder
    from .cachedir import INDEX_DIR, LOCK_NAME, is_cache_dir, lock_cache_dir, open_cache
    from .entry import BlobEntry
    from .errors import BlobIncomplete, BlobPinned, CacheBusy, CacheIOError, NoPlainImage
    from .eviction import DEFAULT_HIGH, DEFAULT_LOW, Budget
    from .fetcher import DEFAULT_CONCURRENCY, DEFAULT_DEADLINE, Fetcher
    from .lazy import LazyCache, prefetch_order
    from .reader import DEFAULT_READAHEAD, Reader
    from .source import ChunkSource, SingleChunkSource
    from .stats import Stats
    from .trace import TraceRecorder, parse_trace, write_trace

_WHERE = {
    "NodeCache": "cache", "check_holder": "cache",
    "INDEX_DIR": "cachedir", "LOCK_NAME": "cachedir", "is_cache_dir": "cachedir", "lock_cache_dir": "cachedir",
    "open_cache": "cachedir",
    "BlobEntry": "entry",
    "BlobIncomplete": "errors", "BlobPinned": "errors", "CacheBusy": "errors", "CacheIOError": "errors",
    "NoPlainImage": "errors",
    "DEFAULT_HIGH": "eviction", "DEFAULT_LOW": "eviction", "Budget": "eviction",
    "DEFAULT_CONCURRENCY": "fetcher", "DEFAULT_DEADLINE": "fetcher", "Fetcher": "fetcher",
    "ChunkSource": "source", "SingleChunkSource": "source",
    "LazyCache": "lazy", "prefetch_order": "lazy",
    "DEFAULT_READAHEAD": "reader", "Reader": "reader",
    "Stats": "stats",
    "TraceRecorder": "trace", "parse_trace": "trace", "write_trace": "trace",
}

__all__ = ["BlobEntry", "BlobIncomplete", "BlobPinned", "Budget", "CacheBusy", "CacheIOError", "ChunkSource",
           "DEFAULT_CONCURRENCY", "DEFAULT_DEADLINE", "DEFAULT_HIGH", "DEFAULT_LOW", "DEFAULT_READAHEAD", "Fetcher",
           "INDEX_DIR", "LOCK_NAME", "LazyCache", "NoPlainImage", "NodeCache", "Reader", "SingleChunkSource", "Stats",
           "TraceRecorder", "check_holder",
           "is_cache_dir", "lock_cache_dir", "open_cache", "parse_trace", "prefetch_order", "write_trace"]


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{where}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
