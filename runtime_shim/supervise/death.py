"""What the node's supervision does about a node daemon that died, before a new one starts
(docs/daemon-death.md): mark the sandboxes that lost their data lost, and
take down the layer mounts that read through the dead FUSE mount, which can never read again.

The watch (`daemon.watch`) calls `sever` under the node lock when it found the recorded daemon
dead and is about to start a new one; recovery marks lost sandboxes the same way
(`nodestate.lost.mark_lost`) when nobody watched. Layer records stay: they name the dead daemon,
so the next mount or recovery (any shim call) finds them stale and mounts them again on the new
daemon, and the sandboxes' overlays with them, on the same uppers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from layerstore import linux
from layerstore.fileio import rmdir_quiet

from ..nodestate.lost import Loss, dead_layer_mounts, mark_lost
from ..nodestate.paths import NodePaths
from ..nodestate.state import NodeState


@dataclass
class Severed:
    """What `sever` found and did."""

    loss: Loss = field(default_factory=Loss)
    detached: list[str] = field(default_factory=list)  # layer mountpoints taken down

    def summary(self) -> str:
        """For the daemon log's line about the restart."""
        lost = self.loss.sandbox_ids
        shown = ", ".join(lost[:5]) + (f", ... ({len(lost)})" if len(lost) > 5 else "")
        return (f"{len(self.detached)} layer mount(s) on its dead FUSE mount removed, "
                f"{len(lost)} sandbox(es) lost{': ' + shown if lost else ''}")


def sever(paths: NodePaths, state: NodeState, when: float) -> Severed:
    """Caller holds the node lock, and no node daemon is healthy. One transaction marks lost the
    sandboxes stacked on layers read through the (dead) FUSE mount; then those layer mounts, and
    any other EROFS mount under NODE/layers whose image is on the FUSE mount, are detached
    (lazily: an overlay stacked on one keeps it, reading errors, until that overlay goes) and
    their mountpoints removed, so that nothing new stacks on them (a mount in flight that would
    finds no directory and fails, instead of stacking an empty one). Idempotent."""
    with state.write() as t:
        loss = mark_lost(t, str(paths.fuse), None, when)
    points = {lm.mountpoint for lm in loss.layers}
    points.update(dead_layer_mounts(linux.read_mounts(), str(paths.layers), str(paths.fuse)))
    out = Severed(loss)
    for mp in sorted(points):
        try:
            if linux.detach(mp):
                out.detached.append(mp)
        except linux.MountError:
            continue  # (recovery tries again)
        rmdir_quiet(mp)
    return out
