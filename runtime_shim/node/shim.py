"""The runtime shim: mount, check and unmount a sandbox's root
filesystem on this node, with the picture persisted (`state`) and rebuilt by `recover()`.

A sandbox = a private upper + work directory + an overlay of the environment's layers, each of
which is a shared, reference-counted EROFS mount (`layers`). Every state change is decided under
the node lock and bracketed by a `pending` entry in the state (written first, cleared by the
transaction that completes the change; it names its process by pid and start time), so a crash
mid-change is found in O(1) and undone or finished by recovery; see docs/runtime-shim.md for the
order of steps and what a crash at each leaves. Nothing on the path of one mount or teardown
costs O(sandboxes) or O(mounts).
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from layerstore import linux
from layerstore.fileio import rmdir_quiet

from ..backends import SandboxBackend, node_backends
from ..errors import RuntimeNotAvailable, SandboxExists, SandboxNotFound, ShimError
from ..nodestate import records, utab
from ..nodestate.idmap import chown_to_range, idmapped_lowers
from ..nodestate.lock import BlobLock, NodeLock
from ..nodestate.lost import lost_layers, lost_reason
from ..nodestate.paths import NodePaths, check_overlay_safe, check_sandbox_id, new_sandbox_id
from ..nodestate.state import (
    BROKEN,
    MOUNTED,
    MOUNTING,
    UNMOUNTING,
    LayerMount,
    NodeState,
    Sandbox,
    Txn,
    boot_id,
    encode,
    this_process,
)
from ..resolve.environment import EnvSpec
from ..supervise.daemon import DaemonCommand, default_command
from .blobs import BlobSource, DaemonBlobs
from .layers import CLAIMED, LayerMounts
from .lifecycle import SandboxLifecycle
from .overlay import (
    make_upper_image,
    mount_flags,
    mount_overlay,
    mount_scratch,
    mount_upper_image,
    reserve_upper_image,
)
from .recover import RecoverReport, recover
from .request import MountRequest

Resolver = Callable[[str], EnvSpec]
HINTS_TIMEOUT = 60.0  # how long closing a shim waits for prefetch hints still being sent
STOPPED, CLEARED = "stopped", "cleared"  # what `stop_daemon` did


@dataclass
class SandboxHealth:
    sandbox: str
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


class Shim:
    """One node's shim. Construct with `Shim.for_node(...)` (daemon-served blobs) or directly
    with any `BlobSource`. When it starts (unless `auto_recover=False`) it checks in O(layers)
    whether recovery is needed (a reboot, an operation a crash interrupted, a dead daemon, a
    missing layer mount) and runs the full `recover()` only then.

    The end of a sandbox's life (undoing a mount, teardown) and the NODE/roots mount are its
    `lifecycle`'s, which recovery calls too; what runs in a sandbox is a backend's (`backends`:
    every registered one unless given, by name)."""

    def __init__(self, paths: NodePaths, blobs: BlobSource, *, resolver: Resolver | None = None,
                 store_url: str = "", state: NodeState | None = None, auto_recover: bool = True,
                 backends: dict[str, SandboxBackend] | None = None) -> None:
        self.paths = paths
        paths.create()
        self.state = state or NodeState(paths.state)
        self.blobs = blobs
        self.layers = LayerMounts(paths, blobs)
        self.lifecycle = SandboxLifecycle(paths, self.state, NodeLock(paths.lock), self.layers)
        self.backends = dict(backends) if backends is not None else node_backends(paths)
        self.resolver = resolver
        self.store_url = store_url
        self._closers: list[Callable[[], None]] = []
        self._hint_mu = threading.Lock()
        self._hinting: set[str] = set()
        self._hint_threads: list[threading.Thread] = []
        self._layer_points: dict[str, str] = {}  # blob -> NODE/layers/<hex> (a path computed once)
        self._layers_current: str | None = None  # the generation every layer record was found current for
        if auto_recover:
            self.recover_if_needed()

    @classmethod
    def for_node(cls, node_dir: str | os.PathLike[str] | None = None, store_url: str | None = None, *,
                 daemon_command: DaemonCommand = default_command, auto_recover: bool = True,
                 policy: str | os.PathLike[str] | None = None) -> Shim:
        """The production shim: blobs from the node daemon, environments from the store (one
        client for the shim's lifetime; environments cached by manifest digest). Without an
        explicit store the running daemon's store is used, else the default store. The trust
        policy is NODE/policy.json when the node has one, combined with the caller's (`policy`, else
        $LAYERSTORE_TRUST_POLICY): a caller can tighten the node's policy, never loosen it."""
        from layerstore.config import resolve_store_url
        from layerstore.store import Store

        from ..resolve.environment import CachingResolver, node_policy

        paths = NodePaths.resolve(node_dir)
        paths.create()
        trust = node_policy(paths.root, policy)
        state = NodeState(paths.state)
        try:
            if store_url is None:
                with state.read() as t:
                    rec = t.daemon()
                store_url = rec.store if rec is not None else resolve_store_url(None)
            store = Store.open(store_url)
        except BaseException:
            state.close()
            raise
        resolver = CachingResolver(store, trust)
        blobs = DaemonBlobs(paths, state, store.url, daemon_command)
        try:
            shim = cls(paths, blobs, resolver=resolver, store_url=store.url, state=state, auto_recover=auto_recover)
        except BaseException:
            resolver.close()
            state.close()
            raise
        shim._closers.append(resolver.close)
        return shim

    def close(self) -> None:
        for th in self._hint_threads:
            th.join(HINTS_TIMEOUT)
        for close in self._closers:
            with contextlib.suppress(Exception):
                close()
        self._closers = []
        close_lock = getattr(self.lifecycle.lock, "close", None)
        if close_lock is not None:
            close_lock()
        self.state.close()

    def __enter__(self) -> Shim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def lock(self) -> NodeLock:
        """The node lock (the lifecycle's: one lock for every state change on the node)."""
        return self.lifecycle.lock

    @lock.setter
    def lock(self, lock: NodeLock) -> None:  # (a wrapper, e.g. one that times the waits)
        self.lifecycle.lock = lock

    # -- queries -------------------------------------------------------------------------
    def sandboxes(self) -> list[Sandbox]:
        with self.state.read() as t:
            return t.sandboxes()

    def find(self, sandbox_or_target: str) -> Sandbox:
        with self.state.read() as t:
            sb = None
            with contextlib.suppress(Exception):
                sb = t.sandbox(check_sandbox_id(sandbox_or_target))
            if sb is None:
                sb = t.sandbox_at(os.path.abspath(sandbox_or_target))
        if sb is None:
            raise SandboxNotFound(f"no sandbox {sandbox_or_target!r} on node {self.paths.root}")
        return sb

    def layer_refs(self) -> dict[str, int]:
        with self.state.read() as t:
            return {lm.blob: lm.refs for lm in t.layers()}

    def check(self, sandbox_or_target: str) -> SandboxHealth:
        """Is the sandbox's root mounted, over live layer mounts of the current generation?
        O(layers): looks at the sandbox's own paths only."""
        sb = self.find(sandbox_or_target)
        health = SandboxHealth(sb.id)
        if sb.status != MOUNTED:
            health.problems.append(f"status {sb.status}{': ' + sb.error if sb.error else ''}")
        if sb.backend:
            pass  # (its root is composed in its guest)
        elif not linux.is_mount(sb.target) or linux.fs_type(sb.target) != linux.OVERLAYFS_MAGIC:
            health.problems.append(f"root {sb.target} is not mounted")
        gen = self.blobs.generation()
        if gen is None:
            health.problems.append("the blob source (node daemon) is not healthy")
        with self.state.read() as t:
            for blob in sb.layers:
                lm = t.layer(blob)
                if lm is None or not linux.is_mount(lm.mountpoint):
                    health.problems.append(f"layer {blob} is not mounted")
                elif gen is not None and not lm.current(gen):
                    health.problems.append(f"layer {blob} reads from a previous daemon")
        return health

    # -- mount -----------------------------------------------------------------------------
    def resolve(self, env: str | EnvSpec) -> EnvSpec:
        if isinstance(env, EnvSpec):
            return env
        if self.resolver is None:
            raise SandboxNotFound("this shim has no store to resolve environments from")
        return self.resolver(env)

    def mount(self, req: MountRequest) -> Sandbox:
        """Compose the sandbox `req` asks for (`MountRequest` says what each of its fields does).

        The node lock is held once, for state changes only: to record the sandbox and take its
        layer references (claiming the mounts of layers nobody has mounted); marking it mounted
        needs no lock (see below). Layer mounts (a cold one waits for the daemon to fetch the
        blob's metadata), the overlay and the sandbox's directories are made without it: see
        `layers`."""
        spec = self.resolve(req.env)  # trust policy and store reads happen before anything is mounted
        sid = check_sandbox_id(req.sandbox) if req.sandbox else new_sandbox_id()
        upper_size, upper_image = req.upper_size, req.image_size
        if req.eager:
            with self.lock:
                self._ready_locked()
            # outside the lock, every layer at once, one fetch per blob on the node
            error = _concurrently([functools.partial(self.blobs.fetch_all, blob) for blob in dict.fromkeys(spec.blobs)])
            if error is not None:
                raise error
        with self.lock:
            sb, claimed, waits, created_dir, gen = self._begin_mount(spec, req, sid)
        mounted = False
        record = encode({**sb.to_json(), "status": MOUNTED})  # the record's = transaction 2's
        try:
            self._layers_ready(sb, claimed, waits, gen, upper_size, upper_image, record)
            if not req.eager:  # after the layers' metadata is in: hinted fetches do not delay the mounts
                self._send_hints(spec)
            lowers = [self._layer_point(b) for b in reversed(sb.layers)]
            flags = mount_flags(nosuid=req.nosuid, nodev=req.nodev)
            if sb.backend:
                pass  # (the guest composes the root from the layer files)
            elif sb.userns is None:
                mount_overlay(sb.target, lowers, sb.upper, sb.work, flags)
            else:
                with idmapped_lowers(lowers, sb.userns) as mapped:
                    mount_overlay(sb.target, mapped, sb.upper, sb.work, flags)
            mounted = True
            if req.utab_entry:
                mid = linux.mount_id(sb.target)
                if mid is not None:
                    utab.add(mid, sb.target)
            sb.status = MOUNTED
            # Without the node lock: a blind write of this mount's own record and pending entry,
            # which nobody else changes while this process lives (a teardown and recovery leave a
            # sandbox alone while its pending entry's process runs); LMDB orders the writers.
            with self.state.write() as t:
                t.put_status(sb, record)
                t.clear_pending(sid)
        except BaseException:
            sb.status = MOUNTING
            self._abandon(claimed)
            with contextlib.suppress(Exception):
                self.lifecycle.undo_mount(sb, overlay=mounted, created_dir=created_dir)
            raise
        return sb

    def _layer_point(self, blob: str) -> str:
        point = self._layer_points.get(blob)
        if point is None:
            point = self._layer_points[blob] = str(self.paths.layer_mount(blob))
        return point

    def _send_hints(self, spec: EnvSpec) -> None:
        """The environment's prefetch hints (from its manifest) to the blob source, in the
        background (below demand reads in the daemon), so that a sandbox's first reads find their
        chunks on the way: once per chunk per node (recorded in the state), one sender per blob in
        this process at a time. Hints are an optimisation: a failure to send them is ignored."""
        if not spec.prefetch:
            return
        wanted = {b: spec.prefetch[b] for b in dict.fromkeys(spec.blobs) if spec.prefetch.get(b)}
        with self.state.read() as t:
            todo = {}
            for blob, idxs in wanted.items():
                sent = t.hinted(blob)
                new = [i for i in idxs if i not in sent]
                if new:
                    todo[blob] = new
        with self._hint_mu:
            todo = {b: c for b, c in todo.items() if b not in self._hinting}
            self._hinting.update(todo)
        if not todo:
            return
        th = threading.Thread(target=self._hint, args=(todo,), name="shim-hints")
        th.start()
        with self._hint_mu:
            self._hint_threads = [t for t in self._hint_threads if t.is_alive()] + [th]

    def _hint(self, todo: dict[str, list[int]]) -> None:
        for blob, chunks in todo.items():
            try:
                self.blobs.prefetch(blob, chunks)
                with self.state.write() as t:
                    t.add_hinted(blob, chunks)
            except Exception:  # noqa: BLE001, S112 - hints are an optimisation; the next mount tries again
                continue
            finally:
                with self._hint_mu:
                    self._hinting.discard(blob)

    def _ready_locked(self) -> str:
        """Caller holds the lock. The blob source runs (the daemon started if needed) and the
        picture is usable (recovery run first if a crash left an operation or a layer mount of an
        earlier daemon). Returns the blob source's generation."""
        gen = self.blobs.ensure()
        with self.state.read() as t:
            stale = self._stale(t, gen)
        if stale:
            self._recover_locked()
            gen = self.blobs.ensure()
        return gen

    def _stale(self, t: Txn, gen: str) -> bool:
        """Does the picture need recovery before a mount? An operation of a dead process is
        pending (O(1) when none is), or a layer mount was made from an earlier daemon's files.
        The layers are compared with `gen` once per generation in this process: a layer record
        gets the generation of the mount that made it (under the lock, from a healthy source), so
        records older than a generation this process checked can only appear when the source
        changes, and then `gen` changes too (the blob source notices its daemon's exit)."""
        if t.dead_pending():
            return True
        if gen == self._layers_current:
            return False
        if any(lm.status == MOUNTED and not lm.current(gen) for lm in t.layers()):
            return True
        self._layers_current = gen
        return False

    def _begin_mount(self, spec: EnvSpec, req: MountRequest,
                     sid: str) -> tuple[Sandbox, dict[str, BlobLock], set[str], bool, str]:
        """Caller holds the lock. Make sure the blob source runs and the picture is usable (see
        `_ready_locked`); refuse taken ids, targets and uppers; create the sandbox's
        directory; transaction 1: the sandbox (`mounting`), its pending entry and a reference on
        every layer, claiming the mounts of layers nobody has mounted or is mounting (their blob
        locks are taken here, before the node lock is released, so that waiters find them held).
        Returns the sandbox, the claimed layers' locks, the layers others are mounting, whether
        the directory was created, and the blob source's generation."""
        target, upper, guest, scratch = req.target, req.upper, req.guest, req.scratch
        userns, image = req.userns, req.image_size
        gen = self.blobs.ensure()
        sdir = self.paths.sandbox_dir(sid)
        tgt = os.path.abspath(target) if target is not None else str(self.paths.rootfs(sid))
        owned = upper is None
        home = self.paths.scratch(sid) if owned and scratch else sdir  # the upper's own tmpfs, or beside the record
        up = str(home / "upper") if owned else os.path.abspath(upper)  # type: ignore[arg-type]
        if guest:  # the upper drive (when it has one: kept), else a name that is only its own
            up = str(self.paths.upper_image(sid) if scratch else sdir / "upper")
        if not owned:
            check_overlay_safe(up, "upper directory")
        sb = Sandbox(id=sid, env=spec.ref, manifest=spec.manifest, layers=spec.blobs, config=dict(spec.config),
                     target=tgt, upper=up, work="", owned=owned, store=self.store_url, status=MOUNTING,
                     created=time.time(), utab=req.utab_entry, backend=guest or "")
        got = self._record_mount(sb, sdir, home, userns, gen, check_stale=True, image=image)
        if got is None:  # (the picture needs recovery first)
            self._recover_locked()
            gen = self.blobs.ensure()
            got = self._record_mount(sb, sdir, home, userns, gen, check_stale=False, image=image)
        assert got is not None
        created_dir, claims, waits, roots = got
        claimed: dict[str, BlobLock] = {}
        try:
            for blob in claims:
                claimed[blob] = BlobLock(self.paths.layer_lock(blob)).hold()
            if not roots and self.lifecycle.under_roots(tgt) and not guest:
                self.lifecycle.ensure_roots()
        except BaseException:
            self._abandon(dict.fromkeys(claims, None) | claimed)
            self.lifecycle.undo_mount(sb, overlay=False, created_dir=created_dir)
            raise
        return sb, claimed, waits, created_dir, gen

    def _record_mount(self, sb: Sandbox, sdir: Path, home: Path, userns: bool, gen: str, *,
                      check_stale: bool, image: int | None = None) -> tuple[bool, list[str], set[str], bool] | None:
        """Caller holds the lock. One write transaction (the usual case needs no other): None if
        `check_stale` and the picture needs recovery first (`_stale`); else refuse taken ids,
        targets and uppers, create the sandbox's directory, and transaction 1: the sandbox
        (`mounting`), its pending entry and a reference on every layer. Returns whether the
        directory was created, the layers this mount claimed, those others are mounting, and
        whether NODE/roots is mounted. `image`: the size of the kept upper's image, reserved here
        (`reserve_upper_image`: `NodeFull` if the node disk cannot hold it). If anything fails, the
        transaction is aborted and the directory this call created removed."""
        sid = sb.id
        created_dir = False
        waits: set[str] = set()
        claims: list[str] = []
        try:
            with self.state.write() as t:
                if check_stale and self._stale(t, gen):
                    return None
                self._refuse_taken(t, sid, sb.target, sb.upper)
                if sb.owned:
                    try:
                        os.mkdir(sdir, 0o700)  # exclusive: proves the directory (and what goes in it) is ours
                    except FileExistsError:
                        raise SandboxExists(f"sandbox {sid} has data on this node ({sdir}); pass its upper "
                                            f"({sdir / 'upper'}) explicitly to resume it, or remove it") from None
                    created_dir = True
                    sb.work = str(home / "work")
                    if image is not None:
                        reserve_upper_image(self.paths.upper_image(sid), image)
                else:
                    if not sdir.exists():
                        sdir.mkdir(mode=0o700)
                        created_dir = True
                    Path(sb.upper).mkdir(mode=0o755, parents=True, exist_ok=True)
                    sb.work = str(self._work_for(Path(sb.upper), sdir))
                # From here on, a crash leaves a `pending` mount that recovery rolls back.
                roots = t.roots_mounted()
                if userns and sb.owned:
                    sb.userns = t.allocate_idrange(sid)
                t.put_sandbox(sb, new=True)  # (refused above if it had a record)
                t.put_pending(sid, "mount")
                for blob in sb.layers:
                    got = self.layers.take(t, blob, gen)
                    if got == CLAIMED:
                        claims.append(blob)
                    elif got == MOUNTING:
                        waits.add(blob)
                waits.difference_update(claims)  # (a layer listed twice)
        except BaseException:
            if created_dir and sb.owned:
                shutil.rmtree(sdir, ignore_errors=True)
            elif created_dir:
                rmdir_quiet(sdir)
            raise
        return created_dir, claims, waits, roots

    def _refuse_taken(self, t: Txn, sid: str, target: str, upper: str) -> None:
        if t.sandbox(sid) is not None:
            raise SandboxExists(f"sandbox {sid} already exists on node {self.paths.root}")
        other = t.sandbox_at(target, absent=sid)
        if other is not None:
            raise SandboxExists(f"{target} is already the root of sandbox {other.id}")
        other = t.sandbox_with_upper(upper, absent=sid)
        if other is not None:
            raise SandboxExists(f"upper {upper} is in use by sandbox {other.id}")

    def _layers_ready(self, sb: Sandbox, claimed: dict[str, BlobLock], waits: set[str], gen: str,
                      upper_size: int | None = None, upper_image: int | None = None,
                      record: bytes | None = None) -> None:
        """Without the node lock: mount the layers this call claimed, wait for those others are
        mounting, and make the sandbox's directories and record, all at once (in the calling
        thread alone when every layer is mounted already). Raises the first failure (after every
        claimed mount's outcome is recorded)."""
        mine = dict(claimed)
        claimed.clear()  # each claimed mount settles its own outcome from here on
        fns: list[Callable[[], None]] = [functools.partial(self._mount_claimed, b, gen, lk) for b, lk in mine.items()]
        fns += [functools.partial(self._await_layer, b, gen) for b in sorted(waits)]
        fns.append(functools.partial(self._make_dirs, sb, upper_size, upper_image, record))
        error = _concurrently(fns)
        if error is not None:
            raise error

    def _make_dirs(self, sb: Sandbox, upper_size: int | None = None, upper_image: int | None = None,
                   record: bytes | None = None) -> None:
        if sb.backend:  # composed in a guest: its upper drive if it is kept, nothing else on the host
            if upper_image is not None:
                make_upper_image(sb.upper, upper_image, reserved=True)
        elif sb.owned and upper_size is not None:
            scratch = self.paths.scratch(sb.id)
            os.mkdir(scratch, 0o700)
            mount_scratch(scratch, upper_size)  # (detached by every teardown and undo: `lifecycle`)
        elif sb.owned and upper_image is not None:
            # In the sandbox's directory, which the sandbox's record precedes: a crash from here on
            # is rolled back by recovery (the scratch detached, the directory trashed with the
            # image); its loop device is autocleared when the filesystem is unmounted.
            scratch = self.paths.scratch(sb.id)
            os.mkdir(scratch, 0o700)
            make_upper_image(self.paths.upper_image(sb.id), upper_image, reserved=True)
            mount_upper_image(self.paths.upper_image(sb.id), scratch)
        if sb.backend:
            pass
        elif sb.owned:
            os.mkdir(sb.upper, 0o755)
            os.mkdir(sb.work, 0o700)
            if sb.userns is not None:  # root in the sandbox owns its root directory
                chown_to_range(sb.userns, sb.upper, sb.work)
        else:
            Path(sb.work).mkdir(mode=0o700, exist_ok=True)
        if not sb.backend:
            try:
                os.mkdir(sb.target, 0o755)
            except FileExistsError:
                pass
            except FileNotFoundError:  # (a caller's target whose parents do not exist yet)
                os.makedirs(sb.target, 0o755, exist_ok=True)
        # The record says what should be (mounted): it is what recovery rebuilds from
        # after a reboot, when the database is not trusted. The directory of an owned sandbox
        # was created by this mount: no record is there yet.
        if record is None:
            record = encode({**sb.to_json(), "status": MOUNTED})
        records.save(self.paths, sb, fresh=sb.owned, encoded=record)

    def _mount_claimed(self, blob: str, gen: str, lock: BlobLock) -> None:
        """Mount a layer this process claimed, record the outcome under the node lock, then let
        the waiters go."""
        mounted: LayerMount | None = None
        error = ""
        try:
            mounted = self.layers.mount(blob, gen)
        except Exception as e:
            error = str(e) or type(e).__name__
            raise
        finally:
            try:
                with self.lock, self.state.write() as t:
                    self.layers.settle(t, blob, mounted, error)
            finally:
                lock.release()

    def _await_layer(self, blob: str, gen: str) -> None:
        """Wait until the layer another mount claimed is mounted (its claimant releases the blob's
        lock once the outcome is recorded); take the mount over if its claimant died or gave up."""
        lock = BlobLock(self.paths.layer_lock(blob))
        while True:
            lock.wait()
            with self.state.read() as t:
                lm = t.layer(blob)
            if lm is None:
                raise ShimError(f"layer {blob}: its mount was given up by recovery")
            if lm.status == MOUNTED:
                return
            if lm.in_flight:  # claimed again meanwhile: wait for that attempt
                time.sleep(0.001)
                continue
            if lm.error:
                raise ShimError(lm.error)
            with self.lock:  # nobody is mounting it (its claimant died or gave up): take it over
                with self.state.write() as t:
                    cur = t.layer(blob)
                    mine = cur is not None and cur.status == MOUNTING and not cur.in_flight and not cur.error
                    if mine:
                        cur.owner = this_process()
                        t.put_layer(cur)
                if mine:
                    lock.hold()
            if mine:
                self._mount_claimed(blob, gen, lock)
                return

    def _abandon(self, claimed: dict[str, BlobLock | None]) -> None:
        """Claimed layer mounts that were never attempted: nobody owns them now (a waiter takes
        them over)."""
        for blob, lock in list(claimed.items()):
            with contextlib.suppress(Exception), self.lock, self.state.write() as t:
                self.layers.settle(t, blob, None)
            if lock is not None:
                lock.release()
        claimed.clear()

    def _work_for(self, upper: Path, sdir: Path) -> Path:
        # overlayfs wants work on the upper's filesystem: beside the sandbox when that is the same
        # filesystem, else next to the caller's upper.
        if os.stat(upper).st_dev == os.stat(sdir).st_dev:
            return sdir / "work"
        return upper.parent / f".{upper.name}.work"

    # -- unmount ---------------------------------------------------------------------------
    def unmount(self, sandbox_or_target: str) -> Sandbox:
        """Tear a sandbox down: stop its container if one is left, unmount its root, release its
        layers (the last user unmounts a layer), delete the upper and work the shim created. An
        explicit upper is kept.

        Three things happen outside the node lock: deleting a leftover container (the runtime may
        take a while), unmounting the root (overlayfs syncs its upper's filesystem at unmount: a
        journal commit of the node disk, which concurrent teardowns share when they are not
        serialised) and deleting an owned upper (a sandbox that wrote a million files must not
        hold up every other mount). The `pending` entry written first marks the sandbox as being
        torn down by this process meanwhile."""
        sb = self.find(sandbox_or_target)
        self.delete_containers(sb.id)
        with self.lock:
            sb = self.lifecycle.begin_teardown(self.find(sandbox_or_target))
        self.lifecycle.detach_root(sb)
        with self.lock:
            trashed = self.lifecycle.end_teardown(sb)
        if trashed is not None:
            shutil.rmtree(trashed, ignore_errors=True)
        return sb

    # -- backends ------------------------------------------------------------------------------
    def backend(self, name: str) -> SandboxBackend:
        """The named backend (`layerctl run --runtime`), checked to be runnable on this node
        (`RuntimeNotAvailable` if it is unknown or cannot run here)."""
        try:
            backend = self.backends[name]
        except KeyError:
            raise RuntimeNotAvailable(f"unknown sandbox backend {name!r} (have: {', '.join(self.backends)})") from None
        backend.check()
        return backend

    def delete_containers(self, sandbox: str) -> list[str]:
        """Delete (killing it if it runs) what any backend keeps for this sandbox, if anything is
        left: `layerctl run` deletes its own, but not after a crash, nor one a runtime started on
        a kept sandbox. O(backends): `has` looks at one path. Returns the backends that had one."""
        found = []
        for name, backend in self.backends.items():
            if backend.has(sandbox):
                with contextlib.suppress(RuntimeNotAvailable):
                    backend.delete(sandbox)
                    found.append(name)
        return found

    # -- recovery --------------------------------------------------------------------------
    def stop_daemon(self) -> str:
        """Stop the node daemon (before an upgrade, or to free the node) and its watch, and take
        down what a dead one left: its FUSE mount, layer mounts nobody uses. Refused while
        sandboxes are mounted: their layers read through it. Returns STOPPED (a daemon ran),
        CLEARED (none ran, but a dead one's mount, layer mounts or record were left: now gone),
        or "" (nothing was there)."""
        with self.lock:
            if self.sandboxes():
                raise SandboxExists(f"{len(self.sandboxes())} sandbox(es) still mounted on node {self.paths.root}; "
                                    f"remove them first (layerctl sandbox ls)")
            stop = getattr(self.blobs, "stop", None)
            if stop is None:
                return ""
            running = self.blobs.generation() is not None
            with self.state.read() as t:
                recorded = t.daemon() is not None
            left = self.lifecycle.clear_layers()
            dead = self.blobs.clear_dead()
            stop()
            self.lifecycle.release_roots()
        return STOPPED if running else CLEARED if recorded or left or dead else ""

    def lost_reason(self, sandbox: str) -> str:
        """Why the sandbox's data path died under it ("" if it did not): its record's mark (the
        watch's or recovery's), else one of its layers that reads through the FUSE mount of a
        daemon other than the healthy one (a death nobody has handled yet). O(layers)."""
        with self.state.read() as t:
            sb = t.sandbox(sandbox)
            if sb is None:
                return ""
            if sb.lost:
                return sb.lost
            layers = [lm for b in dict.fromkeys(sb.layers) if (lm := t.layer(b)) is not None]
        gone = lost_layers(layers, str(self.paths.fuse), self.blobs.generation())
        return lost_reason(gone[0].blob) if gone else ""

    def recover(self) -> RecoverReport:
        """The full comparison of the picture with the node (O(sandboxes + mounts))."""
        with self.lock:
            return self._recover_locked()

    def recover_if_needed(self) -> RecoverReport | None:
        """What every shim start runs: O(layers) checks, and the full recovery only when one
        fails. Returns its report, or None when nothing needed recovering."""
        with self.lock:
            why = self.recovery_reason()
            if why:
                rep = self._recover_locked()
                rep.reason = why
                return rep
        records.empty_trash(self.paths, only_dead=True)
        return None

    def recovery_reason(self) -> str:
        """Why the picture cannot be trusted as it is ("" if it can). Caller holds the lock.
        Catches: a reboot, an operation a crash interrupted, a daemon that died, a layer mount
        that vanished or reads from a previous daemon. Not caught (only the full `recover()`
        compares every overlay with mountinfo): a sandbox root unmounted behind the shim's back."""
        import lmdb

        from layerstore.errors import CorruptObject

        try:
            with self.state.read() as t:
                boot, pending, layers = t.boot(), len(t.dead_pending()), t.layers()
        except (lmdb.Error, CorruptObject) as e:
            return f"the state database is unreadable ({e})"
        if boot != boot_id():
            return "the machine restarted" if boot else "no boot recorded (new or older state)"
        if pending:
            return f"{pending} operation(s) interrupted"
        if not self.lifecycle.roots_consistent():
            return f"the {self.paths.roots} mount is gone"
        if layers:
            gen = self.blobs.generation()
            if gen is None:
                return "the blob source (node daemon) is not healthy"
            for lm in layers:
                if lm.status != MOUNTED:
                    continue  # being mounted (or its claim settled by the next mount that needs it)
                if not lm.current(gen):
                    return f"layer {lm.blob} reads from a previous daemon"
                if not linux.is_mount(lm.mountpoint):
                    return f"layer {lm.blob} is not mounted"
        return ""

    def _recover_locked(self) -> RecoverReport:
        self._layers_current = None  # (checked again by the next mount)
        with contextlib.suppress(Exception):
            if not self.lifecycle.roots_consistent():  # recorded, but gone: made again when needed
                with self.state.write() as t:
                    t.put_roots_mounted(False)
        return recover(self.lifecycle, self.blobs, self.backends)


def _concurrently(fns: list[Callable[[], None]]) -> BaseException | None:
    """Run every function at once (the last one in the calling thread), wait for all, and return
    the first exception raised (None if none was)."""
    errors: list[BaseException | None] = [None] * len(fns)

    def run(i: int) -> None:
        try:
            fns[i]()
        except BaseException as e:  # handed to the caller
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i,), name="shim-layer") for i in range(len(fns) - 1)]
    for th in threads:
        th.start()
    if fns:
        run(len(fns) - 1)
    for th in threads:
        th.join()
    return next((e for e in errors if e is not None), None)


__all__ = ["Shim", "SandboxHealth", "RecoverReport", "MOUNTED", "MOUNTING", "UNMOUNTING", "BROKEN"]
