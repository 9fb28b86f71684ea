"""Where a node keeps things: one node directory holds the daemon's cache and FUSE mountpoint,
the shared layer mounts, the sandboxes' private directories and the shim's state (pure apart
from reading the environment).

    NODE/lock                       flock(2) serialising every state change on the node
    NODE/state/                     LMDB environment: sandboxes, layer mounts, daemon record
    NODE/daemon.log                 the node daemon's stdout and stderr
    NODE/cache/                     the daemon's chunk cache (its control socket lives here)
    NODE/fuse/                      the daemon's FUSE mount: fuse/blobs/<digest>
    NODE/layers/<hex>/              one read-only EROFS mount per layer blob, shared
    NODE/locks/<hex>                flock(2) held by the process mounting that layer (others wait on it)
    NODE/locks/<hex>.all            flock(2) held by the process fetching that blob whole (--eager)
    NODE/sandboxes/<id>/upper       a sandbox's private writable layer
    NODE/sandboxes/<id>/work        overlayfs's work directory (same filesystem as upper)
    NODE/sandboxes/<id>/scratch/    a size-limited filesystem holding upper/ and work/ instead, when the
                                    sandbox's upper has a quota: a tmpfs (`layerctl run`, not kept), or
    NODE/sandboxes/<id>/upper.img   a sparse ext4 image loop-mounted there (a kept or mounted sandbox:
                                    it survives a reboot; recovery mounts it again)
    NODE/roots/<id>                 where a sandbox's root is mounted unless the caller names a target;
                                    NODE/roots is a private bind mount of itself while sandboxes exist
    NODE/sandboxes/<id>/bundle/     the OCI bundle (config.json) for `layerctl run`
"""

from __future__ import annotations

import os
import re
import secrets
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from layerstore import digest as digestmod
from layerstore import linux
from layerstore.errors import ConfigError
from layerstore.fileio import private_dir

NODE_DIR_ENV = "LAYERSTORE_NODE_DIR"
DEFAULT_NODE_DIR = "/var/lib/layerstore"
SANDBOX_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
# overlayfs splits its options at ',' and lowerdir at ':'; '\\' escapes; keep them out of node paths.
_UNSAFE = re.compile(r"[,:\\\s]")


def resolve_node_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    """`--node-dir`, else $LAYERSTORE_NODE_DIR, else /var/lib/layerstore."""
    raw = os.fspath(explicit) if explicit else os.environ.get(NODE_DIR_ENV) or DEFAULT_NODE_DIR
    path = Path(os.path.abspath(raw))
    check_overlay_safe(path, "node directory")
    return path


def check_overlay_safe(path: str | os.PathLike[str], what: str) -> None:
    if _UNSAFE.search(os.fspath(path)):
        raise ConfigError(f"{what} {os.fspath(path)!r}: overlayfs cannot take a path with ',', ':', '\\' or spaces")


def check_sandbox_id(sandbox: str) -> str:
    if not SANDBOX_ID.fullmatch(sandbox):
        raise ConfigError(f"bad sandbox id {sandbox!r} (want letters, digits, '_', '.', '-'; at most 128)")
    return sandbox


def new_sandbox_id() -> str:
    return "sb-" + secrets.token_hex(8)


@dataclass(frozen=True)
class NodePaths:
    """The paths of one node directory (the fixed ones computed once: a mount asks for several)."""

    root: Path

    @classmethod
    def resolve(cls, explicit: str | os.PathLike[str] | None = None) -> NodePaths:
        return cls(resolve_node_dir(explicit))

    @cached_property
    def lock(self) -> Path:
        return self.root / "lock"

    @cached_property
    def state(self) -> Path:
        return self.root / "state"

    @cached_property
    def daemon_log(self) -> Path:
        return self.root / "daemon.log"

    @cached_property
    def cache(self) -> Path:
        return self.root / "cache"

    @cached_property
    def fuse(self) -> Path:
        return self.root / "fuse"

    @cached_property
    def layers(self) -> Path:
        return self.root / "layers"

    @cached_property
    def sandboxes(self) -> Path:
        return self.root / "sandboxes"

    def layer_mount(self, blob: str) -> Path:
        return self.layers / digestmod.parse(blob).split(":", 1)[1]

    @cached_property
    def locks(self) -> Path:
        return self.root / "locks"

    def layer_lock(self, blob: str) -> Path:
        return self.locks / digestmod.parse(blob).split(":", 1)[1]

    def fetch_lock(self, blob: str) -> Path:
        """Held while the blob is fetched whole (eager mode)."""
        return self.locks / (digestmod.parse(blob).split(":", 1)[1] + ".all")

    def sandbox_dir(self, sandbox: str) -> Path:
        return self.sandboxes / check_sandbox_id(sandbox)

    def upper(self, sandbox: str) -> Path:
        return self.sandbox_dir(sandbox) / "upper"

    def work(self, sandbox: str) -> Path:
        return self.sandbox_dir(sandbox) / "work"

    def scratch(self, sandbox: str) -> Path:
        """The mount point of a sandbox's size-limited upper filesystem (when it has one)."""
        return self.sandbox_dir(sandbox) / "scratch"

    def upper_image(self, sandbox: str) -> Path:
        """The filesystem image of a kept sandbox's size-limited upper (when it has one)."""
        return self.sandbox_dir(sandbox) / "upper.img"

    @cached_property
    def roots(self) -> Path:
        return self.root / "roots"

    def rootfs(self, sandbox: str) -> Path:
        """The default target. Not beside the upper: see `SandboxLifecycle.ensure_roots`."""
        return self.roots / check_sandbox_id(sandbox)

    def bundle(self, sandbox: str) -> Path:
        return self.sandbox_dir(sandbox) / "bundle"

    def create(self) -> None:
        """Make the node directory tree. The root and every directory of its own are 0700, also
        when they existed with a wider mode (`fileio.private_dir`: a node directory made by hand
        0755, or by an older version): nothing under it is for other users (blobs, cache files,
        uppers, state), and a process of theirs already inside one (its cwd) is shut out of it too.
        `PermissionDenied` if one is a symlink or another user's."""
        private_dir(self.root, parents=True)
        for d in (self.state, self.cache, self.fuse, self.layers, self.locks, self.sandboxes, self.roots):
            if d == self.fuse and linux.is_mount(d):
                continue  # (the daemon's mount: its root's mode is the daemon's, `BlobFS`)
            private_dir(d)
