"""The snapshots service's logic (containerd's snapshotter contract), without the gRPC edge.

A snapshot is a record (`metadata`) plus, for a local one, the directory SNAP/snapshots/<id>/
(`fs/`: the bytes; `work/`: overlayfs's work directory), or, for a remote layer, the blob's EROFS
mount (`layers`). Directories are made before the transaction that records them and deleted after
the one that forgets them; layer mounts likewise. `reconcile` (every start, and `cleanup`) deletes
what a crash left unrecorded; docs/snapshotter.md has the table of crash points.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import signal
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from layerstore import digest as digestmod
from layerstore.errors import BadInput
from runtime_shim.nodestate.paths import check_overlay_safe

from . import filters as filtermod
from .cri import CriPointers
from .errors import SnapshotExists, SnapshotNotFound, SnapshotPrecondition, SnapshotterBusy
from .layers import RemoteLayers
from .metadata import ACTIVE, COMMITTED, VIEW, Metadata, Snapshot, Txn
from .sweeper import Sweeper

# Labels containerd passes to a proxy (it forwards only `containerd.io/snapshot.ref` and labels
# under `containerd.io/snapshot/`): the target name of a layer being unpacked, and our blob.
LABEL_REF = "containerd.io/snapshot.ref"
LABEL_BLOB = "containerd.io/snapshot/layerstore.blob"
LABEL_ENV = "containerd.io/snapshot/layerstore.environment"  # the manifest digest the blob came with
REMOTE_PREFIX = "layerstore/"  # names of remote layer snapshots: layerstore/<target>
CRASH_ENV = "LAYERSTORE_SNAPSHOTTER_CRASH"  # tests: die (SIGKILL) at the named step
PREHOLD_TTL = 120.0  # seconds a layer held ahead of its Prepare stays held without a record
PREHOLD_JOIN = 30.0  # seconds `close` waits for holds taken ahead
AHEAD_PARALLEL = 4  # layers held ahead at once (an image of 30 layers must not start 30 cold mounts together)
log = logging.getLogger("layerstore.snapshotter")


def crashpoint(step: str) -> None:
    if os.environ.get(CRASH_ENV) == step:
        os.kill(os.getpid(), signal.SIGKILL)


@dataclass(frozen=True)
class Mount:
    type: str
    source: str
    options: tuple[str, ...] = ()


@dataclass
class CleanupReport:
    directories: list[str] = field(default_factory=list)
    layer_mounts: list[str] = field(default_factory=list)  # holds released (and an earlier version's mounts)


def usage(path: str | os.PathLike[str]) -> tuple[int, int]:
    """(bytes allocated, inodes) under `path`, hard links counted once, not crossing mounts."""
    seen: set[tuple[int, int]] = set()
    size = 0
    try:
        top = os.lstat(path)
    except FileNotFoundError:
        return 0, 0
    stack = [os.fspath(path)]
    while stack:
        d = stack.pop()
        try:
            entries = list(os.scandir(d))
        except OSError:
            continue
        for e in entries:
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if st.st_dev != top.st_dev:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                size += st.st_blocks * 512
            if e.is_dir(follow_symlinks=False):
                stack.append(e.path)
    return size, len(seen)


class Snapshotter:
    """One snapshot root. `layers`: where remote layers are mounted from (None: remote layers are
    refused, every layer is local); `cri`: tells the layerstore pointers among the layers
    containerd's CRI plugin prepares. Thread-safe: calls are serialised."""

    def __init__(self, root: str | os.PathLike[str], layers: RemoteLayers | None = None,
                 cri: CriPointers | None = None) -> None:
        self.root = Path(os.path.abspath(root))
        check_overlay_safe(self.root, "snapshotter root")  # (its paths go into overlay options)
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.snapshots = self.root / "snapshots"
        self.snapshots.mkdir(mode=0o700, exist_ok=True)
        self._lock_fd = os.open(self.root / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise SnapshotterBusy(f"another snapshotter serves {self.root}") from None
        self.meta = Metadata(self.root / "metadata")
        self.layers = layers
        self.cri = cri if cri is not None else CriPointers()  # (layers the CRI plugin pulls: which are pointers)
        self.mu = threading.RLock()  # every record change; never held while a layer is mounted
        self._blob_mu = threading.Lock()
        self._blob_locks: dict[str, threading.Lock] = {}
        self._ahead: dict[str, float] = {}  # blob -> deadline: held ahead of its Prepare, not recorded yet
        self._ahead_threads: set[threading.Thread] = set()
        self._ahead_slots = threading.BoundedSemaphore(AHEAD_PARALLEL)
        self._sweeper = Sweeper(self._ahead_now, self._expire_ahead, time.monotonic, "snapshotter-ahead-sweep")
        self.last_reconcile = self.reconcile()
        if layers is not None:  # (else the first Prepare pays for the registry client and the store's)
            threading.Thread(target=self._prewarm, name="snapshotter-prewarm", daemon=True).start()

    def _prewarm(self) -> None:
        assert self.layers is not None
        with contextlib.suppress(Exception):  # (an optimisation: the first Prepare reports what fails)
            self.cri.prewarm()
            self.layers.prewarm()

    def close(self) -> None:
        deadline = time.monotonic() + PREHOLD_JOIN
        with self._blob_mu:
            threads = list(self._ahead_threads)
        for th in threads:  # (holds taken ahead: finished before the shim closes)
            th.join(max(0.0, deadline - time.monotonic()))
        self._sweeper.close()
        with self.mu:
            self.meta.close()
            if self.layers is not None:
                self.layers.close()
            self.cri.close()
            os.close(self._lock_fd)

    # -- paths ---------------------------------------------------------------------------------
    def dir(self, snap: Snapshot) -> Path:
        return self.snapshots / str(snap.id)

    def fs(self, snap: Snapshot) -> str:
        """The directory a child stacks (or a client mounts): a remote layer's mount point."""
        if snap.blob:
            assert self.layers is not None
            return self.layers.mountpoint(snap.blob)
        return str(self.dir(snap) / "fs")

    # -- create ----------------------------------------------------------------------------------
    def prepare(self, key: str, parent: str = "", labels: dict[str, str] | None = None) -> list[Mount]:
        labels = dict(labels or {})
        if labels.get(LABEL_REF) and not labels.get(LABEL_BLOB) and self.layers is not None:
            labels.update(self._cri_labels(labels))  # (outside every lock: may read a manifest)
        if labels.get(LABEL_REF) and labels.get(LABEL_BLOB):
            self._prepare_remote(key, parent, labels)  # raises SnapshotExists once it exists
        return self._create(ACTIVE, key, parent, labels)

    def _cri_labels(self, labels: dict[str, str]) -> dict[str, str]:
        """A layer the CRI plugin pulls: our remote-layer labels if it is a layerstore pointer."""
        pointer = self.cri.lookup(labels)
        if pointer is None or not pointer.blob:
            return {}
        out = {LABEL_BLOB: pointer.blob}
        if pointer.environment:
            out[LABEL_ENV] = pointer.environment
        return out

    def view(self, key: str, parent: str = "", labels: dict[str, str] | None = None) -> list[Mount]:
        return self._create(VIEW, key, parent, dict(labels or {}))

    def _create(self, kind: str, key: str, parent: str, labels: dict[str, str]) -> list[Mount]:
        _check_key(key)
        with self.mu:
            with self.meta.read() as t:
                self._check_new(t, key, parent)
            now = time.time()
            with self.meta.write() as t:
                snap = Snapshot(key, t.next_id(), kind, parent, labels, now, now)
                d = self.dir(snap)
                shutil.rmtree(d, ignore_errors=True)  # (an id is never reused; only a crash leaves one)
                os.mkdir(d, 0o700)
                os.mkdir(d / "fs", 0o755)
                if kind == ACTIVE and parent:
                    os.mkdir(d / "work", 0o700)
                crashpoint("create:dirs")
                t.add(snap)
            crashpoint("create:recorded")
        return self._mounts(snap)

    def _check_new(self, t: Txn, key: str, parent: str) -> None:
        if t.get(key) is not None:
            raise SnapshotExists(f"snapshot {key!r} already exists")
        if parent:
            p = t.get(parent)
            if p is None:
                raise SnapshotNotFound(f"parent snapshot {parent!r} does not exist")
            if p.kind != COMMITTED:
                raise BadInput(f"parent {parent!r} is not a committed snapshot")

    def _prepare_remote(self, key: str, parent: str, labels: dict[str, str]) -> None:
        """A layer that is a layerstore blob: mount it and record a committed snapshot named
        after the target, labelled with it, then answer AlreadyExists (containerd's remote
        snapshot protocol: it then finds the snapshot by Walk on the ref label and parent)."""
        target, blob = labels[LABEL_REF], digestmod.parse(labels[LABEL_BLOB])
        if self.layers is None:
            return  # no remote layers here: an ordinary prepare, containerd unpacks the layer
        name = REMOTE_PREFIX + target
        _check_key(name)
        # The trust check first (a Prepare of a layer already recorded too), outside the record
        # lock: it reads the store once per environment; then the environment's other layers are
        # held ahead, in parallel (containerd Prepares them one by one, each inside its metadata
        # lock), so their own Prepares find them mounted.
        env = labels.get(LABEL_ENV, "")
        hints = self.layers.check(blob, env)
        self._hold_ahead(env, blob)
        with self.meta.read() as t:
            self._check_remote(t, key, name, parent, blob)
        with self._blob_lock(blob):  # (held until recorded: a Remove or Cleanup meanwhile keeps the hold)
            self.layers.hold(blob, hints, env)  # the daemon's hints go after the metadata is in, as the shim does
            crashpoint("remote:mounted")
            now = time.time()
            try:
                with self.mu, self.meta.write() as t:
                    self._check_remote(t, key, name, parent, blob)  # (again: someone may have made it meanwhile)
                    t.add(Snapshot(name, t.next_id(), COMMITTED, parent, {**labels, LABEL_REF: target}, now, now,
                                   blob))
            except SnapshotExists:
                self._ahead.pop(blob, None)  # (a record names it)
                raise
            except BaseException:
                self._release_unused_locked(blob)
                raise
            self._ahead.pop(blob, None)
        crashpoint("remote:recorded")
        raise SnapshotExists(f"target snapshot {target!r} exists (layerstore blob {blob})")

    def _hold_ahead(self, env: str, blob: str) -> None:
        """Hold the environment's other layers now, each in a thread of its own, unless held or
        being held (once per blob at a time). Only an optimisation: a failure is logged, and the
        layer's own Prepare tries again and fails loudly."""
        assert self.layers is not None
        for other in self.layers.others(env, blob):
            if other in self._ahead or self.layers.usable(other):
                continue
            with self._blob_mu:
                if other in self._ahead:
                    continue
                self._ahead[other] = float("inf")  # (being held: until the thread sets its deadline)
                th = threading.Thread(target=self._hold_one_ahead, args=(env, other), name="snapshotter-ahead",
                                      daemon=True)
                self._ahead_threads.add(th)
            th.start()

    def _hold_one_ahead(self, env: str, blob: str) -> None:
        assert self.layers is not None
        try:
            with self._ahead_slots, self._blob_lock(blob):  # (a slot first: a Prepare holds only the blob's lock)
                try:
                    if self.layers.usable(blob):  # held already (by a record's Prepare meanwhile)
                        self._ahead.pop(blob, None)
                        self._release_unused_locked(blob)  # (unless recorded: a Remove may have met the marker)
                        return
                    hints = self.layers.check(blob, env)  # the trust policy before anything is mounted
                    self.layers.hold(blob, hints, env)
                    crashpoint("ahead:held")
                    self._ahead[blob] = time.monotonic() + PREHOLD_TTL
                except BaseException:
                    self._ahead.pop(blob, None)
                    self._release_unused_locked(blob)  # (what a half-taken hold left, unless a record names it)
                    raise
            self._sweeper.poke()  # (one thread for every deadline: it wakes at the earliest)
        except Exception as e:  # noqa: BLE001 - an optimisation: the layer's own Prepare reports it
            log.info("layer %s not held ahead (%s: %s); its own Prepare will try", blob, type(e).__name__, e)
        finally:
            with self._blob_mu:
                self._ahead_threads.discard(threading.current_thread())

    def _ahead_now(self) -> dict[str, float]:
        with self._blob_mu:
            return dict(self._ahead)

    def _expire_ahead(self, blob: str) -> None:
        """A layer held ahead whose Prepare never came (a pull given up): released unless recorded."""
        with contextlib.suppress(Exception), self._blob_lock(blob):
            deadline = self._ahead.get(blob)
            if deadline is None or deadline > time.monotonic():
                return
            del self._ahead[blob]
            self._release_unused_locked(blob)

    def _check_remote(self, t: Txn, key: str, name: str, parent: str, blob: str) -> None:
        have = t.get(name)
        if have is not None:
            if have.blob == blob and have.parent == parent:
                raise SnapshotExists(f"target snapshot {name!r} exists (layerstore blob {blob})")
            raise SnapshotExists(f"snapshot {name!r} exists with another blob or parent")
        self._check_new(t, key, parent)

    def _blob_lock(self, blob: str) -> threading.Lock:
        with self._blob_mu:
            return self._blob_locks.setdefault(blob, threading.Lock())

    def _layer_ready(self, blob: str) -> None:
        """The blob's layer mount is in place, held, and reads what the node serves now (taken or
        repaired through the shim if not). One blob at a time."""
        assert self.layers is not None
        if self.layers.usable(blob):  # (the common case, without the blob's lock)
            return
        with self._blob_lock(blob):
            self.layers.hold(blob)

    def _release_unused(self, blob: str) -> None:
        with self._blob_lock(blob):
            self._release_unused_locked(blob)

    def _release_unused_locked(self, blob: str) -> bool:
        """Caller holds the blob's lock. Drop the hold on the blob's layer unless a record names
        the blob (again: one may have been written meanwhile)."""
        assert self.layers is not None
        if self._ahead.get(blob, 0.0) > time.monotonic():
            return False  # held ahead of its Prepare (until its deadline)
        with self.meta.read() as t:
            if t.blob_users(blob):
                return False
        self.layers.release(blob)
        return True

    # -- mounts ----------------------------------------------------------------------------------
    def mounts(self, key: str) -> list[Mount]:
        with self.meta.read() as t:
            snap = t.get(key)
        if snap is None:
            raise SnapshotNotFound(f"snapshot {key!r} does not exist")
        if snap.kind == COMMITTED:
            raise SnapshotPrecondition(f"snapshot {key!r} is committed: not active or view")
        return self._mounts(snap)

    def _mounts(self, snap: Snapshot) -> list[Mount]:
        """The mounts of an active snapshot or a view, its remote layers made ready first."""
        with self.meta.read() as t:
            parents = t.chain(snap.key)[1:]
        blobs = list(dict.fromkeys(p.blob for p in parents if p.blob))
        for blob in blobs:
            self._layer_ready(blob)
        lowers = [self.fs(p) for p in parents]
        d = self.dir(snap)
        if snap.kind == ACTIVE:
            if not lowers:
                return [Mount("bind", str(d / "fs"), ("rw", "rbind"))]
            return [Mount("overlay", "overlay", ("index=off", f"workdir={d / 'work'}", f"upperdir={d / 'fs'}",
                                                 f"lowerdir={':'.join(lowers)}"))]
        if not lowers:
            return [Mount("bind", str(d / "fs"), ("ro", "rbind"))]
        if len(lowers) == 1:
            return [Mount("bind", lowers[0], ("ro", "rbind"))]
        return [Mount("overlay", "overlay", ("index=off", f"lowerdir={':'.join(lowers)}"))]

    # -- commit, remove --------------------------------------------------------------------------
    def commit(self, name: str, key: str, labels: dict[str, str] | None = None) -> None:
        _check_key(name)
        with self.mu:
            with self.meta.read() as t:
                snap = t.get(key)
                if snap is None:
                    raise SnapshotNotFound(f"snapshot {key!r} does not exist")
                if snap.kind != ACTIVE:
                    raise SnapshotPrecondition(f"snapshot {key!r} is {snap.kind}, not active: cannot commit")
                if t.get(name) is not None:
                    raise SnapshotExists(f"snapshot {name!r} already exists")
            size, inodes = usage(self.dir(snap) / "fs")
            now = time.time()
            with self.meta.write() as t:
                t.delete(snap)
                t.add(Snapshot(name, snap.id, COMMITTED, snap.parent, dict(labels or {}), now, now,
                               size=size, inodes=inodes))
            crashpoint("commit:recorded")
            with contextlib.suppress(OSError):
                shutil.rmtree(self.dir(snap) / "work")

    def remove(self, key: str) -> None:
        with self.mu:
            with self.meta.write() as t:
                snap = t.get(key)
                if snap is None:
                    raise SnapshotNotFound(f"snapshot {key!r} does not exist")
                kids = t.children(key)
                if kids:
                    raise SnapshotPrecondition(f"cannot remove snapshot {key!r}: {len(kids)} child(ren), "
                                               f"e.g. {kids[0]!r}")
                t.delete(snap)
                last = bool(snap.blob) and t.blob_users(snap.blob) == 0
            crashpoint("remove:recorded")
        # Outside the record lock: a container's upper may hold many files (other calls go on; its
        # id is never reused), and a hold's release takes the blob's lock (blob lock, then records).
        if not snap.blob:
            shutil.rmtree(self.dir(snap), ignore_errors=True)
        if last and self.layers is not None:
            self._release_unused(snap.blob)

    # -- queries -----------------------------------------------------------------------------------
    def stat(self, key: str) -> Snapshot:
        with self.meta.read() as t:
            snap = t.get(key)
        if snap is None:
            raise SnapshotNotFound(f"snapshot {key!r} does not exist")
        return snap

    def update(self, key: str, labels: dict[str, str], paths: Iterable[str] = ()) -> Snapshot:
        """containerd's Update: only labels change. No paths: the labels are replaced; "labels":
        likewise; "labels.K": label K is set to the new value (removed if it has none)."""
        paths = list(paths)
        for p in paths:
            if p != "labels" and not p.startswith("labels."):
                raise BadInput(f"cannot update {p!r} of a snapshot (only labels)")
        with self.mu, self.meta.write() as t:
            snap = t.get(key)
            if snap is None:
                raise SnapshotNotFound(f"snapshot {key!r} does not exist")
            if not paths or "labels" in paths:
                new = dict(labels)
            else:
                new = dict(snap.labels)
                for p in paths:
                    k = p[len("labels."):]
                    if k in labels:
                        new[k] = labels[k]
                    else:
                        new.pop(k, None)
            if snap.blob:
                new.setdefault(LABEL_REF, snap.labels.get(LABEL_REF, ""))  # the remote protocol's key
            snap.labels, snap.updated = new, time.time()
            t.put(snap)
            return snap

    def walk(self, filters: Iterable[str] = ()) -> list[Snapshot]:
        parsed = filtermod.parse_all(list(filters))
        with self.meta.read() as t:
            snaps = list(t.all())
        return [s for s in snaps if filtermod.matches_any(parsed, _fields(s))]

    def usage(self, key: str) -> tuple[int, int]:
        """Bytes and inodes this snapshot holds on the node's disk: a remote layer holds none (its
        bytes are the node cache's, shared and evictable); a committed local one was measured at
        commit; an active one is measured now."""
        snap = self.stat(key)
        if snap.blob:
            return 0, 0
        if snap.kind == COMMITTED and snap.size >= 0:
            return snap.size, snap.inodes
        return usage(self.dir(snap) / "fs")

    # -- cleanup -----------------------------------------------------------------------------------
    def cleanup(self) -> CleanupReport:
        return self.reconcile()

    def reconcile(self) -> CleanupReport:
        """Make the disk and the node's layer holds agree with the records: delete directories no
        record names, release the holds of blobs no record names (each under its blob's lock,
        so a Prepare in flight keeps its hold), and drop what an earlier version left."""
        rep = CleanupReport()
        with self.mu:
            with self.meta.read() as t:  # (containerd calls Cleanup after each collection: no write if none is needed)
                ids = {str(s.id) for s in t.all() if not s.blob}
                legacy = list(t.layers())
            if legacy:  # records of an earlier version's own layer mounts
                with self.meta.write() as t:
                    for blob in legacy:
                        t.delete_layer(blob)
            for entry in os.listdir(self.snapshots):
                if entry not in ids:
                    shutil.rmtree(self.snapshots / entry, ignore_errors=True)
                    rep.directories.append(entry)
        if self.layers is not None:
            rep.layer_mounts += self.layers.drop_legacy()
            for blob in self.layers.held():
                with self._blob_lock(blob):
                    if self._release_unused_locked(blob):
                        rep.layer_mounts.append(self.layers.mountpoint(blob))
        return rep


def _check_key(key: str) -> None:
    if not key or "\0" in key or len(key) > 4096:
        raise BadInput(f"bad snapshot key {key[:80]!r}")


def _fields(snap: Snapshot) -> filtermod.Lookup:
    def lookup(path: tuple[str, ...]) -> str | None:
        head = path[0] if path else ""
        if head == "kind" and len(path) == 1:
            return snap.kind
        if head == "name" and len(path) == 1:
            return snap.key
        if head == "parent" and len(path) == 1:
            return snap.parent
        if head == "labels" and len(path) > 1:
            return snap.labels.get(".".join(path[1:]))
        return None

    return lookup
