"""`recover()`: rebuild the node's picture after a crash of the shim or of the node daemon.

Desired state = every sandbox in the state database, plus every sandbox whose record file
(NODE/sandboxes/<id>/sandbox.json) survived a lost database. Actual state = one read of
/proc/self/mountinfo and the daemon's health. Recovery then, in this order:

1. finishes every teardown a crash interrupted (status `unmounting`, or the sandbox's directory
   already moved to NODE/sandboxes/.trash), then empties the trash;
3. makes the blob source healthy: a killed daemon leaves a dead FUSE mount (ENOTCONN), which is
   detached before a new daemon starts;
4. finds the stale layer mounts (missing, or made from a previous daemon's files) and the sandboxes
   stacked on them or missing their overlay; detaches those overlays and layers (lazily: a
   process still inside keeps its detached view), mounts the layers again, then the overlays
   again with the SAME upper and work directories;
5. recounts every layer's references from the sandboxes, unmounts layers nobody uses, and
   detaches orphan mounts (layer mounts and overlays under the node directory that no sandbox owns).

Upper directories are never written or deleted here.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from layerstore.errors import LayerstoreError

from . import mountinfo, records
from .overlay import detach, mount_overlay, rmdir_quiet
from .state import BROKEN, MOUNTED, UNMOUNTING, LayerMount

if TYPE_CHECKING:
    from .shim import Shim


@dataclass
class RecoverReport:
    adopted: list[str] = field(default_factory=list)  # sandboxes rebuilt from their record files
    finished_teardowns: list[str] = field(default_factory=list)
    remounted_layers: list[str] = field(default_factory=list)
    remounted_sandboxes: list[str] = field(default_factory=list)
    broken: dict[str, str] = field(default_factory=dict)
    unmounted_layers: list[str] = field(default_factory=list)
    orphan_mounts: list[str] = field(default_factory=list)
    trash_emptied: int = 0
    daemon_generation: str | None = None

    @property
    def changed(self) -> bool:
        return bool(self.adopted or self.finished_teardowns or self.remounted_layers or self.remounted_sandboxes
                    or self.broken or self.unmounted_layers or self.orphan_mounts or self.trash_emptied)

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()}


def recover(shim: Shim) -> RecoverReport:
    """Caller holds the node lock."""
    paths, rep = shim.paths, RecoverReport()
    in_trash = records.trashed_ids(paths)

    with shim.state.read() as t:
        known = {sb.id: sb for sb in t.sandboxes()}
    lost = [sb for sb in records.scan(paths) if sb.id not in known]
    if lost:
        with shim.state.write() as t:
            for sb in lost:
                if sb.status == UNMOUNTING:
                    continue
                t.put_sandbox(sb)
                known[sb.id] = sb
                rep.adopted.append(sb.id)

    for sb in list(known.values()):
        if sb.status == UNMOUNTING or (sb.owned and sb.id in in_trash):
            shim._teardown(sb)
            rep.finished_teardowns.append(sb.id)
            del known[sb.id]
    rep.trash_emptied = records.empty_trash(paths)

    live = list(known.values())
    needed: set[str] = {blob for sb in live for blob in sb.layers}
    mounts = mountinfo.read()
    with shim.state.read() as t:
        layer_recs = {lm.blob: lm for lm in t.layers()}

    gen: str | None = None
    if needed:
        gen = shim.blobs.ensure()  # restarts a dead daemon (detaching its dead mount first)
    rep.daemon_generation = gen

    def layer_ok(blob: str) -> bool:
        lm = layer_recs.get(blob)
        if lm is None or lm.generation != gen:
            return False
        m = mounts.get(lm.mountpoint)
        return m is not None and m.fstype == "erofs"

    stale = {blob for blob in needed if not layer_ok(blob)}
    redo = []
    for sb in live:
        m = mounts.get(sb.target)
        intact = (m is not None and m.fstype == "overlay" and f"upperdir={sb.upper}," in m.options + ","
                  and sb.status == MOUNTED)
        if not intact or stale.intersection(sb.layers):
            redo.append(sb)

    for sb in redo:
        detach(sb.target)
    for blob in stale:
        detach(paths.layer_mount(blob))

    refs = Counter(blob for sb in live for blob in sb.layers)
    fresh: dict[str, LayerMount] = {}
    failed: dict[str, str] = {}
    for blob in sorted(stale):
        try:
            fresh[blob] = shim.layers.mount(blob, gen or "")
            rep.remounted_layers.append(blob)
        except LayerstoreError as e:
            failed[blob] = str(e)
    with shim.state.write() as t:
        for blob in needed:
            lm = fresh.get(blob) or layer_recs.get(blob)
            if blob in failed or lm is None:
                t.delete_layer(blob)
                continue
            lm.refs = refs[blob]
            t.put_layer(lm)
        for blob, lm in layer_recs.items():
            if blob not in needed:
                detach(lm.mountpoint)
                rmdir_quiet(lm.mountpoint)
                t.delete_layer(blob)
                rep.unmounted_layers.append(blob)

    with shim.state.read() as t:
        layer_now = {lm.blob: lm for lm in t.layers()}
    for sb in redo:
        bad = [b for b in sb.layers if b in failed]
        try:
            if bad:
                raise LayerstoreError(failed[bad[0]])
            # the target may be a caller's directory that was removed meanwhile
            os.makedirs(sb.target, 0o755, exist_ok=True)
            mount_overlay(sb.target, [layer_now[b].mountpoint for b in reversed(sb.layers)], sb.upper, sb.work)
        except (LayerstoreError, OSError) as e:
            sb.status, sb.error = BROKEN, str(e)
            rep.broken[sb.id] = str(e)
        else:
            sb.status, sb.error = MOUNTED, ""
            rep.remounted_sandboxes.append(sb.id)
        with shim.state.write() as t:
            t.put_sandbox(sb)

    # Orphans: mounts under the node directory (or overlays on its uppers) that nobody owns.
    mounts = mountinfo.read()
    live_targets = {sb.target for sb in live}
    layer_points = {lm.mountpoint for lm in layer_now.values()}
    node_sb = str(paths.sandboxes) + "/"
    for m in mountinfo.under(mounts, str(paths.layers)):
        if m.mountpoint != str(paths.layers) and m.mountpoint not in layer_points:
            detach(m.mountpoint)
            rmdir_quiet(m.mountpoint)
            rep.orphan_mounts.append(m.mountpoint)
    for m in sorted(mounts.values(), key=lambda m: m.mountpoint.count("/"), reverse=True):
        if m.fstype != "overlay" or m.mountpoint in live_targets:
            continue
        on_node = m.mountpoint.startswith(node_sb) or f"upperdir={node_sb}" in m.options
        if on_node:
            detach(m.mountpoint)
            rep.orphan_mounts.append(m.mountpoint)
    return rep
