"""Compressing a layer's chunks while it is built (`build_layer(..., sink=...)`).

The data area's chunks are known as it is laid out: a data extent never changes once the entry
that wrote it has been added, and the chunk cut of the data area (`chunking.cut`) closes a chunk
as soon as the extents after it are known. `chunking.DataCutter`, the one implementation of the
data area's cut, is fed the extents as they arrive; `Compressor` reads each closed chunk back
from the image file (page cache) in worker threads, hashes it (blake3), and, unless an identical
chunk was seen already or the sink holds it, compresses it (`chunkobj.pack`) and hands the
object to the sink. blake3, zstd and pread release the GIL, so this runs on the other core while
the Python-bound writer goes on. The rest (the last data group, metadata, a parent's data) is
compressed once the image is complete.

Memory is bounded: at most `threads * 2` batches of about `BATCH` bytes are in flight (the writer
waits for a slot), and objects go to the sink as they are made.

What the sink receives is only ever the object of a chunk of the final image: `build_layer` uses a
worker's digest only for a cut that the final cut has too (same offset and length), and compresses
every other distinct chunk after the image is hashed. A `StoreSink` may receive an object for a cut
that the final cut does not have if the two ever disagreed (tests check that they do not); such an
object is an unreferenced chunk, garbage for `gc`, never a wrong one (its digest is of its bytes).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import blake3

from layerstore import chunkobj
from layerstore import digest as digestmod
from layerstore.fileio import pread_exact
from layerstore.store import PutStats, Store

from .chunking import Cut

COMPRESS_THREADS = os.cpu_count() or 2
BATCH = 4 << 20
# batches queued at most (each a list of cuts: the bytes are read when a worker takes it, so a
# queued batch costs no memory); the writer waits when the workers are this far behind
MAX_QUEUED = 64


class ChunkSink(Protocol):
    """Where compressed chunk objects go. `wanted` and `put` are called from worker threads,
    `flush` by the builder once every chunk was handed over."""

    level: int

    def wanted(self, chunk: str) -> bool:
        """False if the chunk is stored already (it is then not compressed)."""

    def put(self, chunk: str, obj: bytes, length: int) -> None:
        """Take the object of chunk `chunk` (a payload of `length` bytes)."""

    def flush(self) -> None:
        """Return once every object `put` so far is where it goes; raise the first error."""


class MemorySink:
    """Keeps the objects in memory (`keep=False`: only counts them)."""

    def __init__(self, level: int = chunkobj.DEFAULT_LEVEL, keep: bool = True) -> None:
        self.level = level
        self.keep = keep
        self.objects: dict[str, bytes] = {}
        self.stats = PutStats()
        self._lock = threading.Lock()

    def wanted(self, chunk: str) -> bool:
        return chunk not in self.objects

    def put(self, chunk: str, obj: bytes, length: int) -> None:
        with self._lock:
            self.stats.add(PutStats(1, 1, length, len(obj)))
            if self.keep:
                self.objects[chunk] = obj

    def flush(self) -> None:
        pass


class StoreSink:
    """Stores the objects in a store as they are made (`Store.put_chunk_object`); chunks the
    store already holds are not compressed. Push the layer's chunk map afterwards
    (`push_layer`, which then stores no chunk again).

    The writes run in the store's own thread pool, not in the compressing workers: a store
    write waits on the disk or the network (a local store fsyncs every object), and a
    compressing worker that waited with it left its core idle (measured: the compressing build
    into a local store was slower than a build followed by a push, whose writes run in the
    store's pool). At most `store.workers * 2` objects wait for a writer; `put` blocks beyond."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.level = store.level
        self.stats = PutStats()
        self._lock = threading.Lock()
        self._window = threading.BoundedSemaphore(store.workers * 2)
        self._futures: list[Future[PutStats]] = []

    def wanted(self, chunk: str) -> bool:
        return not self.store.has_chunk(chunk)

    def put(self, chunk: str, obj: bytes, length: int) -> None:
        self._window.acquire()
        try:
            fut = self.store.pool.submit(self.store.put_chunk_object, chunk, obj, length)
        except BaseException:
            self._window.release()
            raise
        fut.add_done_callback(self._stored)
        with self._lock:
            self._futures.append(fut)

    def _stored(self, fut: Future[PutStats]) -> None:
        self._window.release()
        if not fut.cancelled() and fut.exception() is None:
            with self._lock:
                self.stats.add(fut.result())

    def flush(self) -> None:
        with self._lock:
            futures, self._futures = self._futures, []
        for fut in futures:
            fut.result()


class Compressor:
    """Worker threads that hash and compress chunks of an image file being written."""

    def __init__(self, fd: int, sink: ChunkSink, threads: int = COMPRESS_THREADS) -> None:
        self.fd = fd
        self.sink = sink
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="compress")
        self._slots = threading.Semaphore(MAX_QUEUED)
        # workers compressing at once: one core is the writer's while it adds entries (two
        # compressing workers slowed it by half), all of them once it is done (`full_speed`)
        self._threads = threads
        self._running = threading.Semaphore(max(1, threads - 1))
        self._full = threads <= 1
        self._futures: list[Future[None]] = []
        self.digests: dict[tuple[int, int], bytes] = {}  # (offset, length) -> blake3, of streamed cuts
        self._claimed: set[str] = set()
        self._claim_lock = threading.Lock()
        self.submitted: set[tuple[int, int]] = set()
        # digests known before the bytes are read (the writer's SLICE pieces of big runs)
        self.known: dict[tuple[int, int], bytes] = {}

    def submit(self, cuts: list[Cut], digests: dict[tuple[int, int], str] | None = None) -> None:
        """Compress `cuts` (their bytes are in the file and final). With `digests` (of every
        cut), the chunks are not hashed again. Blocks while all slots are busy."""
        if not cuts:
            return
        for c in cuts:
            self.submitted.add((c.offset, c.length))
        self._slots.acquire()
        try:
            fut = self.pool.submit(self._run, cuts, digests)
        except BaseException:
            self._slots.release()
            raise
        fut.add_done_callback(lambda _f: self._slots.release())
        self._futures.append(fut)

    def submit_batched(self, cuts: Iterable[Cut], digests: dict[tuple[int, int], str]) -> None:
        batch: list[Cut] = []
        size = 0
        for c in cuts:
            batch.append(c)
            size += c.length
            if size >= BATCH:
                self.submit(batch, digests)
                batch, size = [], 0
        self.submit(batch, digests)

    def full_speed(self) -> None:
        """The writer is done with its Python-bound part: every worker may compress."""
        if not self._full:
            self._full = True
            self._running.release()

    def _claim(self, chunk: str) -> bool:
        with self._claim_lock:
            if chunk in self._claimed:
                return False
            self._claimed.add(chunk)
            return True

    def _run(self, cuts: list[Cut], digests: dict[tuple[int, int], str] | None) -> None:
        with self._running:
            self._compress(cuts, digests)

    def _compress(self, cuts: list[Cut], digests: dict[tuple[int, int], str] | None) -> None:
        for c in cuts:
            data = pread_exact(self.fd, c.length, c.offset, "image file")
            if digests is None:
                raw = self.known.get((c.offset, c.length)) or blake3.blake3(data).digest()
                self.digests[(c.offset, c.length)] = raw
                chunk = digestmod.PREFIX + raw.hex()
            else:
                chunk = digests[(c.offset, c.length)]
            if not self._claim(chunk) or not self.sink.wanted(chunk):
                continue
            self.sink.put(chunk, chunkobj.pack(data, self.sink.level), len(data))

    def wait(self) -> None:
        """Wait for every batch submitted so far; raise the first error."""
        futures, self._futures = self._futures, []
        for fut in futures:
            fut.result()

    def close(self, cancel: bool = False) -> None:
        self.pool.shutdown(wait=True, cancel_futures=cancel)

