"""Fetching from the store: chunk maps on first lookup, chunks on demand and in the background.

- Single-flight: one flight per chunk position (`NodeCache.begin_fetch`: a `FetchWriter` that
  writes the verified bytes, then commits or aborts; see `inflight`); every reader of
  that position waits for it. A fetched payload is written to every position of the blob that has
  the same digest, so a chunk is fetched once per blob even when files repeat.
- The node's cap on store requests in flight: a `PriorityLimiter` of `concurrency` slots, one
  per store request (a chunk map, a chunk GET, a batched read), urgent before background (chunk
  maps, metadata and readers' misses before readahead and prefetch; background gets only what
  urgent work leaves: see `limiter`); prefetch additionally holds one of `prefetch_concurrency`
  tokens per request it makes, so a long prefetch never has more than that many queued or in
  flight, and a reader joining a prefetch flight, queued or running, raises its priority.
- Batched reads: where several chunks of a blob are wanted at once (a read spanning chunks,
  metadata before a mount, readahead windows, prefetch) and the store's backend reads several
  objects a request (`ChunkSource.reads_in_batches`: a `Store` over the HTTP service), and more chunks are wanted
  than their class has slots free, they go in batches (`ChunkSource.load_many`) of at most `batch`,
  just large enough that the wanted chunks fit in the free slots: requests in parallel where
  there is room (a batch is answered in order, one stream: measured slower for a sequential
  reader than the same chunks as parallel GETs), fewer requests where there is not. Still one
  `Flight` per chunk: each is verified, written and committed as its object arrives, and fails
  alone (a corrupt object fails only its readers).
- Store calls, verification and decompression (`Store.get_chunk`: blake3 and zstd release the
  GIL) and the pwrite into the cache run in worker threads; the commit runs on the trio thread.
- Recovered chunks (committed before this process opened the cache, not re-hashed since: see
  `recovery.recover`) take the same path: the flight first re-hashes the local bytes
  (`Verifier.check_unverified`, a worker thread); a match is served without a store fetch, a
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
import time
from collections.abc import Sequence
from typing import Any

import trio

from layerstore import chunkobj
from layerstore.errors import CorruptObject, LayerstoreError, NotFound, StoreUnavailable
from layerstore.retry import RetryPolicy, Schedule
from layerstore.store import MAX_OBJECT_SIZE

from .cache import NodeCache
from .decodebudget import ByteBudget, budget_from_env, cost
from .entry import BlobEntry, Flight
from .errors import CacheIOError
from .inflight import FetchWriter
from .limiter import DEMAND, PREFETCH, PriorityLimiter, default_background
from .source import ChunkSource
from .stats import Stats

log = logging.getLogger("layerstore.fuse.fetch")

DEFAULT_CONCURRENCY = 16  # store requests in flight per node (docs/node-cache.md, "Fairness under a burst")
DEFAULT_BATCH = 16  # chunks one batched read asks for (the http backend's READ_BATCH)
DEFAULT_DEADLINE = 10.0
BACKOFF_MIN = 0.05
BACKOFF_MAX = 1.0
_PRIORITY_NAMES = {DEMAND: "demand", PREFETCH: "prefetch"}


class Request:
    """One store request and the slot it holds: a chunk map, one chunk's flight, or a batch of
    flights (its priority is the highest of theirs)."""

    __slots__ = ("priority", "flights", "cls", "burst")

    def __init__(self, priority: int, flights: list[Flight]) -> None:
        self.priority = priority
        self.flights = flights
        self.cls = 0  # the class it was counted in at launch (`Fetcher._open`)
        # Counts toward a burst when granted as urgent (`PriorityLimiter`): not when it is a
        # prefetch a reader joined (a sequential reader catching up with its own readahead
        # must not throttle it).
        self.burst = priority <= DEMAND


class Fetcher:
    def __init__(self, store: ChunkSource, cache: NodeCache, stats: Stats, *, nursery: trio.Nursery,
                 concurrency: int = DEFAULT_CONCURRENCY, prefetch_concurrency: int | None = None,
                 background_busy: int | None = None, batch: int = DEFAULT_BATCH, priorities: bool = True,
                 deadline: float = DEFAULT_DEADLINE, decode_budget: int | None = None) -> None:
        """`concurrency`: the node's cap on store requests in flight; `prefetch_concurrency`:
        of which background may hold (default three quarters); `background_busy`: how many
        background requests may be in flight while urgent ones wait or run (default an eighth);
        `batch`: chunks a batched read asks for (1: none); `priorities=False`: one FIFO queue
        for everything (a benchmark's baseline, never the daemon's); `decode_budget`: bytes that
        chunks being verified and decompressed may take at once (`decodebudget`; default
        $LAYERSTORE_DECODE_BUDGET, else 128 MiB)."""
        self.store = store
        self.cache = cache
        self.stats = stats
        self.deadline = deadline
        self.batch = max(1, batch)
        self._nursery = nursery
        background = prefetch_concurrency or default_background(concurrency)
        self.slots = PriorityLimiter(concurrency, background=background, background_busy=background_busy,
                                     fifo=not priorities)
        # Worker threads for store calls: as many as slots, so a thread abandoned by a cancelled
        # flight (it finishes in the background) still counts against the cap.
        self._threads = trio.CapacityLimiter(concurrency)
        self.decoding = ByteBudget(decode_budget or budget_from_env())
        # Prefetch and readahead: at most `background` requests queued or in flight, each holding
        # a token (a prefetch of a whole blob does not queue thousands of flights at once).
        self.prefetch_tokens = trio.CapacityLimiter(background if priorities else concurrency)
        self._requests: dict[Flight, Request] = {}
        self._open = [0, 0]  # requests launched and not yet over, per class (urgent, background)
        # Every retry of a chunk map or a chunk waits 50 ms doubling to 1 s, until the deadline
        # (of the lookup, or of the read the chunk is for).
        self.retry = RetryPolicy(first=BACKOFF_MIN, cap=BACKOFF_MAX, deadline=deadline, jitter=False)
        self._map_flights: dict[str, Flight] = {}
        self._last_error_log = 0.0
        self._suppressed = 0
        self._timers: dict[int, Any] = {}  # priority -> its child of `stats.fetch_seconds`

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
                    async with self.slots.hold(Request(DEMAND, [fl])):
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
            # a fresh exception, no traceback: the failed load's frames (a refused map's bytes)
            # must not live as long as the flight's waiters
            fl.error = _copy(e)
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
        self._launch(entry, missing, priority)
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
        fl = self.cache.in_flight(entry.blob, idx)
        if fl is None:
            self._launch(entry, [idx], priority)
            fl = self.cache.in_flight(entry.blob, idx)
            assert fl is not None
        elif priority < fl.priority:
            self._raise_priority(fl, priority)
        with trio.move_on_at(deadline):
            await fl.done.wait()
        if not fl.done.is_set():
            raise StoreUnavailable(f"blob {entry.blob} chunk {idx}: no answer from the store")
        if fl.error is not None and fl.kind == "fetch":
            raise _copy(fl.error)

    def _raise_priority(self, fl: Flight, priority: int) -> None:
        """A reader joined a flight of lower priority: the flight, and the request it is in
        (queued or running), count as the reader's from now on."""
        fl.priority = priority
        req = self._requests.get(fl)
        if req is not None and priority < req.priority:
            req.priority = priority
            self.slots.reprioritized(req)

    def _launch(self, entry: BlobEntry, idxs: Sequence[int], priority: int) -> None:
        """A flight for each chunk of `idxs` neither present nor in flight (one per digest: its
        other absent, idle positions are written too), in requests: batches of up to `batch`
        chunks when the backend reads in batches, else one a chunk."""
        blob, cache, present = entry.blob, self.cache, entry.present
        flights: list[tuple[FetchWriter, list[int], str]] = []
        for idx in idxs:
            if present[idx] or cache.in_flight(blob, idx) is not None:
                continue
            digest = entry.cmap.chunks[idx].digest
            positions = [i for i in entry.positions(digest)
                         if i == idx or (not present[i] and cache.in_flight(blob, i) is None)]
            w = cache.begin_fetch(entry, positions, priority)
            flights.append((w, positions, digest))
        if not flights:
            return
        size = self._batch_size(len(flights), priority) if len(flights) > 1 and self._batching() else 1
        # Recovered chunks are re-hashed locally first (`_fly`), never batched.
        batched = [f for f in flights if size > 1 and not any(entry.unverified[i] for i in f[1])]
        single = [f for f in flights if size == 1 or any(entry.unverified[i] for i in f[1])]
        groups = [batched[k:k + size] for k in range(0, len(batched), size)]
        single += [g[0] for g in groups if len(g) == 1]
        for w, _positions, digest in single:
            req = self._requests[w.flight] = Request(priority, [w.flight])
            self._opened(req)
            self._nursery.start_soon(self._fly, w, digest, req)
        for group in groups:
            if len(group) == 1:
                continue
            req = Request(priority, [f[0].flight for f in group])
            for w, _p, _d in group:
                self._requests[w.flight] = req
            self._opened(req)
            self._nursery.start_soon(self._fly_batch, entry, group, req)

    def _batch_size(self, n: int, priority: int) -> int:
        """Chunks a request carries so that `n` wanted chunks fit in the slots their class has
        free (counting requests launched that have not got theirs yet), at most `batch`."""
        cls = 0 if priority <= DEMAND else 1
        room = self.slots.share(priority) - self._open[cls]
        return min(self.batch, max(1, -(-n // max(1, room))))

    def _opened(self, req: Request) -> None:
        req.cls = 0 if req.priority <= DEMAND else 1
        self._open[req.cls] += 1

    def _closed(self, req: Request) -> None:
        self._open[req.cls] -= 1

    def _batching(self) -> bool:
        if self.batch < 2:
            return False
        return self.store.reads_in_batches

    async def _fly(self, w: FetchWriter, digest: str, req: Request) -> None:
        entry, positions = w.entry, w.positions
        blob = entry.blob
        ref = entry.cmap.chunks[positions[0]]
        slots = self.slots
        try:
            # acquire/release, not `slots.hold`: one context manager fewer per chunk fetched.
            await slots.acquire(req)
            try:
                t0 = time.perf_counter()
                prio = w.flight.priority
                unverified = entry.unverified
                if any(unverified[i] for i in positions):
                    good, _ = await self.cache.verifier.check_unverified(entry, positions)
                    if good:  # verified local bytes: no store fetch
                        rest = [i for i in positions if i not in good]
                        if rest:
                            await trio.to_thread.run_sync(w.copy, good[0], rest,
                                                          abandon_on_cancel=True, limiter=self._threads)
                        w.commit()
                        return
                # One worker thread call: get, verify and decompress, then write (one hop per chunk).
                # Abandoned on cancel (a store that hangs must not hold up a shutdown); the thread
                # then never writes to a closed entry (`BlobEntry.io_lock`).
                async with self.decoding.hold(cost([ref.length])):
                    await trio.to_thread.run_sync(self._get_and_write, w, digest, ref.length,
                                                  abandon_on_cancel=True, limiter=self._threads)
                self._fetched(w, prio, t0)
            finally:
                slots.release(req)
        except Exception as e:
            w.abort(self._failed(blob, positions[0], digest, e))
        finally:
            self._closed(req)
            self._land(w)

    def _failed(self, blob: str, idx: int, digest: str, e: Exception) -> LayerstoreError:
        """Count and log one chunk's failure; the error its readers see."""
        if isinstance(e, CacheIOError):  # the cache's own disk failed: report, never serve
            self.cache.evictor.write_failed(e.errno_value)
            self.stats.cache_write_failures += 1
            log.error("blob %s chunk %d: %s", blob, idx, e)
            return e
        if isinstance(e, CorruptObject):
            self.stats.corrupt_chunks += 1
            log.error("corrupt chunk: blob %s chunk %d (%s) failed verification, not served: %s", blob, idx, digest, e)
            return e
        if isinstance(e, LayerstoreError):
            self._store_error(f"blob {blob} chunk {idx}", e)
            return e
        log.error("blob %s chunk %d: cannot write to the cache: %s", blob, idx, e)
        return StoreUnavailable(f"blob {blob} chunk {idx}: cache write failed: {e}")

    def _land(self, w: FetchWriter) -> None:
        """The flight is over: committed, aborted with an error, or (cancelled) aborted with
        none, its waiters then trying again; its request forgotten."""
        w.abort()  # (nothing if it was committed or aborted with an error)
        self._requests.pop(w.flight, None)

    def _fetched(self, w: FetchWriter, prio: int, t0: float) -> None:
        entry, positions = w.entry, w.positions
        w.commit()
        timer = self._timers.get(prio)
        if timer is None:  # `labels` takes a lock and builds a key: once per priority, not per chunk
            timer = self._timers[prio] = self.stats.fetch_seconds.labels(_PRIORITY_NAMES.get(prio, "other"))
        timer.observe(time.perf_counter() - t0)
        bs = self.stats.blob(entry.blob, entry.size)
        bs.fetched_bytes += entry.cmap.chunks[positions[0]].length
        bs.fetches += 1

    async def _fly_batch(self, entry: BlobEntry, group: list[tuple[FetchWriter, list[int], str]],
                         req: Request) -> None:
        """One batched read for several flights; each flight lands as its object arrives
        (verified, written, committed on the trio thread), or fails alone."""
        blob = entry.blob
        left = {id(fl): (fl, positions, digest) for fl, positions, digest in group}
        try:
            async with self.slots.hold(req):
                t0 = time.perf_counter()
                prio = req.priority
                token = trio.lowlevel.current_trio_token()

                def land(w: FetchWriter, outcome: Exception | None) -> None:  # on the trio thread
                    item = left.pop(id(w), None)
                    if item is None:
                        return
                    _w, positions, digest = item
                    try:
                        if outcome is None:
                            self._fetched(w, prio, t0)
                    except Exception as e:  # noqa: BLE001 - the cache's commit: that chunk's failure
                        outcome = e
                    if outcome is not None:
                        w.abort(self._failed(blob, positions[0], digest, outcome))
                    self._land(w)

                lengths = [entry.cmap.chunks[positions[0]].length for _fl, positions, _d in group]
                async with self.decoding.hold(cost(lengths)):
                    await trio.to_thread.run_sync(self._load_many_and_write, entry, group, land, token,
                                                  abandon_on_cancel=True, limiter=self._threads)
        except Exception as e:
            for w, positions, digest in list(left.values()):
                left.pop(id(w))
                w.abort(self._failed(blob, positions[0], digest, e))
                self._land(w)
        finally:
            self._closed(req)
            for w, positions, _digest in list(left.values()):  # cancelled: the waiters retry
                w.abort(StoreUnavailable(f"blob {blob} chunk {positions[0]}: fetch cancelled"))
                self._land(w)

    def _load_many_and_write(self, entry: BlobEntry, group: list[tuple[FetchWriter, list[int], str]],
                             land: object, token: trio.lowlevel.TrioToken) -> None:
        """Worker thread: one `load_many` of the group's chunk objects; each is verified and
        decompressed (`chunkobj.decode`), checked against the chunk map's length and written at
        its positions as it arrives, then handed to `land` on the trio thread."""
        store, fmt = self.store, self.cache.chunk_format
        by_key = {store.chunk_key(digest): (fl, positions, digest) for fl, positions, digest in group}
        try:
            longest = max(entry.cmap.chunks[positions[0]].length for _fl, positions, _d in group)
            limit = min(MAX_OBJECT_SIZE["chunks"], chunkobj.max_object_size(longest))
            answers = store.load_many(list(by_key), max_size=limit)
            for key, value in answers:
                fl, positions, digest = by_key[key]
                outcome: Exception | None = None
                try:
                    if isinstance(value, Exception):
                        raise value
                    length = entry.cmap.chunks[positions[0]].length
                    payload = chunkobj.decode(value, digest, length)  # no longer than the map says
                    if len(payload) != length:
                        raise CorruptObject(f"chunk {digest} has {len(payload)} bytes, the chunk map says {length}")
                    fl.write(payload, fmt.frame_of(value))
                except LayerstoreError as e:
                    outcome = e
                trio.from_thread.run_sync(land, fl, outcome, trio_token=token)  # type: ignore[arg-type]
        except trio.RunFinishedError:
            return
        except LayerstoreError:
            raise
        except Exception as e:  # a backend's unexpected failure: the store is not answering properly
            raise _as_store_error(e) from None

    def _get_and_write(self, w: FetchWriter, digest: str, length: int) -> None:
        """Worker thread: the chunk from the store (verified), written at every position of the
        flight (`FetchWriter.write`)."""
        try:
            # As the cache's format keeps it: a zstd cache the store's verified frame, a plain one the payload.
            # no longer than the map says: a larger object is refused before it is decompressed
            payload, frame = self.cache.chunk_format.fetch(self.store, digest, length)
        except LayerstoreError:
            raise
        except Exception as e:  # a backend's unexpected failure: the store is not answering properly
            raise _as_store_error(e) from None
        if len(payload) != length:
            raise CorruptObject(f"chunk {digest} has {len(payload)} bytes, the chunk map says {length}")
        w.write(payload, frame)

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
        cache, present, blob = self.cache, entry.present, entry.blob
        todo = [i for i in range(start, stop) if not present[i] and cache.in_flight(blob, i) is None]
        if todo:
            self._nursery.start_soon(self.prefetch, entry, todo)

    def prefetch_soon(self, entry: BlobEntry, idxs: Sequence[int]) -> None:
        """`prefetch` in the background (its outcome is only logged)."""
        self._nursery.start_soon(self.prefetch, entry, idxs)

    async def prefetch(self, entry: BlobEntry, idxs: Sequence[int]) -> tuple[int, int]:
        """Fetch chunks in the given order below demand priority. Returns (done, failed).

        One prefetch token per store request: a batch of up to `batch` chunks where the backend
        reads in batches, else one chunk. A reader that needs one of these chunks meanwhile
        joins its flight (and raises it, with its whole request, to urgent)."""
        done = failed = 0
        size = self.batch if self._batching() else 1

        async def one(i: int) -> None:
            nonlocal done, failed
            try:
                await self._ensure_one(entry, i, PREFETCH, trio.current_time() + self.deadline)
                done += 1
            except LayerstoreError as e:
                failed += 1
                log.debug("prefetch of blob %s chunk %d failed: %s", entry.blob, i, e)

        async def request(group: list[int], token: object) -> None:
            try:
                if len(group) == 1:  # one chunk a request (a store that does not read in batches)
                    await one(group[0])
                    return
                async with trio.open_nursery() as inner:
                    for i in group:
                        inner.start_soon(one, i)
            finally:
                self.prefetch_tokens.release_on_behalf_of(token)

        todo = [i for i in idxs if not entry.present[i]]
        async with trio.open_nursery() as nursery:
            k = 0
            while k < len(todo):
                token = object()
                await self.prefetch_tokens.acquire_on_behalf_of(token)
                # What is still missing once a token is free: earlier requests may have fetched
                # some of it (repeated digests), readers others.
                group: list[int] = []
                while k < len(todo) and len(group) < size:
                    if not entry.present[todo[k]]:
                        group.append(todo[k])
                    k += 1
                if not group:
                    self.prefetch_tokens.release_on_behalf_of(token)
                    continue
                self._launch(entry, group, PREFETCH)
                nursery.start_soon(request, group, token)
        return done, failed


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
