"""Per-node layer mounts, reference-counted: each layer blob's EROFS image is mounted once
(file-backed, read-only) under NODE/layers/<hex> and shared by every sandbox that stacks it, so
the kernel keeps one page cache per layer per node. `refs` counts the sandboxes in the state
that use the layer; the mount goes away with the last one.

Callers hold the node lock and pass the open write transaction, so the count and the sandbox
records change together.
"""

from __future__ import annotations

import contextlib
import os

from layerstore import sysmount

from .blobs import BlobSource
from .errors import ShimError
from .overlay import detach, explain, rmdir_quiet
from .paths import NodePaths
from .state import LayerMount, Txn


class LayerMounts:
    def __init__(self, paths: NodePaths, blobs: BlobSource) -> None:
        self.paths = paths
        self.blobs = blobs

    def mount(self, blob: str, generation: str) -> LayerMount:
        """Mount one layer at its node path (detaching whatever a crash left there first)."""
        mp = self.paths.layer_mount(blob)
        mp.mkdir(mode=0o755, exist_ok=True)
        detach(mp)
        source = self.blobs.path(blob)
        try:
            sysmount.mount_erofs(source, mp, self.blobs.erofs_options)
        except sysmount.MountError as e:
            rmdir_quiet(mp)
            if not os.path.exists(source):
                raise ShimError(f"layer {blob}: no image file at {source}") from None
            raise ShimError(f"layer {blob}: {explain(e)}") from None
        return LayerMount(blob, str(mp), str(source), 0, generation)

    def unmount(self, lm: LayerMount) -> None:
        detach(lm.mountpoint)
        rmdir_quiet(lm.mountpoint)

    def acquire(self, t: Txn, blob: str, generation: str) -> LayerMount:
        lm = t.layer(blob)
        if lm is None:
            lm = self.mount(blob, generation)
        lm.refs += 1
        t.put_layer(lm)
        return lm

    def acquire_all(self, t: Txn, blobs: list[str], generation: str) -> list[LayerMount]:
        """All or nothing: on failure the layers acquired so far are released again."""
        done: list[LayerMount] = []
        try:
            for blob in blobs:
                done.append(self.acquire(t, blob, generation))
        except BaseException:
            for lm in reversed(done):
                with contextlib.suppress(Exception):
                    self.release(t, lm.blob)
            raise
        return done

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
