"""Which of a node's mounts depend on a node daemon that died, and which sandboxes lost their data
with it (pure logic over the state's records and mount entries; the watch and recovery act on
it: docs/daemon-death.md).

A layer mounted on the daemon's FUSE file (NODE/fuse/blobs/<digest>) reads through that daemon's
FUSE connection. Once the daemon is gone the connection is dead for good: every read of a page
not already in the layer mount's page cache fails (ECONNABORTED; ENOTCONN for metadata not cached), and a
new daemon serves a new FUSE mount, which that EROFS mount can never read. Such a layer mount is
*lost*; so is every sandbox stacked on it (its running processes see the errors). A layer
mounted directly on a complete, pinned cache file, or attached on the fanotify data path, reads a
local file: it does not depend on the daemon and is never lost here.

The one write here (`mark_lost`) is a transaction the caller opens, under the node lock.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from layerstore.linux import MountEntry, mounts_under

from .state import ATTACHED_PREFIX, BROKEN, MOUNTED, LayerMount, Sandbox, Txn


def _under(path: str, directory: str) -> bool:
    return path.startswith(directory.rstrip("/") + "/")


def reads_through_fuse(lm: LayerMount, fuse_dir: str) -> bool:
    """Does this layer mount read the daemon's FUSE file (not a pinned or attached cache file)?"""
    return not lm.pin and not lm.generation.startswith(ATTACHED_PREFIX) and _under(lm.source, fuse_dir)


def lost_layers(layers: Iterable[LayerMount], fuse_dir: str, generation: str | None) -> list[LayerMount]:
    """The mounted layers that read through a FUSE mount of a daemon other than the healthy one of
    `generation` (the blob source's; None: no daemon is healthy, so every FUSE-backed layer is
    lost). A layer being mounted (status `mounting`) is its claimant's to settle: left out."""
    return [lm for lm in layers
            if lm.status == MOUNTED and reads_through_fuse(lm, fuse_dir) and not lm.current(generation)]


def lost_sandboxes(sandboxes: Iterable[Sandbox], blobs: Iterable[str]) -> list[Sandbox]:
    """The sandboxes stacked on one of `blobs` that are mounted (or broken) and not marked lost
    yet. A sandbox being mounted or torn down belongs to a live operation: its mount fails, or it
    goes."""
    gone = set(blobs)
    return [sb for sb in sandboxes
            if not sb.lost and sb.status in (MOUNTED, BROKEN) and gone.intersection(sb.layers)]


def when_text(when: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(when))


def lost_reason(blob: str, when: float | None = None) -> str:
    """What `sandbox ls` and `run` say about a lost sandbox (one line)."""
    at = f" at {when_text(when)}" if when is not None else ""
    return f"its layer {blob} was on the node daemon's FUSE mount, which died{at}: run it again"


def dead_layer_mounts(mounts: Mapping[str, MountEntry], layers_dir: str, fuse_dir: str) -> list[str]:
    """EROFS mounts under `layers_dir` whose image file is on the FUSE mount at `fuse_dir`
    (recorded or not: a claimant's fresh mount, an orphan): the mounts a dead daemon took down."""
    return sorted(m.mountpoint for m in mounts_under(dict(mounts), layers_dir)
                  if m.fstype == "erofs" and m.mountpoint != layers_dir.rstrip("/") and _under(m.source, fuse_dir))


@dataclass
class Loss:
    """What a daemon's death took: the layer mounts that read through its FUSE mount, and the
    sandboxes stacked on them (now marked lost)."""

    layers: list[LayerMount] = field(default_factory=list)
    sandboxes: list[Sandbox] = field(default_factory=list)

    @property
    def sandbox_ids(self) -> list[str]:
        return sorted(sb.id for sb in self.sandboxes)


def mark_lost(t: Txn, fuse_dir: str, generation: str | None, when: float | None) -> Loss:
    """In the caller's write transaction (node lock held): mark lost every sandbox stacked on a
    layer that `lost_layers` finds, with the reason naming its first such layer. Layer records
    stay as they are: they name a previous daemon, so every later mount or recovery finds them
    stale and mounts them again on the healthy one. Idempotent (a marked sandbox keeps its reason)."""
    layers = lost_layers(t.layers(), fuse_dir, generation)
    if not layers:
        return Loss()
    names = {lm.blob for lm in layers}
    marked = lost_sandboxes(t.sandboxes(), names)
    for sb in marked:
        first = next(b for b in sb.layers if b in names)
        sb.lost = lost_reason(first, when)
        t.put_status(sb)
    return Loss(layers, marked)
