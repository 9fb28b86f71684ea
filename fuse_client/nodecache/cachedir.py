"""The cache directory: its layout, its lock, and opening (recovering) the cache in it.

    DIR/daemon.lock      flock held by whoever has the cache open (a daemon or an offline command)
    DIR/control.sock     the daemon's control socket (not the cache's business)
    DIR/index/           LMDB (`index`)
    DIR/data/ab/<hex>    one sparse data file per blob (`files`)
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from pathlib import Path

from .cache import NodeCache
from .errors import CacheBusy
from .eviction import Budget
from .files import BlobFiles
from .index import CacheIndex
from .recovery import recover

LOCK_NAME = "daemon.lock"
INDEX_DIR = "index"


def is_cache_dir(cache_dir: Path) -> bool:
    """Has a cache ever been opened there?"""
    return (Path(cache_dir) / INDEX_DIR).is_dir()


def lock_cache_dir(cache_dir: Path) -> int:
    """An exclusive, non-blocking flock on DIR/daemon.lock (the cache is node-local, so flock
    works). Returns the descriptor; closing it releases the lock. `CacheBusy` if another process
    holds it."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(cache_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise CacheBusy(f"cache {cache_dir} is in use by another daemon or cache command") from None
        raise
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def open_cache(cache_dir: Path, budget: Budget | None, stack: contextlib.ExitStack) -> NodeCache:
    """Lock, open and recover the node cache (blocking); everything is closed by `stack`."""
    cache_dir = Path(cache_dir)
    stack.callback(os.close, lock_cache_dir(cache_dir))
    index = CacheIndex(cache_dir / INDEX_DIR)
    stack.callback(index.close)
    cache = recover(cache_dir, BlobFiles(cache_dir), index, budget=budget)
    stack.callback(cache.close)
    return cache
