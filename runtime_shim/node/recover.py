"""`recover()`: rebuild the node's picture after a crash of the shim, of the node daemon, or of the
machine.

Desired state = every sandbox in the state database, plus every sandbox whose record
(on NODE/sandboxes/<id>: `records`) survived a lost database. Actual state = one read of
/proc/self/mountinfo and the daemon's health. Recovery then, in this order:

0. if the database belongs to an earlier boot (power loss, kernel crash, reboot: every mount is
   gone and the unsynced database may have lost its last transactions), forgets it and rebuilds
   from the records;
1. settles the operations a crash interrupted (`pending` entries whose process, pid + start time,
   is gone): an unfinished mount is rolled back (the caller never got an answer), an unfinished
   teardown is finished. An entry of a live process is an operation in flight (a teardown
   unmounts its root outside the lock): that sandbox is counted but not touched;
2. adopts records the database does not know; finishes every teardown whose directory is
   already in NODE/sandboxes/.trash, then empties the trash;
3. marks lost the sandboxes stacked on layers read through the FUSE mount of a daemon that is
   not the healthy one (`nodestate.lost`: their running processes saw errors) and detaches a
   dead FUSE mount (ENOTCONN) a killed daemon left, also when nothing needs a daemon now; then,
   if a sandbox needs layers, makes the blob source healthy (a new daemon);
4. finds the stale layer mounts (missing, or made from a previous daemon's files) and the sandboxes
   stacked on them or missing their overlay; detaches those overlays and layers (lazily: a
   process still inside keeps its detached view), mounts the layers again, then the overlays
   again with the SAME upper and work directories;
5. recounts every layer's references from the sandboxes, unmounts layers nobody uses, and
   detaches orphan mounts (layer mounts and overlays under the node directory that no sandbox owns);
6. deletes the backends' leftover workloads (containers): those of sandboxes that no longer
   exist, and stopped ones (a running container of a live sandbox is left alone);
7. reports sandbox directories that have no readable record (never deletes them).

Upper directories are never written or deleted here.

Recovery works through the pieces the shim is made of, passed in: the sandbox lifecycle (with the
node's paths, state and layer mounts: it undoes mounts and finishes teardowns exactly as the shim
does), the blob source, and the sandbox backends (leftover containers).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import lmdb

from layerstore import linux
from layerstore.errors import CorruptObject, LayerstoreError
from layerstore.fileio import rmdir_quiet
from layerstore.linux import detach

from ..backends.base import SandboxBackend
from ..errors import RuntimeNotAvailable, ShimError
from ..nodestate import records
from ..nodestate.lost import mark_lost
from ..nodestate.state import BROKEN, MOUNTED, UNMOUNTING, LayerMount, NodeState, Sandbox, boot_id
from .blobs import BlobSource
from .layers import LayerMounts
from .lifecycle import SandboxLifecycle
from .overlay import mount_overlay, mount_upper_image


@dataclass
class RecoverReport:
    adopted: list[str] = field(default_factory=list)  # sandboxes rebuilt from their records
    rolled_back: list[str] = field(default_factory=list)  # mounts a crash interrupted, taken back
    finished_teardowns: list[str] = field(default_factory=list)
    remounted_layers: list[str] = field(default_factory=list)
    remounted_sandboxes: list[str] = field(default_factory=list)
    broken: dict[str, str] = field(default_factory=dict)
    unmounted_layers: list[str] = field(default_factory=list)
    orphan_mounts: list[str] = field(default_factory=list)
    deleted_containers: list[str] = field(default_factory=list)
    unrecorded: list[str] = field(default_factory=list)  # sandbox directories without a readable record
    lost: dict[str, str] = field(default_factory=dict)  # sandboxes this recovery marked lost, with the reason
    dead_mounts: list[str] = field(default_factory=list)  # dead FUSE mounts (of a killed daemon) detached
    trash_emptied: int = 0
    rebooted: bool = False  # the database belonged to an earlier boot and was rebuilt from the records
    daemon_generation: str | None = None
    reason: str = ""  # why a start-up ran the full recovery ("" when asked for explicitly)

    @property
    def changed(self) -> bool:
        return bool(self.adopted or self.rolled_back or self.finished_teardowns or self.remounted_layers
                    or self.remounted_sandboxes or self.broken or self.unmounted_layers or self.orphan_mounts
                    or self.deleted_containers or self.trash_emptied or self.rebooted or self.lost or self.dead_mounts)

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()}


def _forget_earlier_boot(state: NodeState, rep: RecoverReport) -> None:
    """Repairs a database of an earlier boot (power loss, kernel crash, reboot: every mount is
    gone and the unsynced database may have lost its last transactions): forgets it, so that the
    next phases rebuild it from the records."""
    boot = boot_id()
    try:
        with state.read() as t:
            recorded = t.boot()
    except (lmdb.Error, CorruptObject):
        recorded = "unreadable"
    # None = a new database, or one written by a shim that synced every transaction: trusted.
    if recorded is not None and recorded != boot:
        state.reset()
        rep.rebooted = True


def _settle_pending(lifecycle: SandboxLifecycle, rep: RecoverReport,
                    mounts: dict[str, linux.MountEntry]) -> dict[str, Sandbox]:
    """Repairs the operations a crash interrupted (pending entries of dead processes): an
    unfinished mount is rolled back, an unfinished teardown finished. Returns the sandboxes live
    processes are working on (a teardown unmounting its root outside the lock), which recovery
    leaves alone."""
    state = lifecycle.state
    with state.read() as t:
        every = t.pending()
        pending = t.dead_pending()
        sbs = {sid: t.sandbox(sid) for sid in every}
    inflight = {sid: sb for sid, sb in sbs.items() if sid not in pending and sb is not None}
    for sid, op in sorted(pending.items()):
        sb = sbs[sid]
        if sb is None:
            with state.write() as t:
                t.clear_pending(sid)
            continue
        if op.get("op") == "unmount":
            lifecycle.teardown(sb)
            rep.finished_teardowns.append(sid)
            continue
        m = mounts.get(sb.target)
        ours = m is not None and m.fstype == "overlay" and f"upperdir={sb.upper}," in m.options + ","
        lifecycle.undo_mount(sb, overlay=ours, created_dir=True)
        rep.rolled_back.append(sid)
    return inflight


@dataclass
class _Picture:
    """What the phases of one recovery learn and hand on to the next."""

    inflight: dict[str, Sandbox]  # sandboxes live processes are working on: counted, never touched
    live: list[Sandbox] = field(default_factory=list)  # the node's sandboxes after the settling phases
    needed: set[str] = field(default_factory=set)  # blobs some sandbox stacks
    layer_recs: dict[str, LayerMount] = field(default_factory=dict)  # the layer records before repair
    claimed: set[str] = field(default_factory=set)  # layer mounts live processes are making
    gen: str | None = None  # the blob source's generation (None: no sandbox needs a layer)
    stale: set[str] = field(default_factory=set)  # layers to mount again
    redo: list[Sandbox] = field(default_factory=list)  # sandboxes whose overlay is made again
    failed: dict[str, str] = field(default_factory=dict)  # layers that could not be mounted again
    layer_now: dict[str, LayerMount] = field(default_factory=dict)  # the layer records after repair

    @property
    def busy(self) -> list[Sandbox]:
        return list(self.inflight.values())

    @property
    def ids(self) -> set[str]:
        return {sb.id for sb in self.live + self.busy}


def recover(lifecycle: SandboxLifecycle, blobs: BlobSource,
            backends: Mapping[str, SandboxBackend]) -> RecoverReport:
    """Caller holds the node lock. `lifecycle` brings the node's paths, state and layer mounts;
    `blobs` is the blob source the layers are mounted from (the node daemon, restarted here if it
    died); `backends` are looked through for leftover containers. Runs the phases in the order
    of the module's docstring; each says what it repairs."""
    rep = RecoverReport()
    _forget_earlier_boot(lifecycle.state, rep)
    pic = _Picture(_settle_pending(lifecycle, rep, linux.read_mounts()))
    _mark_lost(lifecycle, blobs, rep)  # (before the sandboxes are read: their remount writes them back)
    pic.live = _adopt_records(lifecycle, rep, pic.inflight)
    _find_stale(lifecycle, blobs, pic, rep)
    _remount_layers(lifecycle, pic, rep)
    _remount_sandboxes(lifecycle, pic, rep)
    _detach_orphans(lifecycle, pic, rep)
    _reconcile_pins(lifecycle.layers, blobs, pic.layer_now)
    if not pic.live and not pic.busy:
        lifecycle.release_roots()
    rep.deleted_containers = _leftover_workloads(backends, pic.ids)
    rep.unrecorded = records.unrecorded(lifecycle.paths, pic.ids)
    with lifecycle.state.write() as t:
        t.put_boot(boot_id())
    return rep


