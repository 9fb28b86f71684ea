"""The store the collector is timed on: a deterministic plan, written fast and for real.

Chunks are numbered; chunk `i`'s payload depends only on (seed, i), so the garbage can be written
back byte for byte after a collection (the bare delete needs the same objects again). Blobs are
runs of `per_blob` consecutive chunks; the first half of the blobs are live (tagged through
environments), the second half garbage (each also naming `shared` chunks of a live blob)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from layerstore import chunkobj, keys
from layerstore import digest as digestmod
from layerstore.backends import Backend
from layerstore.chunkmap import ChunkMap, ChunkRef
from layerstore.store import Store
from manifest import environment as envmod

MIN_PAYLOAD, MAX_PAYLOAD = 1 << 10, 16 << 10
TAG_NAME = "gcbench"


def payload(seed: int, i: int) -> bytes:
    """1-16 KiB: half random bytes, half repeated text (zstd has something to do)."""
    rng = random.Random(seed * 1_000_003 + i)
    size = rng.randrange(MIN_PAYLOAD, MAX_PAYLOAD + 1)
    half = size // 2
    text = (f"chunk {i} of layer ".encode() * (half // 16 + 1))[: size - half]
    return rng.randbytes(half) + text


@dataclass
class Plan:
    chunks: int  # chunk objects in the store, half of them garbage
    per_blob: int = 200
    shared: int = 20  # chunks of a live blob each garbage chunk map names as well
    seed: int = 13
    digests: list[str] = field(default_factory=list)  # per chunk index, filled by `write_chunks`
    lengths: list[int] = field(default_factory=list)
    garbage_maps: dict[str, bytes] = field(default_factory=dict)  # key -> encoded chunk map
    garbage_manifests: dict[str, bytes] = field(default_factory=dict)  # key -> stored object
    live_keys: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.chunks % (2 * self.per_blob):
            raise ValueError(f"{self.chunks} chunks do not make an even number of blobs of {self.per_blob}")

    @property
    def blobs(self) -> int:
        return self.chunks // self.per_blob

    @property
    def live_chunks(self) -> range:
        return range(self.chunks // 2)

    @property
    def garbage_chunks(self) -> range:
        return range(self.chunks // 2, self.chunks)

    def chunk_key(self, i: int) -> str:
        return keys.object_key("chunks", self.digests[i])

    def garbage_keys(self) -> list[str]:
        """What a collection must delete, in the collector's order: manifests, then chunk maps,
        then chunks, each sorted."""
        return (sorted(self.garbage_manifests) + sorted(self.garbage_maps)
                + sorted(self.chunk_key(i) for i in self.garbage_chunks))

    def refs(self, blob: int) -> list[ChunkRef]:
        own = range(blob * self.per_blob, (blob + 1) * self.per_blob)
        extra: Iterable[int] = ()
        if blob >= self.blobs // 2:  # garbage: also some chunks of live blob `blob - blobs/2`
            start = (blob - self.blobs // 2) * self.per_blob
            extra = range(start, start + self.shared)
        out, pos = [], 0
        for i in (*own, *extra):
            out.append(ChunkRef(pos, self.lengths[i], self.digests[i], _flags(i, blob, self.per_blob)))
            pos += self.lengths[i]
        return out


def _flags(i: int, blob: int, per_blob: int) -> int:
    """The first chunk of a layer holds its metadata (as an EROFS superblock chunk would)."""
    return 1 if i == blob * per_blob else 0


def _write_chunk(backend: Backend, seed: int, i: int) -> tuple[str, int]:
    data = payload(seed, i)
    digest = digestmod.of(data)
    backend.store_once(keys.object_key("chunks", digest), chunkobj.pack(data))
    return digest, len(data)


def write_chunks(backend: Backend, plan: Plan, indices: Iterable[int], pool: ThreadPoolExecutor) -> None:
    """Write chunk objects in parallel; records digests and lengths in `plan` the first time."""
    indices = list(indices)
    results = pool.map(lambda i: _write_chunk(backend, plan.seed, i), indices, chunksize=64)
    if not plan.digests:
        plan.digests, plan.lengths = [""] * plan.chunks, [0] * plan.chunks
    for i, (digest, length) in zip(indices, results, strict=True):
        plan.digests[i], plan.lengths[i] = digest, length


def fill(store: Store, plan: Plan, workers: int, log: Callable[[str], None]) -> dict[str, float]:
    """Write the whole store of `plan` through `store` (closed by the caller: that releases the
    lease its environment creation held). Returns seconds per step."""
    steps: dict[str, float] = {}
    t0 = time.monotonic()
    store.init()
    with ThreadPoolExecutor(workers, thread_name_prefix="fill") as pool:
        write_chunks(store.backend, plan, range(plan.chunks), pool)
        steps["chunks"] = time.monotonic() - t0
        t1 = time.monotonic()
        maps = list(pool.map(lambda b: ChunkMap.build(plan.refs(b)), range(plan.blobs)))
        keyed = [(keys.object_key("blobs", cm.blob), cm.encode()) for cm in maps]
        list(pool.map(lambda kv: store.backend.store_once(*kv), keyed))
        steps["chunk_maps"] = time.monotonic() - t1
        t2 = time.monotonic()
        half = plan.blobs // 2
        manifests = list(pool.map(lambda b: _environment(store, maps[b].blob, b, b < half), range(plan.blobs)))
        steps["environments"] = time.monotonic() - t2
    for b, (key, obj) in enumerate(manifests):
        if b < half:
            plan.live_keys.add(key)
        elif key:
            plan.garbage_manifests[key] = obj
    for b, (key, encoded) in enumerate(keyed):
        if b < half:
            plan.live_keys.add(key)
        else:
            plan.garbage_maps[key] = encoded
    plan.live_keys.update(plan.chunk_key(i) for i in plan.live_chunks)
    steps["total"] = time.monotonic() - t0
    log(f"filled {plan.chunks} chunks, {plan.blobs} chunk maps, {len(plan.live_keys) - plan.chunks // 2 - half} + "
        f"{len(plan.garbage_manifests)} manifests in {steps['total']:.1f} s")
    return {k: round(v, 3) for k, v in steps.items()}


def _environment(store: Store, blob: str, b: int, live: bool) -> tuple[str, bytes]:
    """Live blobs become tagged environments; every other garbage blob an environment whose tag
    is removed again, the rest stay bare layers. Returns (manifest key, stored object) or ("", b"")."""
    if not live and b % 2:
        return "", b""
    ref = f"{TAG_NAME}/{'live' if live else 'gone'}{b}:v1"
    manifest = envmod.build_manifest(store, base=blob)
    created = envmod.create_environment(store, manifest, ref)
    if not live:
        store.delete_tag(ref)
    key = keys.object_key("manifests", created.manifest)
    return key, store.backend.load(key)


def refill_garbage(backend: Backend, plan: Plan, workers: int) -> None:
    """Write the garbage back, byte for byte: chunks first, then chunk maps, then manifests."""
    with ThreadPoolExecutor(workers, thread_name_prefix="refill") as pool:
        write_chunks(backend, plan, plan.garbage_chunks, pool)
        list(pool.map(lambda kv: backend.store_once(*kv), plan.garbage_maps.items()))
        list(pool.map(lambda kv: backend.store_once(*kv), plan.garbage_manifests.items()))
