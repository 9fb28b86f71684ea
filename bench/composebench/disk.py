"""The node's disk. By default (`--disk loop`) a fresh ext4 with a journal on a loop device
(bench/burst's NodeDisk: a sparse image in the work directory, every inode table and the journal
initialised by mkfs, so no background thread writes during the run), mounted at WORK/disk: the
environment's trees and store, the node and the plain overlay's directories all live on it. With
`--disk workdir` they live in the work directory, on whatever file system that is (the old way).

Why not the work directory's own file system: on an ext4 without a journal (this repository's
benchmark machine's root file system) the inode allocator skips every inode deleted in the last
60 s (360 s while its inode-table block is dirty), looking each one up; after a contender's mass
teardown every mkdir of the next one scans past thousands of them, so a round's figures depended on
what ran before it. Real nodes' disks are journaled."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path
from typing import Any

from . import project

DISK_GIB = 32  # apparent size: the image is sparse (a run at 30,000 mounted writes ~1-2 GiB)
INODES_PER_SANDBOX = 8  # the plain overlay's: its directory, upper, work, work/work, root; the shim's a few more
INODE_MARGIN = 100_000  # the trees, the store, the node's state, the CLI's targets
JBD2 = Path("/proc/fs/jbd2")


def inodes_for(largest_scale: int) -> int:
    """Inodes for two contenders' sandboxes at the largest scale at once (the interleaved A/B holds the
    shim's while the plain overlay's come and go), with a margin."""
    return 2 * largest_scale * INODES_PER_SANDBOX + INODE_MARGIN


def has_journal(dev_name: str) -> bool:
    """Whether jbd2 runs a journal for block device `dev_name` (`loop3`, `vda`): /proc/fs/jbd2 has an
    entry `<name>-<journal inode>` for each journaled ext3/ext4 mounted."""
    with contextlib.suppress(OSError):
        return any(e.rsplit("-", 1)[0] == dev_name for e in os.listdir(JBD2))
    return False


def fs_features(device: str) -> list[str]:
    """The ext4 features of `device` (dumpe2fs -h), e.g. has_journal; empty if it cannot be read."""
    p = subprocess.run(["dumpe2fs", "-h", device], capture_output=True, text=True)
    for line in p.stdout.splitlines():
        if line.startswith("Filesystem features:"):
            return line.split(":", 1)[1].split()
    return []


class LoopDisk:
    """A fresh journaled ext4 on a loop device, mounted at WORK/disk for the run."""

    def __init__(self, work: Path, largest_scale: int) -> None:
        from bench.burst.nodedisk import NodeDisk

        self.nd = NodeDisk(work / "node-disk.img", work / "disk", size_gib=DISK_GIB,
                           inodes=inodes_for(largest_scale))

    @property
    def mountpoint(self) -> Path:
        return self.nd.mountpoint

    def make(self) -> None:
        self.nd.attach()
        self.nd.fresh()

    def describe(self) -> dict[str, Any]:
        dev = self.nd.device or ""
        journal = has_journal(os.path.basename(dev))
        return {"kind": "loop-ext4-journal" if journal else "loop-ext4", "size_gib": self.nd.size_gib,
                "inodes": self.nd.inodes, "device": dev, "mountpoint": str(self.nd.mountpoint),
                "mkfs": self.nd.mkfs_command(),
                "features": fs_features(dev) if dev else [], "journal": journal}

    def detach(self) -> None:
        """Unmount (lazily only if still busy after 5 s), detach the loop device, remove the image."""
        self.nd.detach()


def describe_workdir(path: Path) -> dict[str, Any]:
    """The file system `path` is on, and whether it is journaled (best effort: ext3/ext4 by their
    /proc/fs/jbd2 entry; xfs always logs; None when unknown)."""
    linux = project.linux()
    p = str(path.resolve())
    best = None
    for mp, m in linux.read_mounts().items():
        if (p == mp or p.startswith(mp.rstrip("/") + "/")) and (best is None or len(mp) > len(best.mountpoint)):
            best = m
    if best is None:
        return {"kind": "workdir", "fs": None, "journal": None}
    name = ""
    with contextlib.suppress(OSError):
        name = os.path.basename(os.readlink(f"/sys/dev/block/{best.device}"))
    journal: bool | None = None
    if best.fstype in ("ext3", "ext4"):
        journal = has_journal(name)
    elif best.fstype == "xfs":
        journal = True
    return {"kind": "workdir", "fs": best.fstype, "device": name or best.source, "mountpoint": best.mountpoint,
            "journal": journal}


def unmount_all(work: Path, disk: LoopDisk | None) -> None:
    """Every mount under `work` (the overlays, EROFS layers, the FUSE mount, the plain roots' bind
    mount), deepest first and lazily, except the node disk; then the node disk: unmounted (lazily only
    if still busy after 5 s), its loop device detached and its image removed."""
    linux = project.linux()
    keep = str(disk.mountpoint) if disk is not None else None
    for m in linux.mounts_under(linux.read_mounts(), str(work)):
        if m.mountpoint != keep:
            with contextlib.suppress(Exception):
                linux.umount(m.mountpoint, lazy=True)
    if disk is not None:
        disk.detach()