def _adopt_records(lifecycle: SandboxLifecycle, rep: RecoverReport, inflight: dict[str, Sandbox]) -> list[Sandbox]:
    """Repairs a lost or rebuilt database: adopts the sandboxes whose record (on their directory)
    it does not know; finishes every teardown that had begun (status `unmounting`, or the
    directory already in the trash); empties the trash of dead processes. Returns the node's
    sandboxes (those of live processes' operations left out)."""
    paths, state = lifecycle.paths, lifecycle.state
    in_trash = records.trashed_ids(paths)
    with state.read() as t:
        known = {sb.id: sb for sb in t.sandboxes() if sb.id not in inflight}
    lost = [sb for sb in records.scan(paths) if sb.id not in known and sb.id not in inflight]
    if lost:
        with state.write() as t:
            for sb in lost:
                if sb.status == UNMOUNTING or (sb.owned and sb.id in in_trash):
                    continue
                t.put_sandbox(sb)
                known[sb.id] = sb
                rep.adopted.append(sb.id)

    for sb in list(known.values()):
        if sb.status == UNMOUNTING or (sb.owned and sb.id in in_trash):
            lifecycle.teardown(sb)
            rep.finished_teardowns.append(sb.id)
            del known[sb.id]
    rep.trash_emptied = records.empty_trash(paths, only_dead=True)
    return list(known.values())


