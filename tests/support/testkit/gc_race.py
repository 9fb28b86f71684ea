"""Pieces of the garbage collector's race tests: a backend that jitters every call (so threads
really interleave), a pusher whose layers share most chunks with what was just let go, and the
invariant every run must leave: everything reachable from every tag and live lease is present
and verifies."""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from layerstore import keys, leases
from layerstore.backends import Backend, ObjectInfo
from layerstore.errors import LayerstoreError, NotFound
from layerstore.store import Store
from manifest import environment as envmod
from manifest.schema import Manifest

CHUNK = 4096


class JitterBackend(Backend):
    """`inner`, with a random pause of up to `max_delay` seconds before every call."""

    def __init__(self, inner: Backend, max_delay: float = 0.002, seed: int | None = None) -> None:
        self.inner = inner
        self.url = inner.url
        self.max_delay = max_delay
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def _pause(self) -> None:
        with self._lock:
            d = self._rng.random() * self.max_delay
        time.sleep(d)

    def create(self) -> None:
        self.inner.create()

    def check(self) -> None:
        self.inner.check()

    def load(self, key: str, offset: int = 0, size: int | None = None, *, max_size: int | None = None) -> bytes:
        self._pause()
        return self.inner.load(key, offset, size, max_size=max_size)

    def store_once(self, key: str, data: bytes | memoryview) -> bool:
        self._pause()
        return self.inner.store_once(key, data)

    def replace(self, key: str, data: bytes) -> None:
        self._pause()
        self.inner.replace(key, data)

    def exists(self, key: str) -> bool:
        self._pause()
        return self.inner.exists(key)

    def size(self, key: str) -> int:
        self._pause()
        return self.inner.size(key)

    def delete(self, key: str) -> None:
        self._pause()
        self.inner.delete(key)

    def delete_many(self, keys_: Iterable[str]) -> int:
        self._pause()
        return self.inner.delete_many(keys_)

    def list(self, prefix: str = "") -> Iterator[str]:
        self._pause()
        return self.inner.list(prefix)

    def list_info(self, prefix: str = "") -> Iterator[ObjectInfo]:
        self._pause()
        return self.inner.list_info(prefix)

    def is_temp_failure(self, e: BaseException) -> bool:
        return self.inner.is_temp_failure(e)

    def close(self) -> None:
        """The inner backend is shared by several stores (an S3 client costs a second to
        build): its owner closes it."""


def blocks(n: int, seed: int) -> list[bytes]:
    """`n` distinct, incompressible 4 KiB blocks."""
    rng = random.Random(seed)
    return [rng.randbytes(CHUNK) for _ in range(n)]


def push_env(store: Store, tmp: Path, pool: list[bytes], rng: random.Random, ref: str) -> str:
    """Push a layer of 8 chunks, 7 of them from `pool` (shared with what others pushed and let
    go), one new; make it an environment tagged `ref`. Returns the manifest digest."""
    chunks = rng.sample(pool, 7) + [rng.randbytes(CHUNK)]
    path = tmp / f"layer-{threading.get_ident()}-{rng.random()}"
    path.write_bytes(b"".join(chunks))
    try:
        blob = store.put_blob(path, chunk_size=CHUNK).blob
    finally:
        path.unlink()
    manifest = envmod.build_manifest(store, base=blob)
    return envmod.create_environment(store, manifest, ref).manifest


def check_reachable(store: Store) -> list[str]:
    """Problems with what tags and live leases reach: every manifest, chunk map and chunk must be
    there and verify. Empty when all is well."""
    problems: list[str] = []
    roots: set[str] = set()
    now = time.time()
    for lease in leases.read_leases(store.backend):
        if lease.live(now):
            roots |= lease.keys
    for manifest in store.tags().values():
        roots.add(keys.object_key("manifests", manifest))
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        key = todo.pop()
        if key in seen:
            continue
        seen.add(key)
        try:
            kind, ident = keys.digest_of_key(key)
            if kind == "manifests":
                data = store.get_manifest(ident)
                with contextlib.suppress(LayerstoreError):  # a signature refers to nothing
                    todo += [keys.object_key("blobs", b) for b in Manifest.from_bytes(data).blobs]
            elif kind == "blobs":
                todo += [keys.object_key("chunks", d) for d in store.get_chunk_map(ident).unique_digests()]
            else:
                store.get_chunk(ident)
        except NotFound as e:
            problems.append(f"{key}: missing ({e})")
        except LayerstoreError as e:
            problems.append(f"{key}: {e}")
    return problems


def content_keys(store: Store) -> set[str]:
    return {k for p in ("manifests/", "blobs/", "chunks/") for k in store.backend.list(p)}


def reachable_keys(store: Store) -> set[str]:
    """Every content key reachable from tags and live leases (assumes `check_reachable` is clean)."""
    out: set[str] = set()
    now = time.time()
    todo = [keys.object_key("manifests", m) for m in store.tags().values()]
    for lease in leases.read_leases(store.backend):
        if lease.live(now):
            todo += list(lease.keys)
    while todo:
        key = todo.pop()
        if key in out:
            continue
        out.add(key)
        kind, ident = keys.digest_of_key(key)
        if kind == "manifests":
            with contextlib.suppress(LayerstoreError):
                todo += [keys.object_key("blobs", b) for b in Manifest.from_bytes(store.get_manifest(ident)).blobs]
        elif kind == "blobs":
            todo += [keys.object_key("chunks", d) for d in store.get_chunk_map(ident).unique_digests()]
    return out


def run_threads(*fns: Any) -> list[BaseException]:
    """Run each callable in its own thread; returns the exceptions they raised."""
    errors: list[BaseException] = []

    def wrap(fn: Any) -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - reported to the test
            errors.append(e)

    threads = [threading.Thread(target=wrap, args=(fn,)) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors
