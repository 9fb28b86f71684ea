"""Remote layers: a layerstore blob's EROFS image mounted through the node's runtime shim, as one of
the node's shared, reference-counted layer mounts (NODE/layers/<hex>): a layer that shim
sandboxes and containerd containers both stack is mounted once on the node (one page cache).

The snapshotter takes ONE reference on a layer's mount however many of its snapshots use the blob:
a *hold*, which is a shim sandbox of its own (id `ctrd.<root tag>.<hex>`, backend "containerd":
no overlay and no upper on the host; containerd composes its containers' roots from the layer
mount). So the shim's reference counting, its node lock, its pending entries and its `recover()`
cover the snapshotter's references as they cover every sandbox's: a crash in the middle of
taking or dropping a hold is rolled back or finished by the shim's recovery, a daemon restart is
followed by remounting the layer at the same path, and `layerctl sandbox ls` shows the holds.

Which holds should exist is the snapshotter's to say (a blob that one of its records names):
`Snapshotter` takes a hold before the record naming the blob is written and drops it after the
last such record goes; `drop_unneeded` (at every start, and on Cleanup) drops the holds a crash
left in between.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path

from layerstore import digest as digestmod
from layerstore import linux
from layerstore.errors import BadInput, LayerstoreError, PermissionDenied
from layerstore.fileio import rmdir_quiet
from layerstore.linux import detach
from runtime_shim.errors import SandboxExists, SandboxNotFound
from runtime_shim.node.blobs import BlobSource
from runtime_shim.node.request import MountRequest
from runtime_shim.node.shim import Shim
from runtime_shim.nodestate.paths import NodePaths
from runtime_shim.nodestate.state import MOUNTED
from runtime_shim.resolve.environment import CachingResolver, EnvSpec, LayerSpec

HOLD_BACKEND = "containerd"  # the holds' Sandbox.backend: their roots are composed by containerd


class RemoteLayers:
    """`shim`: the node's shim (its blob source, state and layer mounts); `root`: the snapshot root
    (SNAP), which names this snapshotter's holds; `resolver`: environments through the node's
    trust policy (None: no checks, for tests without a store)."""

    def __init__(self, shim: Shim, root: Path, resolver: CachingResolver | None = None) -> None:
        self.shim = shim
        self.root = Path(os.path.abspath(root))
        self.resolver = resolver
        tag = hashlib.blake2b(str(self.root).encode(), digest_size=4).hexdigest()
        self.prefix = f"ctrd.{tag}."

    @classmethod
    def for_node(cls, root: Path, node_dir: str | os.PathLike[str] | None = None,
                 store_url: str | None = None) -> RemoteLayers:
        """Through the node's production shim (`Shim.for_node`: blobs from the node daemon serving
        `store_url`, else the store of the daemon already running, else the default store;
        environments through the node's trust policy)."""
        shim = Shim.for_node(node_dir, store_url)
        return cls(shim, root, shim.resolver)  # type: ignore[arg-type]

    @classmethod
    def with_blobs(cls, root: Path, node_dir: Path, blobs: BlobSource,
                   resolver: CachingResolver | None = None) -> RemoteLayers:
        """Through a shim of the node at `node_dir` with any blob source (a directory of images in
        tests) and no sandbox backends; without a `resolver`, no trust checks."""
        return cls(Shim(NodePaths(Path(os.path.abspath(node_dir))), blobs, backends={}), root, resolver)

    def close(self) -> None:
        self.shim.close()

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

    def prewarm(self) -> None:
        """Check the store now (its client made, the bucket or directory seen), at start in the
        background, not in the first Prepare; a failure is the first Prepare's to report."""
        if self.resolver is not None:
            with contextlib.suppress(LayerstoreError, OSError):
                self.resolver.check()

    def others(self, environment: str, blob: str) -> list[str]:
        """The environment's other layers (its spec as `check` resolved it: cached, trusted),
        bottom first; [] without an environment or a store."""
        if self.resolver is None or not environment:
            return []
        return [b for b in dict.fromkeys(self.resolver(environment).blobs) if b != blob]

    # -- holds -----------------------------------------------------------------------------------
    def hold_id(self, blob: str) -> str:
        return self.prefix + digestmod.parse(blob).split(":", 1)[1]

    def mountpoint(self, blob: str) -> str:
        return str(self.shim.paths.layer_mount(blob))

    def held(self) -> dict[str, str]:
        """blob -> hold id, for every hold of this snapshotter on the node."""
        return {sb.layers[0]: sb.id for sb in self.shim.sandboxes() if sb.id.startswith(self.prefix) and sb.layers}

    def usable(self, blob: str) -> bool:
        """Is the blob held, its layer mounted and reading what the node serves now? O(1): one
        read of the node state and a few system calls; no node lock."""
        with self.shim.state.read() as t:
            sb = t.sandbox(self.hold_id(blob))
            lm = t.layer(blob)
        if sb is None or sb.status != MOUNTED or lm is None or lm.status != MOUNTED:
            return False
        if not lm.pin and not lm.current(self.shim.blobs.generation()):  # (a direct mount needs no daemon)
            return False
        return linux.is_mount(lm.mountpoint)

    def hold(self, blob: str, hints: tuple[int, ...] = (), environment: str = "") -> None:
        """Make the blob's layer mount ready and held by this snapshotter: taken through the shim
        when it is not held (the shim then sends the prefetch `hints` to the daemon, once per
        chunk per node); a held one that is stale (a daemon that restarted, a mount that went) is
        repaired by the shim's recovery. Callers serialise holds of one blob."""
        if self.usable(blob):
            return
        sid = self.hold_id(blob)
        if self._exists(sid):
            self.shim.recover_if_needed()  # (the node's recovery: remounts the layers of every sandbox)
            if self.usable(blob):
                return
            self.release(blob)  # left broken by recovery (its layer could not be mounted): start again
        spec = EnvSpec("", (LayerSpec(blob, 0, "layer"),), ref=environment or HOLD_BACKEND,
                       prefetch={blob: hints} if hints else {})
        try:
            self.shim.mount(MountRequest(spec, sandbox=sid, guest=HOLD_BACKEND))
        except SandboxExists:
            if not self.usable(blob):
                raise

    def _exists(self, sid: str) -> bool:
        with self.shim.state.read() as t:
            return t.sandbox(sid) is not None

    def release(self, blob: str) -> None:
        """Drop this snapshotter's reference on the blob's layer mount (the last user's drop
        unmounts it)."""
        with contextlib.suppress(SandboxNotFound):
            self.shim.unmount(self.hold_id(blob))

    def drop_unneeded(self, needed: set[str]) -> list[str]:
        """Release the holds of blobs no record names (a crash between a hold and its record, or
        between the last record's removal and the release). Returns the blobs released."""
        dropped = []
        for blob in self.held():
            if blob not in needed:
                self.release(blob)
                dropped.append(blob)
        return dropped

    def drop_legacy(self) -> list[str]:
        """Layer mounts an earlier version of the snapshotter made under SNAP/layers (its own,
        not the node's): detached, their pins of the node cache dropped. Returns the mount points."""
        legacy = self.root / "layers"
        if not legacy.exists():
            return []
        mounts = linux.mounts_under(linux.read_mounts(), str(legacy))
        gone = [m.mountpoint for m in mounts if m.mountpoint != str(legacy)]
        for mp in gone:
            detach(mp)
        with contextlib.suppress(OSError):
            for name in os.listdir(legacy):
                rmdir_quiet(legacy / name)
            rmdir_quiet(legacy)
        with contextlib.suppress(LayerstoreError, OSError):
            for blob, holder in self.shim.blobs.pins(f"shim:{legacy}/"):
                self.shim.blobs.unpin(blob, holder)
        return gone