def _mark_lost(lifecycle: SandboxLifecycle, blobs: BlobSource, rep: RecoverReport) -> None:
    """Repairs what a dead daemon left, after saying what it took: marks lost the sandboxes stacked
    on layers that read through the FUSE mount of a daemon other than the healthy one (the watch
    does it when one runs; else this is the first to see it: `nodestate.lost`), then detaches a
    dead FUSE mount, also when no sandbox needs a daemon now (nothing else would)."""
    paths = lifecycle.paths
    with lifecycle.state.write() as t:
        loss = mark_lost(t, str(paths.fuse), blobs.generation(), time.time())
    rep.lost = {sb.id: sb.lost for sb in loss.sandboxes}
    rep.dead_mounts = blobs.clear_dead()


def _find_stale(lifecycle: SandboxLifecycle, blobs: BlobSource, pic: _Picture, rep: RecoverReport) -> None:
    """Repairs a dead blob source (a killed daemon's dead FUSE mount is detached, a new daemon
    started) and finds what it broke: the layer mounts that are missing or made from a previous
    daemon's files, and the sandboxes stacked on them or missing their overlay. A layer mount a
    live process is making (claimed, outside the lock) is theirs to finish."""
    pic.needed = {blob for sb in pic.live + pic.busy for blob in sb.layers}
    mounts = linux.read_mounts()
    with lifecycle.state.read() as t:
        pic.layer_recs = {lm.blob: lm for lm in t.layers()}
    if pic.needed:
        pic.gen = blobs.ensure()  # restarts a dead daemon (detaching its dead mount first)
    rep.daemon_generation = gen = pic.gen
    pic.claimed = {blob for blob, lm in pic.layer_recs.items() if lm.in_flight}

    def layer_ok(blob: str) -> bool:
        lm = pic.layer_recs.get(blob)
        if lm is None or lm.status != MOUNTED or not lm.current(gen):  # a direct mount needs no daemon
            return False
        m = mounts.get(lm.mountpoint)
        return m is not None and m.fstype == "erofs"

    pic.stale = {blob for blob in pic.needed if blob not in pic.claimed and not layer_ok(blob)}
    for sb in pic.live:
        m = mounts.get(sb.target)
        intact = (m is not None and m.fstype == "overlay" and f"upperdir={sb.upper}," in m.options + ","
                  and sb.status == MOUNTED)
        if sb.backend:  # composed in a guest: its layer mounts (above) are all the host has of it
            continue
        if not intact or pic.stale.intersection(sb.layers):
            pic.redo.append(sb)


def _remount_layers(lifecycle: SandboxLifecycle, pic: _Picture, rep: RecoverReport) -> None:
    """Repairs the layer mounts: detaches the overlays to redo and the stale layers (lazily: a
    process still inside keeps its detached view), mounts the layers again, recounts every
    layer's references from the sandboxes, and unmounts the layers nobody uses."""
    paths, state, layers = lifecycle.paths, lifecycle.state, lifecycle.layers
    for sb in pic.redo:
        detach(sb.target)
    for blob in pic.stale:
        detach(paths.layer_mount(blob))

    refs = Counter(blob for sb in pic.live + pic.busy for blob in sb.layers)
    fresh: dict[str, LayerMount] = {}
    for blob in sorted(pic.stale):
        try:
            fresh[blob] = layers.mount(blob, pic.gen or "")
            rep.remounted_layers.append(blob)
        except LayerstoreError as e:
            pic.failed[blob] = str(e)
    with state.write() as t:
        for blob in pic.needed:
            lm = fresh.get(blob) or pic.layer_recs.get(blob)
            if blob in pic.failed or lm is None:
                t.delete_layer(blob)
                continue
            lm.refs = refs[blob]
            t.put_layer(lm)
        for blob, lm in pic.layer_recs.items():
            if blob not in pic.needed and blob not in pic.claimed:
                layers.unmount(lm)  # (and its pin, for a direct mount)
                t.delete_layer(blob)
                rep.unmounted_layers.append(blob)
    with state.read() as t:
        pic.layer_now = {lm.blob: lm for lm in t.layers()}


