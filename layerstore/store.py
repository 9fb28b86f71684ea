"""The content-addressed store: chunks, chunk maps, manifests and tags over any backend.

The store wraps a backend with the object format (header + zstd + blake3 verification, see
`chunkobj`) and the key layout (see `keys`). Every object but a tag is immutable and written at
most once, so concurrent writers of the same content never conflict.

Write order is what keeps a store consistent when a writer dies mid-way: a blob's chunks are all
stored before its chunk map, and a manifest is stored before a tag points at it. A crash leaves
at most unreferenced chunks (garbage for `gc`), never a reference to something missing.

Tags are the only mutable objects, replaced atomically (rename on POSIX, a plain PUT on S3). When
two writers move one tag at once, the last write to land wins; both writes are whole, so readers
see one manifest digest or the other, never a mix, and the loser's manifest stays in the store
(unreferenced until `gc` sweeps it). Callers that need compare-and-set must serialise themselves.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from . import chunkmap, chunkobj, keys, leases
from . import digest as digestmod
from .backends import Backend, open_backend
from .chunker import DEFAULT_CHUNK_SIZE, fixed_boundaries
from .chunkmap import ChunkMap, ChunkRef
from .config import resolve_store_url
from .errors import BadInput, CorruptObject, LayerstoreError, NotFound, PermissionDenied
from .fileio import pread_exact, pwrite_all

STORE_FORMAT = {"format": "layerstore", "version": 1}
DEFAULT_WORKERS = max(4, (os.cpu_count() or 2) * 2)
# The largest object of each kind a store reads (the store is untrusted: anything larger is
# refused by the backend before it is read): a chunk, a chunk map, a manifest (its payload is at
# most MAX_MANIFEST_BYTES, manifest.schema's limit), a tag, the store marker.
MAX_MANIFEST_BYTES = 16 << 20
MAX_OBJECT_SIZE = {"chunks": chunkobj.MAX_OBJECT, "blobs": chunkmap.MAX_ENCODED,
                   "manifests": chunkobj.max_object_size(MAX_MANIFEST_BYTES)}
MAX_TAG_SIZE = 1024
MAP_FIRST_READ = 1 << 20  # `load_chunk_map`'s first read of a map: its header and, mostly, all of it
PROTOCOL_PREFIXES = (leases.LEASES, "gc/")
T = TypeVar("T")
MAX_CONFIG_SIZE = 64 << 10


@dataclass
class PutStats:
    """What a put added: `new_bytes` counts uncompressed payload that was not stored before."""

    chunks: int = 0
    new_chunks: int = 0
    new_bytes: int = 0
    stored_bytes: int = 0

    def add(self, other: PutStats) -> None:
        self.chunks += other.chunks
        self.new_chunks += other.new_chunks
        self.new_bytes += other.new_bytes
        self.stored_bytes += other.stored_bytes


@dataclass
class BlobResult:
    blob: str
    size: int
    chunks: int
    new_bytes: int
    stats: PutStats = field(repr=False, default_factory=PutStats)

    def to_json(self) -> dict[str, object]:
        return {"blob": self.blob, "size": self.size, "chunks": self.chunks, "new_bytes": self.new_bytes}


@dataclass
class VerifyReport:
    objects: int = 0
    corrupt: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, object]:
        return {"objects": self.objects, "corrupt": sorted(self.corrupt)}


class Store:
    def __init__(self, backend: Backend, *, level: int = chunkobj.DEFAULT_LEVEL,
                 workers: int = DEFAULT_WORKERS) -> None:
        self.backend = backend
        self.level = level
        self.workers = workers
        self._pool: ThreadPoolExecutor | None = None
        self._lease: leases.Lease | None = None
        self._lease_kind = "push"
        self._lease_lock = threading.Lock()

    @classmethod
    def open(cls, url: str | None = None, **kw: object) -> Store:
        return cls(open_backend(resolve_store_url(url)), **kw)  # type: ignore[arg-type]

    @property
    def url(self) -> str:
        return self.backend.url

    def close(self) -> None:
        if self._lease is not None:
            self._lease.release()
            self._lease = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self.backend.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="store")
        return self._pool

    # -- the garbage collector's protocol (docs/gc.md) ------------------------------------
    @property
    def lease(self) -> leases.Lease:
        """This store handle's own lease, opened on first use, released by `close`."""
        if self._lease is None:
            with self._lease_lock:
                if self._lease is None:
                    self._lease = leases.Lease(self.backend, kind=self._lease_kind).open()
        return self._lease

    def name_lease(self, kind: str) -> None:
        """Open this handle's lease (on first use) as `kind`, which is also its id's prefix."""
        with self._lease_lock:
            if self._lease is not None:
                raise RuntimeError("this store handle's lease is open already")
            self._lease_kind = kind

    def keep_lease(self, ttl: float, layers: Iterable[str]) -> tuple[str, float] | None:
        """Leave this handle's lease in the store for `ttl` seconds instead of releasing it at
        `close` (`leases.Lease.keep`); returns (its id, its expiry), or None if it never opened."""
        with self._lease_lock:
            lease, self._lease = self._lease, None
        if lease is None:
            return None
        return lease.id, lease.keep(ttl, layers)

    def protect(self, kind: str, digests: Iterable[str]) -> None:
        """Before relying on stored objects without writing them (deduplication, a manifest's
        layers, a tag's manifest): hold them in this handle's lease and wait out any sweep that
        may delete them (`leases.protect`). An existence check made afterwards stays true."""
        leases.protect(self.lease, {keys.object_key(kind, d) for d in digests})

    # -- the store itself ----------------------------------------------------------------
    def init(self) -> bool:
        """Create the store if needed. Idempotent; True if this call created the marker."""
        self.backend.create()
        return self.backend.store_once(keys.CONFIG, _canonical(STORE_FORMAT))

    def _why_no_config(self) -> str:
        """The end of the message for a location without the store's `config`: `layerctl store init`
        is the fix only where the location is empty; a location holding other objects is most
        likely the wrong path or bucket, and one this client may not list is its operator's."""
        try:
            first = next(iter(self.backend.list("")), None)
        except PermissionDenied:
            return "it has no `config` (an admin creates a store with `layerctl store init`)"
        if first is None:
            return "it is empty (run `layerctl store init` to make it one)"
        return f"it has no `config` but holds other objects ({first!r}, ...): check the store URL"

    def check(self) -> None:
        """Raise unless this is an initialised store of a format we read."""
        self.backend.check()
        try:
            raw = self.backend.load(keys.CONFIG, max_size=MAX_CONFIG_SIZE)
        except NotFound:
            raise NotFound(f"{self.url} is not a layerstore store: {self._why_no_config()}") from None
        try:
            conf = json.loads(raw)
        except ValueError:
            raise CorruptObject(f"{self.url}: store config is not JSON") from None
        if not isinstance(conf, dict) or conf.get("format") != "layerstore":
            raise CorruptObject(f"{self.url}: store config is not a layerstore config")
        if conf.get("version") != STORE_FORMAT["version"]:
            raise CorruptObject(f"{self.url}: unsupported store format version {conf.get('version')}")

    # -- chunks --------------------------------------------------------------------------
    def chunk_key(self, chunk: str) -> str:
        return keys.object_key("chunks", chunk)

    @property
    def reads_in_batches(self) -> bool:
        """Does `load_many` read several chunk objects a request (the backend's batched read)?"""
        return self.backend.reads_in_batches

    def load_many(self, keys: Sequence[str], *, max_size: int | None = None
                  ) -> Iterator[tuple[str, bytes | LayerstoreError]]:
        """The objects of `keys` (`chunk_key`s), raw, in order, or the error loading each: the
        backend's `load_many` (one request for several where it reads in batches)."""
        return self.backend.load_many(keys, max_size=max_size)

    def has_chunk(self, chunk: str) -> bool:
        return self.backend.exists(self.chunk_key(chunk))

    def put_chunk(self, payload: bytes | memoryview, chunk: str | None = None,
                  protected: bool = False) -> tuple[str, PutStats]:
        """Store one chunk unless present. Runs in the caller's thread (zstd and blake3 release
        the GIL, so callers parallelise with threads). `protected`: the caller already ran
        `protect` for it."""
        chunk = chunk or digestmod.of(payload)
        if not protected:
            self.protect("chunks", [chunk])
        key = self.chunk_key(chunk)
        stats = PutStats(chunks=1)
        if self.backend.exists(key):
            return chunk, stats
        obj = chunkobj.pack(payload, self.level)
        if self.backend.store_once(key, obj):
            stats.new_chunks, stats.new_bytes, stats.stored_bytes = 1, len(payload), len(obj)
        return chunk, stats

    def put_chunks(self, payloads: Iterable[bytes | memoryview]) -> Iterator[tuple[str, PutStats]]:
        """Store many chunks in parallel, yielding results in input order. At most a bounded
        number of payloads are in flight, so memory stays flat for any blob size; each batch is
        protected (one lease shard and one look at the sweeps) before its existence checks."""
        window: list[Future[tuple[str, PutStats]]] = []
        limit = self.workers * 2
        for batch in _batched(payloads, limit):
            digests = list(self.pool.map(digestmod.of, batch))
            self.protect("chunks", digests)
            for payload, chunk in zip(batch, digests, strict=True):
                window.append(self.pool.submit(self.put_chunk, payload, chunk, True))
                if len(window) >= limit:
                    yield window.pop(0).result()
        for fut in window:
            yield fut.result()

    def put_chunk_object(self, chunk: str, obj: bytes | memoryview, length: int | None = None,
                         verify: bool = False, protected: bool = False) -> PutStats:
        """Store a chunk object that the caller already encoded (`chunkobj.pack` of a payload
        whose blake3, `chunk`, it computed itself), unless present: a builder compresses its
        chunks while it builds, and the store does not compress them again. Checked before
        anything is stored (`chunkobj.check`): the digest's form, the header, the payload length
        (against `length` when given), a zstd frame declaring that length, and a raw object's
        digest. A zstd body is decompressed and its digest checked only with `verify=True` (it
        is checked on every read anyway). Idempotent; `CorruptObject` for a bad object."""
        digestmod.parse(chunk)
        ulen = chunkobj.check(obj, chunk, length)
        if verify:
            chunkobj.decode(obj, chunk)
        if not protected:
            self.protect("chunks", [chunk])
        key = self.chunk_key(chunk)
        stats = PutStats(chunks=1)
        if self.backend.exists(key):
            return stats
        if self.backend.store_once(key, obj):
            stats.new_chunks, stats.new_bytes, stats.stored_bytes = 1, ulen, len(obj)
        return stats

    def put_chunk_objects(self, items: Iterable[tuple[str, bytes | memoryview]],
                          verify: bool = False) -> Iterator[PutStats]:
        """`put_chunk_object` for many (digest, object) pairs in parallel, yielding results in
        input order, with a bounded number in flight (like `put_chunks`)."""
        window: list[Future[PutStats]] = []
        limit = self.workers * 2
        for batch in _batched(items, limit):
            for chunk, _obj in batch:
                digestmod.parse(chunk)
            self.protect("chunks", [chunk for chunk, _obj in batch])
            for chunk, obj in batch:
                window.append(self.pool.submit(self.put_chunk_object, chunk, obj, None, verify, True))
                if len(window) >= limit:
                    yield window.pop(0).result()
        for fut in window:
            yield fut.result()

    def get_chunk(self, chunk: str, max_length: int = chunkobj.MAX_CHUNK) -> bytes:
        """The verified payload of a chunk; one that says it is longer than `max_length` (a
        reader passes the length its chunk map gives) is refused before it is decompressed."""
        return chunkobj.decode(self._load("chunks", chunk, max_length), chunk, max_length)

    def get_chunk_frame(self, chunk: str, max_length: int = chunkobj.MAX_CHUNK) -> tuple[bytes, memoryview | None]:
        """The verified payload of a chunk and, when the store keeps it zstd-compressed, its zstd
        frame as stored (the one just decompressed to that payload); None for a raw chunk. For a
        node cache that keeps chunks compressed. `max_length` as for `get_chunk`."""
        obj = self._load("chunks", chunk, max_length)
        payload = chunkobj.decode(obj, chunk, max_length)
        if chunkobj.HEADER.unpack_from(obj)[2] != chunkobj.COMP_ZSTD:
            return payload, None
        return payload, memoryview(obj)[chunkobj.HEADER_SIZE:]

    def _load(self, kind: str, ident: str, max_length: int | None = None) -> bytes:
        """The object of `kind` named `ident`, refused by the backend if it is larger than any
        such object can be (or, for a chunk of at most `max_length` bytes, than its object can
        be), or not a plain object."""
        limit = MAX_OBJECT_SIZE[kind]
        if max_length is not None:
            limit = min(limit, chunkobj.max_object_size(max_length))
        return self.backend.load(keys.object_key(kind, ident), max_size=limit)

    # -- blobs ---------------------------------------------------------------------------
    def has_blob(self, blob: str) -> bool:
        return self.backend.exists(keys.object_key("blobs", blob))

    def put_chunk_map(self, cm: ChunkMap) -> bool:
        """Publish a chunk map. Callers store every chunk first; this call checks that they
        did, so a chunk map never points at a missing chunk; and that the map is its blob's
        (`ChunkMap.check`: the chunk list hashes to the blob id)."""
        cm.check()
        leases.protect(self.lease, {keys.object_key("blobs", cm.blob),
                                    *(keys.object_key("chunks", d) for d in cm.unique_digests())})
        missing = [d for d in cm.unique_digests() if not self.has_chunk(d)]
        if missing:
            raise NotFound(f"blob {cm.blob}: {len(missing)} chunk(s) missing, e.g. {missing[0]}")
        return self.backend.store_once(keys.object_key("blobs", cm.blob), cm.encode())

    def get_chunk_map(self, blob: str) -> ChunkMap:
        """The verified chunk map of `blob`. Its header is checked before the rest is read
        (`chunkmap.check_head`): a map with more entries than its blob's size allows costs one
        read of MAP_FIRST_READ bytes, never its whole body nor a decode."""
        return ChunkMap.decode(self.load_chunk_map(blob), blob)

    def load_chunk_map(self, blob: str) -> bytes:
        """The encoded chunk map of `blob`, read only as far as its checked header says it goes:
        the first MAP_FIRST_READ bytes (a whole map up to ~21,000 entries, one read), then the
        rest, refused if the object is longer than its header says."""
        key = keys.object_key("blobs", digestmod.parse(blob))
        try:
            head = self.backend.load(key, 0, MAP_FIRST_READ, max_size=MAX_OBJECT_SIZE["blobs"])
            count, _size = chunkmap.check_head(head, blob)
            want = chunkmap.encoded_size(count)
            if len(head) >= want:
                return head
            return head + self.backend.load(key, len(head), want - len(head), max_size=want)
        except NotFound:
            raise NotFound(f"blob {blob} is not in store {self.url}") from None

    def put_blob(self, path: str | os.PathLike[str], chunk_size: int = DEFAULT_CHUNK_SIZE,
                 progress: Callable[[int], None] | None = None) -> BlobResult:
        """Store a file as a blob cut at fixed offsets; its id is the one its chunk list gives
        it (`chunkmap.blob_id`)."""
        fd = _open_input(path)
        try:
            size = os.fstat(fd).st_size
            bounds = list(fixed_boundaries(size, chunk_size))

            def payloads() -> Iterator[bytes]:
                for off, length in bounds:
                    yield pread_exact(fd, length, off, path)

            refs, stats = [], PutStats()
            for (off, length), (chunk, st) in zip(bounds, self.put_chunks(payloads()), strict=True):
                refs.append(ChunkRef(off, length, chunk))
                stats.add(st)
                if progress:
                    progress(length)
        finally:
            os.close(fd)
        cm = ChunkMap.build(refs)
        self.put_chunk_map(cm)
        return BlobResult(cm.blob, size, len(refs), stats.new_bytes, stats)

    def migrate_chunk_map(self, old: str) -> str | None:
        """Re-key a format-1 chunk map (written by an older layerstore, when a blob's id was the
        blake3 of its whole content) under the id its chunk list gives the blob; returns that id,
        or None if `old`'s map is not format 1. Only after the whole blob is read back, every
        chunk verified, and its bytes hash to `old`: a map whose chunks are not the blob `old`
        named is refused (CorruptObject), never re-keyed. The old map stays (garbage once no
        manifest names `old`); manifests must be re-created with the new id, and re-signed."""
        key = keys.object_key("blobs", digestmod.parse(old))
        data = self.backend.load(key, max_size=chunkmap.MAX_ENCODED_1)
        if data[4:5] != bytes([chunkmap.VERSION_WHOLE_FILE]):
            return None
        refs = ChunkMap.decode_format_1(data, old)
        hasher = digestmod.Hasher()
        for _ref, payload in self.chunks_in_order(refs, old):
            hasher.update(payload)
        if hasher.digest() != old:
            raise CorruptObject(f"blob {old}: its format-1 map's chunks hash to {hasher.digest()}: not re-keyed")
        cm = ChunkMap.build(refs)
        self.put_chunk_map(cm)
        return cm.blob

    def blob_of_file(self, path: str | os.PathLike[str], hint: str | None = None) -> ChunkMap:
        """The chunk map of the stored blob whose bytes the file at `path` holds. A blob id is
        its chunk list's, which a file alone does not give: the blob named `hint` is tried
        first, then every stored blob of the file's size. A candidate counts only if the file
        has its size and every chunk's bytes (hashed here); `NotFound` if none does."""
        fd = _open_input(path)
        try:
            size = os.fstat(fd).st_size
            candidates = ([hint] if hint else []) + [b for b in self.list_digests("blobs") if b != hint]
            for blob in candidates:
                try:
                    cm = self.get_chunk_map(blob)
                except (NotFound, CorruptObject):
                    continue
                if cm.size == size and all(digestmod.of(pread_exact(fd, c.length, c.offset, path)) == c.digest
                                           for c in cm.chunks):
                    return cm
        finally:
            os.close(fd)
        raise NotFound(f"{path}: not in store {self.url} (no stored blob has its bytes)")

    def chunks_in_order(self, refs: Sequence[ChunkRef], blob: str) -> Iterator[tuple[ChunkRef, bytes]]:
        """Every chunk of `refs`, verified (`get_chunk`) and with the length the map gives it, in
        order, fetched `workers * 2` ahead in the store's pool."""
        window: list[tuple[ChunkRef, Future[bytes]]] = []

        def drain_one() -> tuple[ChunkRef, bytes]:
            ref, fut = window.pop(0)
            data = fut.result()
            if len(data) != ref.length:
                raise CorruptObject(f"blob {blob}: chunk {ref.digest} has {len(data)} bytes, map says {ref.length}")
            return ref, data

        for ref in refs:
            window.append((ref, self.pool.submit(self.get_chunk, ref.digest)))
            if len(window) >= self.workers * 2:
                yield drain_one()
        while window:
            yield drain_one()

    def read_blob(self, blob: str, out_fd: int) -> int:
        """Write the verified blob into `out_fd` (from offset 0); returns its size. The chunk
        map is the blob's (its chunk list hashes to `blob`) and every chunk's bytes hash to the
        digest the map gives it, with the length it gives it: every byte written is the blob's."""
        cm = self.get_chunk_map(blob)
        for ref, data in self.chunks_in_order(cm.chunks, blob):
            pwrite_all(out_fd, data, ref.offset)
        os.ftruncate(out_fd, cm.size)
        return cm.size

    # -- manifests and tags --------------------------------------------------------------
    def put_manifest(self, data: bytes) -> str:
        if len(data) > MAX_MANIFEST_BYTES:
            raise BadInput(f"manifest of {len(data)} bytes, more than {MAX_MANIFEST_BYTES}")
        ident, obj = chunkobj.encode(data, self.level)
        self.protect("manifests", [ident])
        self.backend.store_once(keys.object_key("manifests", ident), obj)
        return ident

    def get_manifest(self, manifest: str) -> bytes:
        try:
            obj = self._load("manifests", digestmod.parse(manifest))
        except NotFound:
            raise NotFound(f"manifest {manifest} is not in store {self.url}") from None
        return chunkobj.decode(obj, manifest, MAX_MANIFEST_BYTES)

    def set_tag(self, ref: str, manifest: str) -> None:
        """Point `name:tag` at a manifest, which must already be stored."""
        key = keys.tag_key(ref)
        self.protect("manifests", [digestmod.parse(manifest)])
        if not self.backend.exists(keys.object_key("manifests", manifest)):
            raise NotFound(f"manifest {manifest} is not in store {self.url}")
        self.backend.replace(key, (manifest + "\n").encode())

    def get_tag(self, ref: str) -> str:
        try:
            raw = self.backend.load(keys.tag_key(ref), max_size=MAX_TAG_SIZE)
        except NotFound:
            raise NotFound(f"tag {ref} is not in store {self.url}") from None
        return _parse_tag_value(raw, ref)

    def delete_tag(self, ref: str) -> None:
        try:
            self.backend.delete(keys.tag_key(ref))
        except NotFound:
            raise NotFound(f"tag {ref} is not in store {self.url}") from None

    def tags(self) -> dict[str, str]:
        out = {}
        for key in self.backend.list("tags/"):
            ref = keys.tag_of_key(key)
            try:
                out[ref] = self.get_tag(ref)
            except NotFound:
                continue  # deleted between list and load
        return out

    # -- inventory -----------------------------------------------------------------------
    def list_digests(self, kind: str) -> Iterator[str]:
        for key in self.backend.list(kind + "/"):
            try:
                yield keys.digest_of_key(key)[1]
            except LayerstoreError:
                continue

    def verify(self, progress: Callable[[], None] | None = None) -> VerifyReport:
        """Re-read and check every object. Chunk maps must also point only at present chunks."""
        report = VerifyReport()
        chunks = set()
        futures: list[tuple[str, Future[None]]] = []
        # the collector's and the writers' bookkeeping (layerstore.leases) is not content
        all_keys = [k for k in self.backend.list("") if not k.startswith(PROTOCOL_PREFIXES)]
        for key in all_keys:
            if key.startswith("chunks/"):
                with contextlib.suppress(LayerstoreError):
                    chunks.add(keys.digest_of_key(key)[1])
        for key in all_keys:
            futures.append((key, self.pool.submit(self._verify_key, key, chunks)))
        for key, fut in futures:
            report.objects += 1
            try:
                fut.result()
            except (CorruptObject, LayerstoreError):
                report.corrupt.append(key)
            if progress:
                progress()
        return report

    def _verify_key(self, key: str, chunks: set[str]) -> None:
        if key == keys.CONFIG:
            self.check()
            return
        if key.startswith("tags/"):
            _parse_tag_value(self.backend.load(key, max_size=MAX_TAG_SIZE), keys.tag_of_key(key))
            return
        try:
            kind, ident = keys.digest_of_key(key)
        except LayerstoreError:
            raise CorruptObject(f"{key}: not a layerstore key") from None
        data = self._load(kind, ident)
        if kind == "chunks":
            chunkobj.decode(data, ident)
        elif kind == "manifests":
            chunkobj.decode(data, ident, MAX_MANIFEST_BYTES)
        else:
            cm = ChunkMap.decode(data, ident)
            if not cm.unique_digests() <= chunks:
                raise CorruptObject(f"{key}: points at missing chunks")


def _batched(items: Iterable[T], n: int) -> Iterator[list[T]]:
    batch: list[T] = []
    for item in items:
        batch.append(item)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


def _canonical(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _parse_tag_value(raw: bytes, ref: str) -> str:
    try:
        return digestmod.parse(raw.decode("ascii").strip())
    except (UnicodeDecodeError, LayerstoreError):
        raise CorruptObject(f"tag {ref}: does not hold a manifest digest") from None


def _open_input(path: str | os.PathLike[str]) -> int:
    """A descriptor of a local file to store or to look up; NotFound if it cannot be read."""
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise NotFound(f"cannot read {path}: {os.strerror(e.errno or 0)}") from None
