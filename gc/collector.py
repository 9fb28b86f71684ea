"""One collection run: retention, list, mark, publish candidates, re-mark, sweep (docs/gc.md).

The phases, and what the store holds after each (what a kill -9 there leaves):

1. `gc/runs/<run>` written, state "marking" (never binds anyone; expires on its own).
2. Retention: tags the policy removes are deleted (a tag moved meanwhile is left alone).
3. List every chunk, chunk map and manifest with its size and store-clock time.
4. Mark from the roots: every tag (signature tags included), live leases (pushes, commits,
   nodes' mounted layers, operators), and chunk maps and manifests younger than the grace.
5. Candidates: listed, unmarked, and older than the grace period by the store's clock.
6. `gc/candidates/<run>` written (create-once), then the run's state set to "sweeping": from here
   on a writer that relies on a candidate waits until the run is over (`layerstore.leases`).
7. Re-read, in this order: leases, chunk maps and manifests written since 3, tags; mark from
   what is new: what a writer held, wrote or tagged while 3-6 ran is rescued.
8. Delete what is left, manifests first, then chunk maps, then chunks (so a present chunk map
   never names a missing chunk), in batches, each only while the run's record is fresh.
9. Housekeeping: expired leases, dead runs, old history, signature tags of deleted manifests,
   stale temporaries.
10. The record moves to `gc/history/<run>`; the report goes to `gc/last-report`.

Report phases: retention (2), list (3), mark (4-5), recheck (6-7), sweep (8), housekeeping (9).
A dry run does 2-5 (and the re-read) without writing anything and reports what would go.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future

from layerstore import digest as digestmod
from layerstore import keys, leases
from layerstore.backends import ObjectInfo
from layerstore.errors import LayerstoreError, NotFound, StoreUnavailable
from layerstore.store import Store

from .mark import Marker
from .report import Count, Report, write_report
from .retention import RetentionPolicy, TagInfo

log = logging.getLogger(__name__)

RUN_TTL = 120.0  # seconds a run record lives without renewal (renewed every third of it)
DELETE_BATCH = 1000
KEEP_RUNS = 20  # finished runs kept in the history
HISTORY = "gc/history/"
TEMPORARIES_SWEPT = "gc/temporaries-swept"
TEMPORARIES_EVERY = 86400.0  # seconds between two sweeps of a POSIX store's stale temporaries
CONTENT = ("manifests/", "blobs/", "chunks/")

Progress = Callable[[str, int, int | None], None]


class RunLost(StoreUnavailable):
    """The collector could not keep its run record fresh: it stops deleting (writers may have
    stopped waiting for it)."""


class _Run:
    """The run record and its heartbeat."""

    def __init__(self, store: Store, run_id: str, ttl: float) -> None:
        self.store, self.id, self.ttl = store, run_id, ttl
        self.started = time.time()
        self.state = "marking"
        self._renewed = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="gc-run", daemon=True)

    def write(self, state: str | None = None) -> None:
        with self._lock:
            if state is not None:
                self.state = state
            started = time.monotonic()
            body = {"state": self.state, "started": self.started, "expires": time.time() + self.ttl,
                    "holder": f"{socket.gethostname()}:{threading.get_native_id()}"}
            self.store.backend.replace(leases.run_key(self.id), json.dumps(body, sort_keys=True).encode())
            self._renewed = started

    def start(self) -> None:
        self.write()
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                self.write()
            except LayerstoreError as e:
                log.warning("gc run %s: heartbeat failed: %s", self.id, e)

    def check_fresh(self) -> None:
        """Raise `RunLost` unless every writer still sees this run as live."""
        if time.monotonic() - self._renewed > self.ttl - leases.SKEW:
            try:
                self.write()
            except LayerstoreError as e:
                raise RunLost(f"gc run {self.id}: its record is stale and cannot be renewed ({e}); "
                              "stopped before deleting more") from None

    def stop(self, state: str) -> None:
        """Stop the heartbeat; keep the record in the history and take it out of `gc/runs/`,
        which writers read on every protect and so holds only runs in progress."""
        self._stop.set()
        self._thread.join(timeout=5)
        with self._lock:
            self.state = state
            body = {"state": state, "started": self.started, "finished": time.time()}
        try:
            self.store.backend.replace(history_key(self.id), json.dumps(body, sort_keys=True).encode())
            self.store.backend.delete_many([leases.run_key(self.id), leases.candidates_key(self.id)])
        except LayerstoreError as e:
            log.warning("gc run %s: could not close its record (%s); it expires on its own", self.id, e)


def history_key(run_id: str) -> str:
    return keys.validate(f"{HISTORY}{run_id}")


def collect(store: Store, *, grace: float = 3600.0, dry_run: bool = False, policy: RetentionPolicy | None = None,
            progress: Progress | None = None, run_ttl: float = RUN_TTL) -> Report:
    """Run one collection on `store` (see the module docstring); returns its report. `run_ttl`:
    how long writers wait for this run if it dies mid-sweep (plus `leases.SKEW`)."""
    if grace < 0 or run_ttl <= 0:
        raise ValueError("negative grace or run time to live")
    report = Report(run=leases.new_id("gc"), dry_run=dry_run, grace=grace, started=time.time())
    tick = progress or (lambda phase, done, total: None)
    run = None if dry_run else _Run(store, report.run, run_ttl)
    state = "aborted"
    try:
        if run is not None:
            run.start()
        now = _store_now(store, run)
        with report.phase("retention"):
            if policy is not None:
                report.tags_removed = _apply_retention(store, policy, now, dry_run)
        with report.phase("list"):
            listing = _list_content(store, tick)
        report.listed = Count.of(listing.values())
        marker = Marker(store, lambda n: tick("mark", n, None))
        cutoff = now - grace
        with report.phase("mark"):
            lease_roots, tag_roots = _roots(store, now)
            marker.mark(tag_roots)
            from_leases = marker.mark(lease_roots)
            # A young chunk map or manifest keeps what it names: its writer may reference it
            # next (a layer pushed now, its environment created later).
            from_young = marker.mark(_young(listing.values(), cutoff))
        unmarked = [info for key, info in listing.items() if key not in marker.marked]
        candidates = {i.key: i for i in unmarked if i.mtime < cutoff}
        with report.phase("recheck"):
            if run is not None and candidates:
                store.backend.store_once(leases.candidates_key(run.id), leases.encode_candidates(candidates))
                run.write("sweeping")
            # Re-read, in this order: leases, then chunk maps and manifests written since the
            # listing, then tags. What a writer held, wrote or tagged meanwhile is rescued.
            lease_roots2 = _held(store, time.time())
            fresh = [i for i in _list_content(store, tick, CONTENT[:2]).values()
                     if i.key not in listing or i.mtime >= cutoff]
            tag_roots2 = _tagged(store)
            rescued = marker.mark(lease_roots2) | marker.mark(i.key for i in fresh) | marker.mark(tag_roots2)
            doomed = {k: i for k, i in candidates.items() if k not in marker.marked}
            report.rescued = Count.of(candidates[k] for k in rescued if k in candidates)
            report.marked = Count.of(listing[k] for k in marker.marked if k in listing)
            report.kept_lease = Count.of(listing[k] for k in from_leases if k in listing)
            report.kept_grace = Count.of([*(listing[k] for k in from_young if k in listing),
                                          *(i for i in unmarked if i.mtime >= cutoff)])
            report.missing = sorted(marker.missing)[:100]
            report.missing_count = len(marker.missing)
            report.unreadable = sorted(marker.unreadable)[:100]
        with report.phase("sweep"):
            if dry_run:
                report.deleted = Count.of(doomed.values())
            else:
                assert run is not None
                report.deleted = _sweep(store, run, doomed, tick)
        if run is not None:
            with report.phase("housekeeping"):
                report.housekeeping = _housekeeping(store, run, set(doomed))
        state = "done"
        return report
    finally:
        report.finished = time.time()
        if run is not None:
            run.stop(state)
            if state == "done":
                write_report(store, report)


def _store_now(store: Store, run: _Run | None) -> float:
    """Now, on the store's clock: the time the store gave our run record."""
    if run is None:
        return time.time()
    for info in store.backend.list_info(leases.run_key(run.id)):
        if info.key == leases.run_key(run.id):
            return info.mtime
    return time.time()


