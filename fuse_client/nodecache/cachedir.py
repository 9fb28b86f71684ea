"""The cache directory: its layout, its lock, and opening (recovering) the cache in it.

    DIR/daemon.lock      flock held by whoever has the cache open (a daemon or an offline command)
    DIR/control.sock     the daemon's control socket (not the cache's business)
    DIR/format           "plain" or "zstd" (`frames`): how chunks are stored, fixed when the cache
                         is created (a cache made before this file existed is plain)
    DIR/index/           LMDB (`index`)
    DIR/data/ab/<hex>    one sparse data file per blob (`files`)
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
from pathlib import Path

from layerstore.budget import size_from_env
from layerstore.chunkmap import DECODED_ENTRY
from layerstore.errors import ConfigError, CorruptObject
from layerstore.fileio import fsync_dir, private_dir

from .cache import NodeCache
from .errors import CacheBusy
from .eviction import Budget
from .files import BlobFiles
from .frames import DEFAULT_LRU_BYTES, FORMATS, PLAIN
from .index import CacheIndex
from .recovery import recover

log = logging.getLogger("layerstore.fuse.cache")

LOCK_NAME = "daemon.lock"
INDEX_DIR = "index"
FORMAT_FILE = "format"
FORMAT_ENV = "LAYERSTORE_CACHE_FORMAT"  # the format of a cache created without an explicit one
LRU_ENV = "LAYERSTORE_CACHE_LRU_BYTES"  # decompressed chunks kept in memory (zstd caches)
MAP_BUDGET_ENV = "LAYERSTORE_MAP_BUDGET"  # memory for chunk maps held by the node (issue 27)
DEFAULT_MAP_BUDGET = 256 << 20


def is_cache_dir(cache_dir: Path) -> bool:
    """Has a cache ever been opened there?"""
    return (Path(cache_dir) / INDEX_DIR).is_dir()


def lock_cache_dir(cache_dir: Path) -> int:
    """An exclusive, non-blocking flock on DIR/daemon.lock (the cache is node-local, so flock
    works). Returns the descriptor; closing it releases the lock. `CacheBusy` if another process
    holds it."""
    cache_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # (narrowed by the daemon: `Daemon`)
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


def check_format(name: str) -> str:
    fmt = name.strip().lower()
    if fmt not in FORMATS:
        raise ConfigError(f"cache format {name!r}: expected {' or '.join(FORMATS)}")
    return fmt


def recorded_format(cache_dir: Path) -> str | None:
    """The format recorded in a cache directory; plain for a cache made before formats were
    recorded; None where no cache was created yet."""
    cache_dir = Path(cache_dir)
    try:
        text = (cache_dir / FORMAT_FILE).read_text()
    except FileNotFoundError:
        return PLAIN if is_cache_dir(cache_dir) else None
    except OSError as e:
        raise ConfigError(f"cache {cache_dir}: cannot read its format file: {e}") from None
    if text.strip() not in FORMATS:
        raise CorruptObject(f"cache {cache_dir}: unknown format {text.strip()!r} in {FORMAT_FILE}")
    return text.strip()


def cache_format(cache_dir: Path, wanted: str | None = None) -> str:
    """The format the cache in `cache_dir` has, or will have when created: the recorded one
    (fixed for the directory's life), else `wanted`, else $LAYERSTORE_CACHE_FORMAT, else plain."""
    want = check_format(wanted or os.environ.get(FORMAT_ENV) or PLAIN)
    have = recorded_format(cache_dir)
    return want if have is None else have


def _record_format(cache_dir: Path, fmt: str) -> None:
    tmp = cache_dir / f".{FORMAT_FILE}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, f"{fmt}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, cache_dir / FORMAT_FILE)
    fsync_dir(cache_dir)


def open_cache(cache_dir: Path, budget: Budget | None, stack: contextlib.ExitStack, *,
               cache_format: str | None = None, lru_bytes: int | None = None,
               map_budget: int | None = None) -> NodeCache:
    """Lock, open and recover the node cache (blocking); everything is closed by `stack`.
    `cache_format` is the format of a cache created now (`frames`; default $LAYERSTORE_CACHE_FORMAT,
    else plain); an existing cache keeps the one it was created with (a different one asked for
    is logged and ignored). `lru_bytes`: decompressed chunks kept in memory by a zstd cache
    (default $LAYERSTORE_CACHE_LRU_BYTES, else `frames.DEFAULT_LRU_BYTES`)."""
    cache_dir = Path(cache_dir)
    want = check_format(cache_format or os.environ.get(FORMAT_ENV) or PLAIN)
    stack.callback(os.close, lock_cache_dir(cache_dir))
    fmt = recorded_format(cache_dir)
    if fmt is None or not (cache_dir / FORMAT_FILE).exists():
        # Recorded before the index exists: a directory with an index always has its format.
        fmt = fmt or want
        _record_format(cache_dir, fmt)
    if cache_format is not None and fmt != want:
        log.warning("cache %s keeps its format %s (fixed when it was created): %s not used", cache_dir, fmt, want)
    if lru_bytes is None:
        try:
            lru_bytes = int(os.environ.get(LRU_ENV) or DEFAULT_LRU_BYTES)
        except ValueError:
            raise ConfigError(f"{LRU_ENV}={os.environ.get(LRU_ENV)!r}: expected a number of bytes") from None
    if map_budget is None:
        map_budget = map_budget_from_env()
    index = CacheIndex(cache_dir / INDEX_DIR)
    stack.callback(index.close)
    files = BlobFiles(cache_dir)
    private_dir(files.root)  # the blobs' bytes: 0700 also if it existed wider (its files are 0600)
    cache = recover(cache_dir, files, index, budget=budget, cache_format=fmt, lru_bytes=lru_bytes,
                    map_budget=map_budget)
    stack.callback(cache.close)
    return cache


def map_budget_from_env() -> int:
    """Chunk-map entries a node keeps in memory: $LAYERSTORE_MAP_BUDGET bytes (K/M/G suffixes;
    0: no limit) over `chunkmap.DECODED_ENTRY`, else 256 MiB's worth (~840,000 entries)."""
    return size_from_env(MAP_BUDGET_ENV, DEFAULT_MAP_BUDGET, zero_ok=True) // DECODED_ENTRY