def _remount_sandboxes(lifecycle: SandboxLifecycle, pic: _Picture, rep: RecoverReport) -> None:
    """Repairs the sandboxes' roots: mounts each one to redo again (its kept upper's image first,
    then the overlay) with the SAME upper and work directories; one whose layer could not be
    mounted, or whose overlay fails, is marked broken with the reason."""
    paths = lifecycle.paths
    if any(lifecycle.under_roots(sb.target) for sb in pic.redo):
        lifecycle.ensure_roots()
    for sb in pic.redo:
        bad = [b for b in sb.layers if b in pic.failed]
        try:
            if bad:
                raise LayerstoreError(pic.failed[bad[0]])
            # the target may be a caller's directory that was removed meanwhile
            os.makedirs(sb.target, 0o755, exist_ok=True)
            image = paths.upper_image(sb.id)
            if sb.owned and image.exists():  # the upper's own filesystem first (unless still mounted)
                mount_upper_image(image, paths.scratch(sb.id))
            mount_overlay(sb.target, [pic.layer_now[b].mountpoint for b in reversed(sb.layers)], sb.upper, sb.work)
        except (LayerstoreError, OSError) as e:
            sb.status, sb.error = BROKEN, str(e)
            rep.broken[sb.id] = str(e)
        else:
            sb.status, sb.error = MOUNTED, ""
            rep.remounted_sandboxes.append(sb.id)
        with lifecycle.state.write() as t:
            t.put_sandbox(sb)


def _detach_orphans(lifecycle: SandboxLifecycle, pic: _Picture, rep: RecoverReport) -> None:
    """Repairs leftovers nobody owns: layer mounts under NODE/layers that no layer record names,
    and overlays under the node directory (or on its uppers) that are no sandbox's root."""
    paths = lifecycle.paths
    mounts = linux.read_mounts()
    live_targets = {sb.target for sb in pic.live + pic.busy}
    layer_points = {lm.mountpoint for lm in pic.layer_now.values()}
    node_sb = str(paths.sandboxes) + "/"
    node_roots = str(paths.roots) + "/"
    for m in linux.mounts_under(mounts, str(paths.layers)):
        if m.mountpoint != str(paths.layers) and m.mountpoint not in layer_points:
            detach(m.mountpoint)
            rmdir_quiet(m.mountpoint)
            rep.orphan_mounts.append(m.mountpoint)
    for m in sorted(mounts.values(), key=lambda m: m.mountpoint.count("/"), reverse=True):
        if m.fstype != "overlay" or m.mountpoint in live_targets:
            continue
        on_node = (m.mountpoint.startswith((node_sb, node_roots)) or f"upperdir={node_sb}" in m.options)
        if on_node:
            detach(m.mountpoint)
            rep.orphan_mounts.append(m.mountpoint)


def _reconcile_pins(layers: LayerMounts, blobs: BlobSource, records_now: dict[str, LayerMount]) -> None:
    """Unpin the shim's pins of this node that no layer record holds (a crash between a pin and
    the record of its mount, or an unpin that failed); a claimant still mounting keeps its pin."""
    held = {lm.pin for lm in records_now.values() if lm.pin}
    busy = {layers.holder(lm.blob) for lm in records_now.values() if lm.in_flight}
    try:
        pins = blobs.pins(layers.holder_prefix)
    except LayerstoreError:
        return
    for blob, holder in pins:
        if holder not in held and holder not in busy:
            with contextlib.suppress(LayerstoreError):
                blobs.unpin(blob, holder)


def _leftover_workloads(backends: Mapping[str, SandboxBackend], live: set[str]) -> list[str]:
    """Workloads (containers) whose sandbox is gone, or which have stopped, are deleted (for
    the container backend `runtime delete --force`, which also removes their cgroup); a running
    container of a live sandbox is not recovery's to stop. Asks each backend for the sandboxes it
    keeps state for (the container backend: its state directory under NODE/oci). Returns
    "<backend>:<sandbox>" for each one deleted."""
    out = []
    for name, backend in backends.items():
        ids = backend.leftovers()
        if not ids:
            continue
        try:
            backend.check()
        except RuntimeNotAvailable:
            continue
        for sid in ids:
            if sid in live and backend.status(sid) != "stopped":
                continue
            try:
                backend.delete(sid)
            except (OSError, ShimError):
                continue
            out.append(f"{name}:{sid}")
    return out
