"""Fetching from the store: chunk maps on first lookup, chunks on demand and in the background.

- Single-flight: one `Flight` per chunk position, registered in `NodeCache.busy`; every reader of
  that position waits for it. A fetched payload is written to every position of the blob that has
  the same digest, so a chunk is fetched once per blob even when files repeat.
- Bounded concurrency: a `PriorityLimiter` of `concurrency` slots orders flights demand-first;
  prefetch additionally holds one of `prefetch_concurrency` tokens (default: three quarters of
  the slots), so it never occupies more than that many slots, and a demand reader joining a
  queued prefetch flight raises its priority.
- Store calls, verification and decompression (`Store.get_chunk`: blake3 and zstd release the
  GIL) and the pwrite into the cache run in worker threads; the commit runs on the trio thread.
- Recovered chunks (committed before this process opened the cache, not re-hashed since: see
  `recovery.recover`) take the same path: the flight first re-hashes the local bytes
  (`NodeCache.check_unverified`, a worker thread); a match is served without a store fetch, a
  mismatch is dropped, counted and logged, and the chunk is fetched from the store.
- The cache's own disk: a failed write (ENOSPC included) fails the flight with `CacheIOError`
  (EIO for the readers now, not retried by them: the next read tries again), is counted and,
  for ENOSPC, kicks an eviction (`NodeCache.write_failed`).
- Failures: a chunk that fails verification fails its flight (EIO for the readers; counted and
  logged with blob and chunk; nothing is written), and the next read starts a new flight. A store
  that cannot be reached fails the flight too, but each waiting reader retries until its own
  deadline before giving up, on the project's one retry policy (`layerstore.retry`: 50 ms
  doubling to 1 s, no jitter).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Protocol

import trio

from layerstore.chunkmap import ChunkMap
from layerstore.errors import CorruptObject, LayerstoreError, NotFound, StoreUnavailable
from layerstore.retry import RetryPolicy, Schedule

from .cache import NodeCache
from .entry import BlobEntry, Flight
from .errors import CacheIOError
from .limiter import DEMAND, PREFETCH, PriorityLimiter
from .stats import Stats

log = logging.getLogger("layerstore.fuse.fetch")

DEFAULT_CONCURRENCY = 16
DEFAULT_DEADLINE = 10.0
BACKOFF_MIN = 0.05
BACKOFF_MAX = 1.0
_PRIORITY_NAMES = {DEMAND: "demand", PREFETCH: "prefetch"}


class ChunkSource(Protocol):
    """What the fetcher needs of a store (`layerstore.store.Store` is one)."""

    def get_chunk(self, chunk: str) -> bytes: ...

    def get_chunk_map(self, blob: str) -> ChunkMap: ...


class Fetcher:
    def __init__(self, store: ChunkSource, cache: NodeCache, stats: Stats, *, nursery: trio.Nursery,
                 concurrency: int = DEFAULT_CONCURRENCY, prefetch_concurrency: int | None = None,
                 deadline: float = DEFAULT_DEADLINE) -> None:
        self.store = store
        self.cache = cache
        self.stats = stats
        self.deadline = deadline
        self._nursery = nursery
        self._slots = PriorityLimiter(concurrency)
        self._threads = trio.CapacityLimiter(concurrency)
        # Prefetch and readahead may hold three quarters of the slots: a sequential reader of a
        # cold blob needs many fetches in flight (GET latency x bandwidth), and a demand fetch
        # still finds a free slot at once or gets the next one (demand goes first).
        self._prefetch = trio.CapacityLimiter(prefetch_concurrency or max(1, concurrency * 3 // 4))
        # Every retry of a chunk map or a chunk waits 50 ms doubling to 1 s, until the deadline
        # (of the lookup, or of the read the chunk is for).
        self.retry = RetryPolicy(first=BACKOFF_MIN, cap=BACKOFF_MAX, deadline=deadline, jitter=False)
        self._map_flights: dict[str, Flight] = {}
        self._last_error_log = 0.0
        self._suppressed = 0

    # -- chunk maps ------------------------------------------------------------------------
    async def entry(self, blob: str) -> BlobEntry:
        """The cache entry of a blob, fetching its chunk map from the store on first use.
        `NotFound` if the store does not have the blob."""
        e = self.cache.get(blob)
        if e is not None:
            return e
        fl = self._map_flights.get(blob)
        if fl is None:
            fl = self._map_flights[blob] = Flight(DEMAND, "map")
            self._nursery.start_soon(self._fetch_map, blob, fl)
        with trio.move_on_after(self.deadline + 1.0):
            await fl.done.wait()
        if not fl.done.is_set():
            raise StoreUnavailable(f"blob {blob}: chunk map not fetched within {self.deadline:g} s")
        if fl.error is not None:
            raise _copy(fl.error)
        e = self.cache.get(blob)
        if e is None:  # pragma: no cover - the flight added it
            raise StoreUnavailable(f"blob {blob}: chunk map vanished")
        return e

    async def _fetch_map(self, blob: str, fl: Flight) -> None:
        sched = self.retry.schedule(trio.current_time())
        try:
            while True:
                try:
                    cmap = await trio.to_thread.run_sync(self.store.get_chunk_map, blob, abandon_on_cancel=True,
                                                         limiter=self._threads)
                    break
                except (NotFound, CorruptObject):
                    raise  # the store's final word on this blob
                except Exception as e:
                    err = _as_store_error(e)
                    self._store_error(f"blob {blob}: chunk map", err)
                    delay = sched.next_delay(trio.current_time())
                    if delay is None:
                        raise err from None
                    await trio.sleep(delay)
            self.cache.add_blob(cmap)
        except LayerstoreError as e:
            fl.error = e
        except Exception as e:  # the cache's own disk: still an expected, reported failure
            log.exception("blob %s: cannot add to the cache", blob)
            fl.error = StoreUnavailable(f"blob {blob}: {e}")
        finally:
            del self._map_flights[blob]
            fl.done.set()

    # -- chunks ------------------------------------------------------------------------------
    async def ensure(self, entry: BlobEntry, idxs: Sequence[int], *, priority: int = DEMAND,
                     deadline: float | None = None) -> None:
        """Return once every chunk in `idxs` is present (all fetched in parallel), or raise
        `CorruptObject` / `StoreUnavailable`."""
        missing = entry.missing(idxs)
        if not missing:
            return
        if deadline is None:
            deadline = trio.current_time() + self.deadline
        if len(missing) == 1:
            await self._ensure_one(entry, missing[0], priority, deadline)
            return
        errors: list[LayerstoreError] = []

        async def one(i: int) -> None:
            try:
                await self._ensure_one(entry, i, priority, deadline)
            except LayerstoreError as e:
                errors.append(e)

        async with trio.open_nursery() as nursery:
            for i in missing:
                nursery.start_soon(one, i)
        if errors:
            raise next((e for e in errors if isinstance(e, CorruptObject)), errors[0])

    async def _ensure_one(self, entry: BlobEntry, idx: int, priority: int, deadline: float) -> None:
        sched: Schedule | None = None
        while not entry.present[idx]:
            try:
                await self._join(entry, idx, priority, deadline)
            except (CorruptObject, CacheIOError):
                raise  # wrong bytes, or a cache disk that cannot take them: the next read tries again
            except LayerstoreError as e:
                # Anything else may pass, a chunk the store says it lacks included: a chunk map
                # is published only after its chunks, so the store itself is missing (a store
                # directory renamed away, a filesystem unmounted) and may come back.
                if sched is None:  # counted from `deadline - self.deadline`: when the read began
                    sched = self.retry.schedule(deadline - self.deadline)
                delay = sched.next_delay(trio.current_time())
                if delay is None:
                    raise StoreUnavailable(f"blob {entry.blob} chunk {idx}: giving up after "
                                           f"{self.deadline:g} s: {e}") from None
                await trio.sleep(delay)

    async def _join(self, entry: BlobEntry, idx: int, priority: int, deadline: float) -> None:
        key = (entry.blob, idx)
        fl = self.cache.busy.get(key)
        if fl is None:
            fl = self._launch(entry, idx, priority)
        elif priority < fl.priority:
            fl.priority = priority
        with trio.move_on_at(deadline):
            await fl.done.wait()
        if not fl.done.is_set():
            raise StoreUnavailable(f"blob {entry.blob} chunk {idx}: no answer from the store")
        if fl.error is not None and fl.kind == "fetch":
            raise _copy(fl.error)

    def _launch(self, entry: BlobEntry, idx: int, priority: int) -> Flight:
        blob, busy = entry.blob, self.cache.busy
        digest = entry.cmap.chunks[idx].digest
        positions = [i for i in entry.positions(digest)
                     if i == idx or (not entry.present[i] and (blob, i) not in busy)]
        fl = Flight(priority, "fetch")
        for i in positions:
            busy[(blob, i)] = fl
        self._nursery.start_soon(self._fly, entry, positions, digest, fl)
        return fl

    async def _fly(self, entry: BlobEntry, positions: list[int], digest: str, fl: Flight) -> None:
        blob = entry.blob
        ref = entry.cmap.chunks[positions[0]]
        try:
            async with self._slots.hold(fl):
                t0 = time.perf_counter()
                prio = fl.priority
                if any(entry.unverified[i] for i in positions):
                    good, _ = await self.cache.check_unverified(entry, positions)
                    if good:  # verified local bytes: no store fetch
                        rest = [i for i in positions if i not in good]
                        if rest:
                            await trio.to_thread.run_sync(_copy_chunk, entry, good[0], rest,
                                                          abandon_on_cancel=True, limiter=self._threads)
                        self.cache.commit(entry, positions)
                        return
                # One worker thread call: get, verify and decompress, then write (one hop per chunk).
                # Abandoned on cancel (a store that hangs must not hold up a shutdown); the thread
                # then never writes to a closed entry (`BlobEntry.io_lock`).
                await trio.to_thread.run_sync(self._get_and_write, entry, positions, digest, ref.length,
                                              abandon_on_cancel=True, limiter=self._threads)
                self.cache.commit(entry, positions)
                self.stats.fetch_seconds.labels(_PRIORITY_NAMES.get(prio, "other")).observe(time.perf_counter() - t0)
                bs = self.stats.blob(blob, entry.size)
                bs.fetched_bytes += ref.length
                bs.fetches += 1
        except CacheIOError as e:  # the cache's own disk failed: report, never serve
            self.cache.write_failed(e.errno_value)
            self.stats.cache_write_failures += 1
            log.error("blob %s chunk %d: %s", blob, positions[0], e)
            fl.error = e
        except CorruptObject as e:
            self.stats.corrupt_chunks += 1
            log.error("corrupt chunk: blob %s chunk %d (%s) failed verification, not served: %s",
                      blob, positions[0], digest, e)
            fl.error = e
        except LayerstoreError as e:
            self._store_error(f"blob {blob} chunk {positions[0]}", e)
            fl.error = e
        except Exception as e:  # the cache's own disk failed: report, never serve
            log.exception("blob %s chunk %d: cannot write to the cache", blob, positions[0])
            fl.error = StoreUnavailable(f"blob {blob} chunk {positions[0]}: cache write failed: {e}")
        finally:
            busy = self.cache.busy
            for i in positions:
                if busy.get((blob, i)) is fl:
                    del busy[(blob, i)]
            fl.done.set()

    def _get_and_write(self, entry: BlobEntry, positions: list[int], digest: str, length: int) -> None:
        """Worker thread: the chunk from the store (verified), written at every position. Touches
        no shared state: `entry.fd` and the chunk map are immutable while the entry lives."""
        try:
            payload = self.store.get_chunk(digest)
        except LayerstoreError:
            raise
        except Exception as e:  # a backend's unexpected failure: the store is not answering properly
            raise _as_store_error(e) from None
        if len(payload) != length:
            raise CorruptObject(f"chunk {digest} has {len(payload)} bytes, the chunk map says {length}")
        _write(entry, positions, payload)

    def _store_error(self, what: str, err: LayerstoreError) -> None:
        self.stats.store_errors += 1
        now = time.monotonic()
        if now - self._last_error_log >= 1.0:
            extra = f" ({self._suppressed} similar suppressed)" if self._suppressed else ""
            log.warning("store error: %s: %s%s", what, err, extra)
            self._last_error_log, self._suppressed = now, 0
        else:
            self._suppressed += 1

    # -- prefetch ----------------------------------------------------------------------------
    def readahead(self, entry: BlobEntry, start: int, stop: int) -> None:
        """Fetch a sequential reader's new window [start, stop) of chunks (see
        `readahead.Streams`) in the background, at prefetch priority, leaving out chunks present
        or in flight (a prefetch task for a chunk in flight would hold a token just to wait)."""
        busy, present, blob = self.cache.busy, entry.present, entry.blob
        todo = [i for i in range(start, stop) if not present[i] and (blob, i) not in busy]
        if todo:
            self._nursery.start_soon(self.prefetch, entry, todo)

    def prefetch_soon(self, entry: BlobEntry, idxs: Sequence[int]) -> None:
        """`prefetch` in the background (its outcome is only logged)."""
        self._nursery.start_soon(self.prefetch, entry, idxs)

    async def prefetch(self, entry: BlobEntry, idxs: Sequence[int]) -> tuple[int, int]:
        """Fetch chunks in the given order below demand priority. Returns (done, failed)."""
        done = failed = 0

        async def one(i: int, token: object) -> None:
            nonlocal done, failed
            try:
                await self._ensure_one(entry, i, PREFETCH, trio.current_time() + self.deadline)
                done += 1
            except LayerstoreError as e:
                failed += 1
                log.debug("prefetch of blob %s chunk %d failed: %s", entry.blob, i, e)
            finally:
                self._prefetch.release_on_behalf_of(token)

        async with trio.open_nursery() as nursery:
            for i in idxs:
                if entry.present[i]:
                    continue
                token = object()
                await self._prefetch.acquire_on_behalf_of(token)
                nursery.start_soon(one, i, token)
        return done, failed


def _write(entry: BlobEntry, positions: list[int], payload: bytes) -> None:
    try:
        entry.write_sync(positions, payload)
    except OSError as e:
        raise CacheIOError(f"writing to the cache: {os.strerror(e.errno or 0)}", e.errno) from None


def _copy_chunk(entry: BlobEntry, src: int, positions: list[int]) -> None:
    """Worker thread: the verified bytes at position `src` written at `positions` (same digest)."""
    ref = entry.cmap.chunks[src]
    try:
        payload = entry.read_sync(ref.offset, ref.end)
    except OSError as e:
        raise CacheIOError(f"reading the cache: {os.strerror(e.errno or 0)}", e.errno) from None
    _write(entry, positions, payload)


def _as_store_error(e: BaseException) -> LayerstoreError:
    if isinstance(e, LayerstoreError):
        return e
    return StoreUnavailable(f"{type(e).__name__}: {e}")


def _copy(e: BaseException) -> BaseException:
    """A fresh exception for each waiter (one instance raised in many tasks would share a
    growing traceback)."""
    try:
        return type(e)(*e.args)
    except Exception:
        return StoreUnavailable(str(e))
