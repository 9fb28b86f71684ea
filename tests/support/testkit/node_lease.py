"""Helpers for the node side of garbage collection (no tests here): a backend wrapper that
records every call in order and can refuse lease writes, a node cache rig with the node lease
wired as the daemon wires it (no kernel), and a sweep published by hand."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from fuse_client.fuse.fs import BLOBS_INODE, BlobFS
from fuse_client.nodecache import LazyCache, NodeCache, open_cache
from fuse_client.nodecache.inuse import NodeLease
from layerstore import keys, leases
from layerstore.backends import Backend, ObjectInfo
from layerstore.store import Store


class JournalBackend(Backend):
    """Wraps a backend: every call is recorded as (op, key) in order (thread-safe); writes under
    `leases/` raise `refuse_leases` when it is set (a node with read-only store access)."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.url = inner.url
        self.calls: list[tuple[str, str]] = []
        self.refuse_leases: BaseException | None = None
        self._lock = threading.Lock()

    def _note(self, op: str, key: str, write: bool = False) -> None:
        with self._lock:
            self.calls.append((op, key))
        if write and self.refuse_leases is not None and key.startswith(leases.LEASES):
            raise self.refuse_leases

    def take(self) -> list[tuple[str, str]]:
        """The calls recorded so far (and forget them)."""
        with self._lock:
            calls, self.calls = self.calls, []
        return calls

    def create(self) -> None:
        self.inner.create()

    def check(self) -> None:
        self.inner.check()

    def load(self, key: str, offset: int = 0, size: int | None = None, *, max_size: int | None = None) -> bytes:
        self._note("load", key)
        return self.inner.load(key, offset, size, max_size=max_size)

    def store_once(self, key: str, data: bytes | memoryview) -> bool:
        self._note("store_once", key, write=True)
        return self.inner.store_once(key, data)

    def replace(self, key: str, data: bytes) -> None:
        self._note("replace", key, write=True)
        self.inner.replace(key, data)

    def exists(self, key: str) -> bool:
        self._note("exists", key)
        return self.inner.exists(key)

    def size(self, key: str) -> int:
        return self.inner.size(key)

    def delete(self, key: str) -> None:
        self._note("delete", key, write=True)
        self.inner.delete(key)

    def list(self, prefix: str = "") -> Iterator[str]:
        self._note("list", prefix)
        return self.inner.list(prefix)

    def list_info(self, prefix: str = "") -> Iterator[ObjectInfo]:
        self._note("list_info", prefix)
        return self.inner.list_info(prefix)


def journal_store(path: Path) -> Store:
    """A local store at `path` whose backend is a `JournalBackend` (`store.backend`)."""
    from layerstore.backends.posix import PosixBackend

    inner = PosixBackend(path, fsync=False)
    inner.create()
    store = Store(JournalBackend(inner))
    store.init()
    return store


def node_leases(backend: Backend) -> list[leases.LeaseInfo]:
    return [info for info in leases.read_leases(backend) if info.kind == "node"]


def held_blobs(backend: Backend) -> set[str]:
    """Blob digests every node lease in the store holds."""
    out: set[str] = set()
    for info in node_leases(backend):
        out |= {keys.digest_of_key(k)[1] for k in info.keys if k.startswith("blobs/")}
    return out


@dataclass
class LeaseRig:
    fs: BlobFS
    lazy: LazyCache
    cache: NodeCache
    inuse: NodeLease

    async def lookup(self, blob: str) -> int:
        return (await self.fs.lookup(BLOBS_INODE, blob.encode())).st_ino

    async def open_blob(self, blob: str) -> int:
        return (await self.fs.open(await self.lookup(blob), 0)).fh

    async def read_all(self, fh: int, size: int, step: int = 128 * 1024) -> bytes:
        return b"".join([bytes(await self.fs.read(fh, off, step)) for off in range(0, size, step)])


@contextlib.asynccontextmanager
async def lease_rig(store: Store, cache_dir: Path, *, interval: float = 3600.0, linger: float | None = None,
                    clock: Any = time.time) -> AsyncIterator[LeaseRig]:
    """The node cache, its FUSE operations (called without a kernel) and the node lease, wired
    as `fuse_client.daemon` wires them; the lease is rotated only when a test says so (unless
    `interval` is short), and released at the end as at a clean shutdown."""
    with contextlib.ExitStack() as stack:
        cache = open_cache(cache_dir, None, stack)
        async with trio.open_nursery() as nursery:
            await nursery.start(cache.run)
            inuse = NodeLease(cache, store.backend, name=f"test:{cache_dir}", interval=interval, linger=linger,
                              clock=clock)
            cache.forgetting.in_use = inuse.last_seen
            await nursery.start(inuse.run)
            lazy = LazyCache(cache, store, nursery=nursery, deadline=5.0, guard=inuse.guard)
            try:
                yield LeaseRig(BlobFS(lazy), lazy, cache, inuse)
            finally:
                with trio.CancelScope(shield=True):
                    await cache.shutdown_flush()
                    await inuse.release()
                nursery.cancel_scope.cancel()


def publish_sweep(backend: Backend, run_id: str, candidates: Iterable[str], *, state: str = "sweeping",
                  ttl: float = 120.0) -> None:
    """A collector's run record and candidate list, written as `layergc` writes them."""
    keys = list(candidates)
    backend.store_once(leases.candidates_key(run_id), leases.encode_candidates(keys))
    set_run_state(backend, run_id, state, ttl=ttl)


def set_run_state(backend: Backend, run_id: str, state: str, *, ttl: float = 120.0) -> None:
    now = time.time()
    backend.replace(leases.run_key(run_id), json.dumps({"state": state, "started": now, "expires": now + ttl,
                                                        "holder": "test"}).encode())