def _list_content(store: Store, tick: Progress, prefixes: tuple[str, ...] = CONTENT) -> dict[str, ObjectInfo]:
    out: dict[str, ObjectInfo] = {}
    for prefix in prefixes:
        for info in store.backend.list_info(prefix):
            try:
                keys.digest_of_key(info.key)
            except LayerstoreError:
                continue  # not content (nothing of ours lives there otherwise): left alone
            out[info.key] = info
            if len(out) % 5000 == 0:
                tick("list", len(out), None)
    tick("list", len(out), len(out))
    return out


def _young(infos: Iterable[ObjectInfo], cutoff: float) -> set[str]:
    return {i.key for i in infos if i.mtime >= cutoff and not i.key.startswith("chunks/")}


def _roots(store: Store, now: float) -> tuple[set[str], set[str]]:
    """(keys held by live leases, manifests named by tags): leases are read first."""
    held = _held(store, now)
    return held, _tagged(store)


def _held(store: Store, now: float) -> set[str]:
    held: set[str] = set()
    for lease in leases.read_leases(store.backend):
        if lease.live(now):
            held |= lease.keys
    return held


def _tagged(store: Store) -> set[str]:
    return {keys.object_key("manifests", tag.manifest) for tag in _read_tags(store)}


def _read_tags(store: Store) -> list[TagInfo]:
    infos = list(store.backend.list_info("tags/"))
    futures: list[tuple[ObjectInfo, Future[str]]] = [
        (i, store.pool.submit(store.get_tag, keys.tag_of_key(i.key))) for i in infos
    ]
    out = []
    for info, fut in futures:
        try:
            out.append(TagInfo(keys.tag_of_key(info.key), fut.result(), info.mtime))
        except NotFound:
            continue  # removed meanwhile
        except LayerstoreError as e:
            log.warning("tag %s: unreadable (%s); it keeps nothing", info.key, e)
    return out


