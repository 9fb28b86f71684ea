"""Remote layers: a layerstore blob's EROFS image mounted read-only under SNAP/layers/<hex>, made
exactly as the runtime shim makes its layer mounts (`runtime_shim.layers.LayerMounts.mount`:
direct and pinned on the node cache's file when the blob is complete on the node, else file-backed
on the node daemon's lazily fetched blob file), from the node's one daemon (started and supervised
as the shim does, under the node lock). See docs/snapshotter.md for why the mounts are the
snapshotter's own and not the shim's NODE/layers.

A layer mount is not reference-counted here: the snapshot records naming the blob are its
references (`Snapshotter` unmounts a layer when the last one goes, and `reconcile` repairs
whatever a crash left in between).
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path
from typing import Any

from fuse_client import linux
from fuse_client.linux import detach
from layerstore.errors import BadInput, LayerstoreError, PermissionDenied
from layerstore.fileio import rmdir_quiet
from runtime_shim.blobs import BlobSource, DaemonBlobs
from runtime_shim.environment import CachingResolver, node_policy
from runtime_shim.layers import LayerMounts
from runtime_shim.lock import NodeLock
from runtime_shim.paths import NodePaths
from runtime_shim.state import LayerMount, NodeState


class RemoteLayers:
    """`root`: SNAP (its layers/ holds the mounts). `blobs`: where blob files come from (the node
    daemon in production; a directory of images in tests); `lock`: held while the blob source is
    made ready (the node lock for the daemon)."""

    def __init__(self, root: Path, blobs: BlobSource, lock: NodeLock | None = None,
                 state: NodeState | None = None, resolver: CachingResolver | None = None) -> None:
        self.paths = NodePaths(root)
        self.paths.layers.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.blobs = blobs
        self.mounts = LayerMounts(self.paths, blobs)
        self.lock = lock
        self.resolver = resolver
        self._state = state
        self._hint_mu = threading.Lock()
        self._hinted: set[str] = set()

    @classmethod
    def for_node(cls, root: Path, node: NodePaths, store_url: str | None = None) -> RemoteLayers:
        """Blobs from the node daemon of `node` (started on first use) serving `store_url`; without
        one, the store of the daemon already running, else the default store."""
        from layerstore.config import resolve_store_url
        from layerstore.store import Store

        node.create()
        state = NodeState(node.state)
        try:
            if store_url is None:
                with state.read() as t:
                    rec = t.daemon()
                store_url = rec.store if rec is not None else resolve_store_url(None)
            store = Store.open(store_url)
        except BaseException:
            state.close()
            raise
        resolver = CachingResolver(store, node_policy(node.root, None))
        return cls(root, DaemonBlobs(node, state, store.url), NodeLock(node.lock), state, resolver)

    def close(self) -> None:
        if self._state is not None:
            self._state.close()
            self._state = None
        if self.resolver is not None:
            self.resolver.close()
            self.resolver = None

    def check(self, blob: str, environment: str) -> tuple[int, ...]:
        """May a client have this blob mounted? With the environment it came from (its manifest
        digest), the node's trust policy must accept that environment (signatures, as for the
        shim) and the blob must be one of its layers; without one, only when the node's policy
        requires nothing. Without a store to read (tests), anything goes. Returns the environment's
        prefetch hints for the blob (chunk indexes in first-access order; () if none)."""
        if self.resolver is None:
            return ()
        if not environment:
            if self.resolver.policy is not None:
                raise PermissionDenied(f"layer {blob}: the node's trust policy needs the environment it belongs to "
                                       f"(pull with layerctl ctr pull)")
            return ()
        spec = self.resolver(environment)
        if blob not in spec.blobs:
            raise BadInput(f"layer {blob} is not a layer of environment {environment}")
        return tuple(spec.prefetch.get(blob, ()))

    def hint(self, blob: str, chunks: tuple[int, ...]) -> None:
        """Ask the daemon for the blob's hinted chunks in the background (below demand reads), once
        per blob per process: an optimisation, so failures are ignored."""
        with self._hint_mu:
            if not chunks or blob in self._hinted:
                return
            self._hinted.add(blob)

        def send() -> None:
            with contextlib.suppress(Exception):
                self.blobs.prefetch(blob, list(chunks))

        threading.Thread(target=send, name="snapshotter-hints", daemon=True).start()

    def mountpoint(self, blob: str) -> str:
        return str(self.paths.layer_mount(blob))

    def generation(self) -> str:
        """Make the blob source ready (start the daemon if needed); its generation."""
        if self.lock is None:
            return self.blobs.ensure()
        with self.lock:
            return self.blobs.ensure()

    def usable(self, rec: dict[str, Any] | None, generation: str | None) -> bool:
        """Is this recorded mount in place and reading what the blob source serves now?"""
        if rec is None:
            return False
        lm = LayerMount.from_json(rec)
        return lm.current(generation) and linux.is_mount(lm.mountpoint)

    def mount(self, blob: str, generation: str) -> dict[str, Any]:
        """Mount the layer (detaching whatever is at its mount point first); its record."""
        return self.mounts.mount(blob, generation).to_json()

    def unmount(self, rec: dict[str, Any]) -> None:
        self.mounts.unmount(LayerMount.from_json(rec))

    def orphans(self, recorded: set[str]) -> list[str]:
        """Mount points under SNAP/layers that no record names."""
        out = []
        for m in linux.mounts_under(linux.read_mounts(), str(self.paths.layers)):
            if m.mountpoint != str(self.paths.layers) and m.mountpoint not in recorded:
                out.append(m.mountpoint)
        return out

    def drop_orphans(self, recorded: dict[str, dict[str, Any]]) -> list[str]:
        """Detach layer mounts no record names, remove empty mount points, and unpin the pins of
        this snapshotter's direct mounts that no record holds (a crash between a pin and its record)."""
        points = {str(r.get("mountpoint", "")) for r in recorded.values()}
        dropped = self.orphans(points)
        for mp in dropped:
            detach(mp)
            rmdir_quiet(mp)
        with contextlib.suppress(OSError):
            for name in os.listdir(self.paths.layers):
                p = str(self.paths.layers / name)
                if p not in points:
                    rmdir_quiet(p)
        held = {str(r.get("pin", "")) for r in recorded.values() if r.get("pin")}
        with contextlib.suppress(LayerstoreError, OSError):
            for blob, holder in self.blobs.pins(self.mounts.holder_prefix):
                if holder not in held:
                    with contextlib.suppress(LayerstoreError):
                        self.blobs.unpin(blob, holder)
        return dropped
