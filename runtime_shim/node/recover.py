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
3. makes the blob source healthy: a killed daemon leaves a dead FUSE mount (ENOTCONN), which is
   detached before a new daemon starts;
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
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import lmdb

from fuse_client import linux
from fuse_client.linux import detach
from layerstore.errors import CorruptObject, LayerstoreError
from layerstore.fileio import rmdir_quiet

from ..backends.base import SandboxBackend
from ..errors import RuntimeNotAvailable, ShimError
from . import records
from .blobs import BlobSource
from .layers import LayerMounts
from .lifecycle import SandboxLifecycle
from .overlay import mount_overlay, mount_upper_image
from .state import BROKEN, MOUNTED, UNMOUNTING, LayerMount, NodeState, Sandbox, boot_id


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
    trash_emptied: int = 0
    rebooted: bool = False  # the database belonged to an earlier boot and was rebuilt from the records
    daemon_generation: str | None = None
    reason: str = ""  # why a start-up ran the full recovery ("" when asked for explicitly)

    @property
    def changed(self) -> bool:
        return bool(self.adopted or self.rolled_back or self.finished_teardowns or self.remounted_layers
                    or self.remounted_sandboxes or self.broken or self.unmounted_layers or self.orphan_mounts
                    or self.deleted_containers or self.trash_emptied or self.rebooted)

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()}


def _forget_earlier_boot(state: NodeState, rep: RecoverReport) -> None:
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
    """Settle the operations of dead processes; returns the sandboxes live processes are working
    on (a teardown unmounting its root outside the lock), which recovery leaves alone."""
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


def recover(lifecycle: SandboxLifecycle, blobs: BlobSource,
            backends: Mapping[str, SandboxBackend]) -> RecoverReport:
    """Caller holds the node lock. `lifecycle` brings the node's paths, state and layer mounts;
    `blobs` is the blob source the layers are mounted from (the node daemon, restarted here if it
    died); `backends` are looked through for leftover containers."""
    paths, state, layers, rep = lifecycle.paths, lifecycle.state, lifecycle.layers, RecoverReport()
    _forget_earlier_boot(state, rep)
    inflight = _settle_pending(lifecycle, rep, linux.read_mounts())
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

    live = list(known.values())
    busy = list(inflight.values())  # counted (their layers stay), never touched
    needed: set[str] = {blob for sb in live + busy for blob in sb.layers}
    mounts = linux.read_mounts()
    with state.read() as t:
        layer_recs = {lm.blob: lm for lm in t.layers()}

    gen: str | None = None
    if needed:
        gen = blobs.ensure()  # restarts a dead daemon (detaching its dead mount first)
    rep.daemon_generation = gen

    # Layer mounts live processes are making (claimed, outside the lock): theirs to finish.
    claimed = {blob for blob, lm in layer_recs.items() if lm.in_flight}

    def layer_ok(blob: str) -> bool:
        lm = layer_recs.get(blob)
        if lm is None or lm.status != MOUNTED or not lm.current(gen):  # a direct mount needs no daemon
            return False
        m = mounts.get(lm.mountpoint)
        return m is not None and m.fstype == "erofs"

    stale = {blob for blob in needed if blob not in claimed and not layer_ok(blob)}
    redo = []
    for sb in live:
        m = mounts.get(sb.target)
        intact = (m is not None and m.fstype == "overlay" and f"upperdir={sb.upper}," in m.options + ","
                  and sb.status == MOUNTED)
        if sb.backend:  # composed in a guest: its layer mounts (above) are all the host has of it
            continue
        if not intact or stale.intersection(sb.layers):
            redo.append(sb)

    for sb in redo:
        detach(sb.target)
    for blob in stale:
        detach(paths.layer_mount(blob))

    refs = Counter(blob for sb in live + busy for blob in sb.layers)
    fresh: dict[str, LayerMount] = {}
    failed: dict[str, str] = {}
    for blob in sorted(stale):
        try:
            fresh[blob] = layers.mount(blob, gen or "")
            rep.remounted_layers.append(blob)
        except LayerstoreError as e:
            failed[blob] = str(e)
    with state.write() as t:
        for blob in needed:
            lm = fresh.get(blob) or layer_recs.get(blob)
            if blob in failed or lm is None:
                t.delete_layer(blob)
                continue
            lm.refs = refs[blob]
            t.put_layer(lm)
        for blob, lm in layer_recs.items():
            if blob not in needed and blob not in claimed:
                layers.unmount(lm)  # (and its pin, for a direct mount)
                t.delete_layer(blob)
                rep.unmounted_layers.append(blob)

    with state.read() as t:
        layer_now = {lm.blob: lm for lm in t.layers()}
    if any(lifecycle.under_roots(sb.target) for sb in redo):
        lifecycle.ensure_roots()
    for sb in redo:
        bad = [b for b in sb.layers if b in failed]
        try:
            if bad:
                raise LayerstoreError(failed[bad[0]])
            # the target may be a caller's directory that was removed meanwhile
            os.makedirs(sb.target, 0o755, exist_ok=True)
            image = paths.upper_image(sb.id)
            if sb.owned and image.exists():  # the upper's own filesystem first (unless still mounted)
                mount_upper_image(image, paths.scratch(sb.id))
            mount_overlay(sb.target, [layer_now[b].mountpoint for b in reversed(sb.layers)], sb.upper, sb.work)
        except (LayerstoreError, OSError) as e:
            sb.status, sb.error = BROKEN, str(e)
            rep.broken[sb.id] = str(e)
        else:
            sb.status, sb.error = MOUNTED, ""
            rep.remounted_sandboxes.append(sb.id)
        with state.write() as t:
            t.put_sandbox(sb)

    # Orphans: mounts under the node directory (or overlays on its uppers) that nobody owns.
    mounts = linux.read_mounts()
    live_targets = {sb.target for sb in live + busy}
    layer_points = {lm.mountpoint for lm in layer_now.values()}
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

    _reconcile_pins(layers, blobs, layer_now)
    if not live and not busy:
        lifecycle.release_roots()
    rep.deleted_containers = _leftover_workloads(backends, {sb.id for sb in live + busy})
    rep.unrecorded = records.unrecorded(paths, {sb.id for sb in live + busy})
    with state.write() as t:
        t.put_boot(boot_id())
    return rep


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
