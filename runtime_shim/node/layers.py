"""Per-node layer mounts, reference-counted: each layer blob's EROFS image is mounted once
(file-backed, read-only) under NODE/layers/<hex> and shared by every sandbox that stacks it, so
the kernel keeps one page cache per layer per node. `refs` counts the sandboxes in the state that
stack the layer, mounted or being mounted; the mount goes away with the last one.

A cold layer mount waits for the node daemon to fetch the blob's chunk map and metadata, so it
is not made under the node lock. The first mount of a sandbox that needs the layer *claims* it
(`take`, in the transaction that records the sandbox, under the node lock: the layer's record
says `mounting` and names the process) and takes the blob's lock file; it mounts outside the node
lock and `settle`s the outcome under it. Everyone else who needs the layer meanwhile takes a
reference in the same way and waits on the blob's lock file (`Shim._layers_ready`). A claim whose
process died is taken over by the next one to look (or by recovery).

Callers of `take`, `settle` and `release` hold the node lock and pass the open write transaction,
so the counts and the sandbox records change together.

A layer whose blob is complete in the node cache is mounted *directly* on the cache's data file
(pinned for the mount's lifetime, holder `shim:<mountpoint>`, buffered): no FUSE hop, and a mount
that survives the daemon (recovery does not redo it when the daemon restarts). The pin goes
after the unmount, with the last reference; recovery unpins the shim's pins that no layer record
holds (a crash between pin and record).

A layer whose blob is only partly cached is, on the fanotify data path (docs/fanotify.md), mounted
directly on the cache's sparse file too, *attached* (the daemon marked the file and filled its
metadata first; it fills the rest on the kernel's pre-content events): generation `fanotify:<id>`,
which survives daemon restarts. Detached after the unmount. Else it is mounted on the daemon's
FUSE file.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

from layerstore import linux
from layerstore.errors import LayerstoreError
from layerstore.fileio import rmdir_quiet
from layerstore.linux import detach

from ..errors import ShimError
from ..nodestate.paths import NodePaths
from ..nodestate.state import ATTACHED_PREFIX, MOUNTED, MOUNTING, LayerMount, Txn, fuse_generation, this_process
from .blobs import BlobSource
from .overlay import SAFE, explain

log = logging.getLogger("layerstore.shim.layers")

DIRECT = "direct"  # the generation of a direct mount: it reads no daemon's file
CLAIMED = "claimed"
PIN_PREFIX = "shim:"


def mount_layer(image: str | os.PathLike[str], target: str | os.PathLike[str], options: str) -> None:
    """File-backed EROFS, read-only, nosuid and nodev: a layer's setuid binaries and device
    nodes give nothing to whoever reaches the layer mount."""
    linux.mount(image, target, "erofs", linux.MS_RDONLY | SAFE, options)


class LayerMounts:
    def __init__(self, paths: NodePaths, blobs: BlobSource) -> None:
        self.paths = paths
        self.blobs = blobs

    def holder(self, blob: str) -> str:
        """The pin holder name of the layer's direct mount (names the mount it stands for)."""
        return f"{PIN_PREFIX}{self.paths.layer_mount(blob)}"

    @property
    def holder_prefix(self) -> str:
        """What every pin holder of this node's layer mounts starts with."""
        return f"{PIN_PREFIX}{self.paths.layers}/"

    def mount(self, blob: str, generation: str) -> LayerMount:
        """Mount one layer at its node path (detaching whatever a crash left there first):
        directly on the blob's cache file when the blob is complete on the node (pinned, buffered:
        a local file; independent of the daemon), else on the blob source's file."""
        mp = self.paths.layer_mount(blob)
        mp.mkdir(mode=0o755, exist_ok=True)
        detach(mp)
        direct = self._mount_direct(blob, mp) or self._mount_attached(blob, mp)
        if direct is not None:
            return direct
        source = self.blobs.path(blob)
        try:
            mount_layer(source, mp, self.blobs.erofs_options)
        except linux.MountError as e:
            rmdir_quiet(mp)
            if not os.path.exists(source):
                raise ShimError(f"layer {blob}: no image file at {source}") from None
            raise ShimError(f"layer {blob}: {explain(e)}") from None
        return LayerMount(blob, str(mp), str(source), 0, fuse_generation(generation))

    def _mount_direct(self, blob: str, mp: Path) -> LayerMount | None:
        holder = self.holder(blob)
        try:
            local = self.blobs.pin(blob, holder)
        except LayerstoreError:  # (the pin may or may not be recorded: take it back; else recovery does)
            with contextlib.suppress(LayerstoreError):
                self.blobs.unpin(blob, holder)
            return None
        if local is None:
            return None
        try:
            mount_layer(local, mp, "")  # buffered: a local file keeps the disk's readahead
        except linux.MountError:
            with contextlib.suppress(LayerstoreError):
                self.blobs.unpin(blob, holder)
            return None
        return LayerMount(blob, str(mp), str(local), 0, DIRECT, pin=holder)

    def _mount_attached(self, blob: str, mp: Path) -> LayerMount | None:
        attach = getattr(self.blobs, "attach", None)
        if attach is None:
            return None
        holder = self.holder(blob)
        try:
            got = attach(blob, holder)
        except LayerstoreError:  # (the FUSE file says why, if it fails too)
            return None
        if got is None:
            return None
        path, generation = got
        try:
            mount_layer(path, mp, "")  # buffered: the daemon's writes land in the file's page cache
        except linux.MountError:
            with contextlib.suppress(LayerstoreError):
                self.blobs.detach(blob, holder)  # type: ignore[attr-defined]
            return None
        return LayerMount(blob, str(mp), str(path), 0, generation)

    def unmount(self, lm: LayerMount) -> None:
        """Unmount first, then drop the pin of a direct mount (never the other way round: the
        cache may reuse an unpinned file), or the attachment of a fanotify one. A busy mount
        is detached lazily and keeps both: a process left reading through it (or through a
        sandbox's overlay detached lazily above it) must never read a range the cache punched
        once unpinned or detached (docs/fanotify.md, window 7). The pin stays until the shim's
        next recovery reconciles pins (`recover._reconcile_pins`); the attachment, persisted by
        the daemon, stays until it is detached by hand. Logged, as both hold cache space."""
        how = linux.detach_how(lm.mountpoint)
        rmdir_quiet(lm.mountpoint)
        if how == linux.DETACHED_LAZILY and (lm.pin or lm.generation.startswith(ATTACHED_PREFIX)):
            log.warning("layer %s: its mount %s was busy and was detached lazily; blob %s stays %s (a process may "
                        "still read through the detached mount)", lm.blob, lm.mountpoint, lm.blob,
                        "pinned" if lm.pin else "attached")
            return
        if lm.generation.startswith(ATTACHED_PREFIX):
            with contextlib.suppress(LayerstoreError, AttributeError):
                self.blobs.detach(lm.blob, self.holder(lm.blob))  # type: ignore[attr-defined]
        if lm.pin:
            with contextlib.suppress(LayerstoreError):  # (left for recovery's reconciliation)
                self.blobs.unpin(lm.blob, lm.pin)

    def take(self, t: Txn, blob: str, generation: str) -> str:
        """One more reference on the layer. Returns CLAIMED when the caller claimed its mount
        (nobody has mounted it or is mounting it: it must mount it and `settle` the outcome),
        MOUNTED when it is mounted, MOUNTING when another claimant is mounting it."""
        if t.ref_if_mounted(blob):
            return MOUNTED
        lm = t.layer(blob)
        claimed = lm is None or (lm.status == MOUNTING and not lm.in_flight)
        if lm is None:
            lm = LayerMount(blob, str(self.paths.layer_mount(blob)), str(self.blobs.path(blob)), 0, generation,
                            MOUNTING)
        if claimed:
            lm.owner, lm.error, lm.generation = this_process(), "", generation
        lm.refs += 1
        t.put_layer(lm)
        return CLAIMED if claimed else lm.status

    def settle(self, t: Txn, blob: str, mounted: LayerMount | None, error: str = "") -> None:
        """Record the outcome of a claimed mount: `mounted`, or failed with `error` (the waiters
        fail with it; the next mount that needs the layer claims it again), or (neither) never
        tried."""
        lm = t.layer(blob)
        if lm is None:  # (recovery gave up on it meanwhile; nobody references our mount)
            if mounted is not None:
                self.unmount(mounted)
            return
        if mounted is not None:
            lm.status, lm.source, lm.generation, lm.error = MOUNTED, mounted.source, mounted.generation, ""
            lm.pin = mounted.pin
        else:
            lm.error = error  # "" = abandoned before it was tried: a waiter takes it over
        lm.owner = None
        t.put_layer(lm)

    def release(self, t: Txn, blob: str) -> None:
        lm = t.layer(blob)
        if lm is None:
            return
        lm.refs -= 1
        if lm.refs > 0:
            t.put_layer(lm)
            return
        self.unmount(lm)
        t.delete_layer(blob)
