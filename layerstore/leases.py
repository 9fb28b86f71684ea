"""Leases, and the sweeps a collector publishes: the writer's half of the protocol that keeps
garbage collection safe while others push, tag and mount (the whole argument is in docs/gc.md).

A *lease* names objects its holder is about to reference (a push, a commit, a node's mounted
layers, an operator's hold). Layout, under the store's keys:

    leases/<id>/head            JSON: kind, name, holder, created, expires, keys, layers (mutable)
    leases/<id>/s<seq>          JSON list of object keys held since (create-once shards, appended)
    leases/<id>/r<seq>          a node's figures for the status page (holds nothing; docs/status-page.md)

A collector that is about to delete publishes its candidates first:

    gc/runs/<run>               JSON: state (marking | sweeping | done | aborted), expires, ...
    gc/candidates/<run>         zstd of the newline-joined candidate keys (create-once)

The writer's rule, `protect(keys)`, for every object it is about to rely on without writing it
(a deduplicated chunk, a layer a manifest names, a manifest a tag points at): first *hold* the
keys in its lease (durably), then read the live sweeps; if one of them has any of the keys among
its candidates, wait until that sweep is over; only then check that the objects exist (and
write those that do not). The collector re-reads every lease after publishing its candidates and
deletes none that a lease holds. Either the collector's re-read sees the hold, or the writer's
read of the sweeps sees the candidates: whichever comes second in the store's (strongly
consistent) order sees the other. Leases expire: a holder renews its lease every third of its
time to live and refuses to go on (`StoreUnavailable`) once a renewal is overdue, since a
collector may then have ignored it. Clocks of hosts must agree within `SKEW` seconds.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, field
from functools import lru_cache

import zstandard

from .backends import Backend
from .errors import BadInput, CorruptObject, LayerstoreError, NotFound, StoreUnavailable
from .keys import validate

log = logging.getLogger(__name__)

LEASES = "leases/"
RUNS = "gc/runs/"
CANDIDATES = "gc/candidates/"
DEFAULT_TTL = 600.0  # seconds a lease lives without renewal
PUSH_KEPT = "push-kept"  # id prefix of the leases `build --push` leaves behind (docs/gc.md)
KEEP_TTL = 3600.0  # how long such a lease keeps a push's layers when nothing releases it
SKEW = 60.0  # how far the clocks of two hosts may disagree (seconds); see docs/gc.md
MAX_HEAD = 4 << 20  # a lease head (its inline keys included)
MAX_SHARD = 4 << 20
MAX_RUN = 64 << 10
MAX_CANDIDATES = 256 << 20  # compressed
POLL_FIRST, POLL_CAP = 0.002, 0.5  # seconds between looks at a sweep a writer waits for (doubling)


def new_id(prefix: str) -> str:
    """A unique, key-safe id: `prefix-<utc time>-<host>-<pid>-<random>`."""
    host = "".join(c if c.isalnum() or c in "-_." else "-" for c in socket.gethostname())[:40] or "host"
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    return validate(f"{prefix}-{stamp}-{host}-{os.getpid()}-{secrets.token_hex(4)}")


def head_key(lease_id: str) -> str:
    return validate(f"{LEASES}{lease_id}/head")


_SHARD_LEAF = re.compile(r"s[0-9]{8,}")


def _shard_key(lease_id: str, seq: int) -> str:
    return validate(f"{LEASES}{lease_id}/s{seq:08d}")


def run_key(run_id: str) -> str:
    return validate(f"{RUNS}{run_id}")


def candidates_key(run_id: str) -> str:
    return validate(f"{CANDIDATES}{run_id}")


def _dump(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _load_json(backend: Backend, key: str, max_size: int) -> object:
    raw = backend.load(key, max_size=max_size)
    try:
        return json.loads(raw)
    except ValueError:
        raise CorruptObject(f"{key}: not JSON") from None


# -- leases ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LeaseInfo:
    """A lease as a collector (or `layerctl lease ls`) reads it."""

    id: str
    kind: str
    name: str
    holder: str
    created: float
    expires: float
    keys: frozenset[str] = field(repr=False, default=frozenset())
    layers: frozenset[str] = frozenset()  # blob digests a kept push made (`Lease.keep`)

    def live(self, now: float) -> bool:
        """Still binding for a collector at `now` (its own clock): until SKEW past the expiry."""
        return now < self.expires + SKEW

    def to_json(self) -> dict[str, object]:
        return {"id": self.id, "kind": self.kind, "name": self.name, "holder": self.holder,
                "created": self.created, "expires": self.expires, "objects": len(self.keys)}


class Lease:
    """A held lease. `renew=True` keeps it alive from a background thread until `release`."""

    def __init__(self, backend: Backend, *, kind: str, name: str = "", lease_id: str | None = None,
                 ttl: float = DEFAULT_TTL, renew: bool = True) -> None:
        if ttl <= 0 or (renew and ttl < 2 * SKEW):
            raise BadInput(f"a lease time to live of {ttl} s is too short" + (f" (at least {2 * SKEW:.0f} s for a "
                                                                              "renewed lease)" if renew else ""))
        self.backend = backend
        self.id = validate(lease_id or new_id(kind))
        self.kind, self.name, self.ttl = kind, name or self.id, ttl
        self.holder = f"{socket.gethostname()}:{os.getpid()}"
        self.created = time.time()
        self._inline: frozenset[str] = frozenset()
        self._layers: tuple[str, ...] = ()
        self._held: set[str] = set()  # every key held so far, inline or in a shard
        self._shards: list[str] = []
        self._seq = 0  # shard numbers only go up: a rotation never reuses one
        self._lock = threading.Lock()
        self._renewed = 0.0  # time.monotonic() of the last head write that landed
        self._released = threading.Event()
        self._renew = renew
        self._thread: threading.Thread | None = None

    # the head ------------------------------------------------------------------------------
    def _write_head(self, ttl: float | None = None) -> None:
        started = time.monotonic()
        body: dict[str, object] = {"kind": self.kind, "name": self.name, "holder": self.holder,
                                   "created": self.created, "expires": time.time() + (ttl or self.ttl),
                                   "keys": sorted(self._inline)}
        if self._layers:
            body["layers"] = list(self._layers)
        self.backend.replace(head_key(self.id), _dump(body))
        self._renewed = started

    def open(self, keys: Iterable[str] = ()) -> Lease:
        """Write the lease (with `keys` held inline) and start renewing it."""
        with self._lock:
            self._inline = frozenset(validate(k) for k in keys)
            self._write_head()
            self._held |= self._inline
        if self._renew and self._thread is None:
            self._thread = threading.Thread(target=self._renewer, name=f"lease-{self.kind}", daemon=True)
            self._thread.start()
        return self

    def _renewer(self) -> None:
        while not self._released.wait(self.ttl / 3):
            try:
                with self._lock:
                    if not self._released.is_set():
                        self._write_head()
            except LayerstoreError as e:  # tried again at the next tick; `check` refuses meanwhile
                log.warning("lease %s: renewal failed: %s", self.id, e)

    def check(self) -> None:
        """Raise unless the lease is certainly still binding for every collector."""
        if self._released.is_set():
            raise StoreUnavailable(f"lease {self.id} was released")
        if time.monotonic() - self._renewed > self.ttl - SKEW:
            with self._lock:
                try:
                    self._write_head()
                except LayerstoreError as e:
                    raise StoreUnavailable(f"lease {self.id} could not be renewed: {e}") from None

    # holding -------------------------------------------------------------------------------
    def hold(self, keys: Collection[str]) -> list[str]:
        """Durably add `keys` to the lease (a new create-once shard); returns those it did not
        hold already."""
        self.check()
        with self._lock:
            new = sorted({validate(k) for k in keys} - self._held)
            if not new:
                return []
            key = _shard_key(self.id, self._seq)
            self._seq += 1
            self._shards.append(key)
        if not self.backend.store_once(key, _dump(new)):
            raise StoreUnavailable(f"lease {self.id}: shard {key} exists already (two holders of one lease?)")
        # A hold is binding only if the lease was alive when it landed and still is now.
        self.check()
        with self._lock:
            self._held.update(new)
        return new

    def replace_keys(self, keys: Iterable[str]) -> None:
        """Hold exactly `keys` from now on (a node's in-use set): the new set is written first,
        then the old shards go (all under the lock, so no hold lands in a shard being deleted)."""
        with self._lock:
            self._inline = frozenset(validate(k) for k in keys)
            self._write_head()
            old, self._shards = self._shards, []
            self._held = set(self._inline)
            self.backend.delete_many(old)

    def keep(self, ttl: float, layers: Iterable[str] = ()) -> float:
        """Stop renewing, but leave the lease (every key held so far) in the store until `ttl`
        seconds from now, naming the blob digests `layers` it was kept for: what a push does so
        that its layers outlive its process until an environment names them (`release_kept`).
        Returns the new expiry. After this the handle binds nothing (it is released)."""
        if ttl <= 0:
            raise BadInput(f"a lease time to live of {ttl} s is too short")
        self.check()  # every hold so far is still binding: the new head extends them all
        self._released.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            self._layers = tuple(sorted(set(layers)))
            self._write_head(ttl)
            self._shards = []  # no longer ours to delete: they expire with the head
        return time.time() + ttl

    def release(self) -> None:
        """Delete the lease (head first: shards without a head bind nothing)."""
        if self._released.is_set():
            return
        self._released.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            shards, self._shards = self._shards, []
        try:
            self.backend.delete_many([head_key(self.id), *shards])
        except LayerstoreError as e:  # it expires on its own
            log.warning("lease %s: could not delete it (%s); it expires on its own", self.id, e)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def read_leases(backend: Backend, id_prefix: str = "") -> Iterator[LeaseInfo]:
    """Every lease in the store whose id starts with `id_prefix`, live or not, with every key it
    holds (head and shards). A
    lease whose head is gone (being released) holds nothing; a malformed head is skipped with
    a warning (a lease cannot be trusted to protect anything it cannot say); a store that cannot
    be read raises `StoreUnavailable` (a lease missed for that reason could hold anything)."""
    groups: dict[str, list[str]] = {}
    for key in backend.list(LEASES + id_prefix):
        lease_id, _, leaf = key[len(LEASES):].partition("/")
        groups.setdefault(lease_id, []).append(leaf)
    for lease_id, leaves in sorted(groups.items()):
        if "head" not in leaves:
            continue
        try:
            info = _read_lease(backend, lease_id, leaves)
        except StoreUnavailable:
            raise  # a lease we could not read may hold anything: the caller (gc) must not go on
        except (LayerstoreError, KeyError, TypeError, ValueError) as e:
            log.warning("lease %s: unreadable (%s); ignored", lease_id, e)
            continue
        if info is not None:
            yield info


SHARD_RACE_RETRIES = 5


def _read_lease(backend: Backend, lease_id: str, leaves: Collection[str]) -> LeaseInfo | None:
    """One lease from its head and the shard leaves listed; None once its head is gone (released).
    A listed shard that is gone by the time it is read was dropped by a rotation (`replace_keys`),
    which writes the new head before it deletes old shards: the lease is read again from a fresh
    listing, never skipped, since a skipped live lease would leave its keys to the collector."""
    for _ in range(SHARD_RACE_RETRIES):
        try:
            head = _load_json(backend, head_key(lease_id), MAX_HEAD)
        except NotFound:
            return None  # released while we read it
        if not isinstance(head, dict):
            raise CorruptObject("not an object")
        held = set(map(str, head.get("keys", ())))
        try:
            for leaf in sorted(leaves):
                if _SHARD_LEAF.fullmatch(leaf):  # (other leaves hold nothing: a node's figures record)
                    shard = _load_json(backend, f"{LEASES}{lease_id}/{leaf}", MAX_SHARD)
                    held.update(map(str, shard if isinstance(shard, list) else ()))
        except NotFound:
            leaves = [k.rpartition("/")[2] for k in lease_keys(backend, lease_id)]
            continue
        return LeaseInfo(lease_id, str(head.get("kind", "")), str(head.get("name", lease_id)),
                         str(head.get("holder", "")), float(head.get("created", 0)), float(head["expires"]),
                         frozenset(held), frozenset(map(str, head.get("layers", ()))))
    raise StoreUnavailable(f"its shards changed under {SHARD_RACE_RETRIES} reads in a row")


def lease_keys(backend: Backend, lease_id: str) -> list[str]:
    """Every object key of one lease (head and shards): what releasing it deletes."""
    return list(backend.list(f"{LEASES}{validate(lease_id)}/"))


def release_kept(backend: Backend, named: Collection[str]) -> list[str]:
    """Release every lease a push kept (`Lease.keep`) whose layers are all among the blob
    digests `named`: call it only once something durable (an environment's tag) names them,
    since from then on that root keeps them. Returns the released ids; one that cannot be
    deleted is left to expire (a warning)."""
    released = []
    for info in read_leases(backend, PUSH_KEPT + "-"):
        if not info.layers or not info.layers <= set(named):
            continue
        try:
            head = head_key(info.id)  # first: shards without a head bind nothing
            backend.delete_many([head, *(k for k in lease_keys(backend, info.id) if k != head)])
        except LayerstoreError as e:
            log.warning("lease %s: could not release it (%s); it expires on its own", info.id, e)
            continue
        released.append(info.id)
    return released


# -- sweeps ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunInfo:
    id: str
    state: str
    started: float
    expires: float
    holder: str

    def sweeping(self, now: float) -> bool:
        """May this run still delete objects (by `now`, the reader's clock)?"""
        return self.state == "sweeping" and now < self.expires + SKEW


def read_runs(backend: Backend) -> Iterator[RunInfo]:
    for key in backend.list(RUNS):
        run_id = key[len(RUNS):]
        try:
            run = _load_json(backend, key, MAX_RUN)
            if not isinstance(run, dict):
                raise CorruptObject("not an object")
            yield RunInfo(run_id, str(run["state"]), float(run["started"]), float(run["expires"]),
                          str(run.get("holder", "")))
        except NotFound:
            continue
        except (LayerstoreError, KeyError, TypeError, ValueError) as e:
            # A run record nobody can read could be a sweep: treat it as one until it is old.
            log.warning("gc run %s: unreadable (%s)", run_id, e)
            yield RunInfo(run_id, "sweeping", 0.0, 0.0, "")


def encode_candidates(keys: Iterable[str]) -> bytes:
    return zstandard.ZstdCompressor(level=3).compress("\n".join(sorted(keys)).encode())


@lru_cache(maxsize=8)
def _candidates_cached(backend: Backend, run_id: str) -> frozenset[str]:
    raw = backend.load(candidates_key(run_id), max_size=MAX_CANDIDATES)
    try:
        text = zstandard.ZstdDecompressor().decompress(raw, max_output_size=16 * MAX_CANDIDATES).decode()
    except (zstandard.ZstdError, UnicodeDecodeError):
        raise CorruptObject(f"gc run {run_id}: candidate list unreadable") from None
    return frozenset(filter(None, text.split("\n")))


def load_candidates(backend: Backend, run_id: str) -> frozenset[str]:
    """A run's candidates (immutable once written, so cached)."""
    return _candidates_cached(backend, run_id)


def conflicting_sweeps(backend: Backend, keys: Collection[str]) -> list[RunInfo]:
    """The live sweeps that have any of `keys` among their candidates."""
    now = time.time()
    out = []
    for run in read_runs(backend):
        if not run.sweeping(now):
            continue
        try:
            candidates = load_candidates(backend, run.id)
        except NotFound:
            candidates = None  # a sweeping run always wrote its candidates first: be safe
        except CorruptObject:
            candidates = None
        if candidates is None or not candidates.isdisjoint(keys):
            out.append(run)
    return out


def wait_out(backend: Backend, runs: Collection[RunInfo], deadline: float | None = None) -> None:
    """Wait until none of `runs` can delete anything any more (done, aborted, gone or expired)."""
    pending = {r.id for r in runs}
    pause = POLL_FIRST
    while pending:
        now = time.time()
        current = {r.id: r for r in read_runs(backend)}
        pending = {i for i in pending if i in current and current[i].sweeping(now)}
        if not pending:
            return
        if deadline is not None and time.monotonic() > deadline:
            raise StoreUnavailable(f"gc run(s) {sorted(pending)} still sweeping objects this write needs")
        time.sleep(pause)
        pause = min(pause * 2, POLL_CAP)


def protect(lease: Lease, keys: Collection[str], deadline: float | None = None) -> None:
    """The writer's rule (module docstring): hold `keys`, then wait out every live sweep that
    may delete one of them. Afterwards, an existence check of these keys stays true for as long
    as the lease lives. Keys the lease held already need nothing more: a sweep that published
    its candidates after their hold re-reads the lease, one that published before was waited
    out then."""
    new = lease.hold(keys)
    if not new:
        return  # held before, and checked against the sweeps then: still binding (`hold` checked the lease)
    runs = conflicting_sweeps(lease.backend, new)
    if runs:
        log.info("waiting for gc run(s) %s to end before relying on %d object(s)", [r.id for r in runs], len(keys))
        wait_out(lease.backend, runs, deadline)