def _apply_retention(store: Store, policy: RetentionPolicy, now: float, dry_run: bool) -> list[str]:
    removed = []
    for tag in policy.to_remove(_read_tags(store), now):
        if dry_run:
            removed.append(tag.ref)
            continue
        # Only if it still names what the policy judged: a tag moved meanwhile is a new tag.
        try:
            if store.get_tag(tag.ref) != tag.manifest:
                continue
            store.delete_tag(tag.ref)
        except NotFound:
            continue
        removed.append(tag.ref)
    return removed


def _sweep(store: Store, run: _Run, doomed: dict[str, ObjectInfo], tick: Progress) -> Count:
    deleted = Count()
    done = 0
    for prefix in CONTENT:  # manifests, then chunk maps, then chunks
        batch = sorted(k for k in doomed if k.startswith(prefix))
        for i in range(0, len(batch), DELETE_BATCH):
            part = batch[i : i + DELETE_BATCH]
            run.check_fresh()
            store.backend.delete_many(part)
            for k in part:
                deleted.add(doomed[k])
            done += len(part)
            tick("sweep", done, len(doomed))
    return deleted


def _housekeeping(store: Store, run: _Run, deleted: set[str]) -> dict[str, int]:
    """Remove what binds nobody any more. Nothing here can make a reachable object go."""
    backend = store.backend
    now = time.time()
    stats = {"leases": 0, "runs": 0, "signature_tags": 0, "temporaries": 0}
    for lease in leases.read_leases(backend):
        if now > lease.expires + 2 * leases.SKEW:
            stats["leases"] += backend.delete_many(leases.lease_keys(backend, lease.id))
    # Shards whose head is gone (a holder that died while releasing).
    heads = {k.rpartition("/")[0] for k in backend.list(leases.LEASES) if k.endswith("/head")}
    orphans = [i.key for i in backend.list_info(leases.LEASES)
               if i.key.rpartition("/")[0] not in heads and now - i.mtime > 2 * leases.SKEW]
    stats["leases"] += backend.delete_many(orphans)
    # Runs that died: past their expiry they bind nobody; their records and candidates go.
    for dead in leases.read_runs(backend):
        if dead.id != run.id and now > dead.expires + 2 * leases.SKEW:
            stats["runs"] += backend.delete_many([leases.run_key(dead.id), leases.candidates_key(dead.id)])
    history = sorted(backend.list_info(HISTORY), key=lambda i: i.mtime, reverse=True)
    stats["runs"] += backend.delete_many(i.key for i in history[KEEP_RUNS:])
    # Signature tags of manifests this run deleted: they sign nothing any more (their signature
    # objects go in a later run). One re-signed meanwhile is kept: its manifest is back.
    gone = {digestmod.hex_of(keys.digest_of_key(k)[1]) for k in deleted if k.startswith("manifests/")}
    for key in list(backend.list("tags/sig/")) if gone else ():
        signed = key[len("tags/sig/"):].partition(":")[0]
        if signed in gone and not backend.exists(keys.object_key("manifests", digestmod.from_hex(signed))):
            try:
                backend.delete(key)
                stats["signature_tags"] += 1
            except NotFound:
                continue
    # Temporaries are left only by writers that died, and finding them walks the whole store:
    # once a day is enough (the marker's store time says when the last sweep was).
    sweep_temporaries = getattr(backend, "sweep_temporaries", None)
    if sweep_temporaries is not None:
        last = [i.mtime for i in backend.list_info(TEMPORARIES_SWEPT) if i.key == TEMPORARIES_SWEPT]
        if not last or now - last[0] > TEMPORARIES_EVERY:
            stats["temporaries"] = sweep_temporaries(older_than=3600.0)
            backend.replace(TEMPORARIES_SWEPT, str(now).encode())
    return stats
