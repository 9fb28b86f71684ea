"""The node's disk: a dedicated ext4 on a loop device, fresh for every contender.

A disk of its own makes "bytes written to the node's disk" exact: /proc/diskstats of the loop device
counts what this contender wrote and nothing else (other work on the machine writes to other devices).
The loop device uses direct I/O on its backing file, so the backing file adds no second page cache.
Re-making the file system per contender also gives every contender the same cold node: empty, with no
page cache left from the one before (unmounting drops it).

The uppers disk (issue 19): a second one of these per node, made with the same options and mounted at
NODE/sandboxes for every contender alike, so the sandboxes' uppers and overlay work directories (and
whatever else lives in a sandbox's directory: its OCI bundle, the shim's record file and trash) are
written there and the node disk's counters leave the tasks' own writes out by construction. The
uppers disk's own counters show that both paths write about the same there.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from layerstore.linux import syncfs

SECTOR = 512


@dataclass
class DiskCounters:
    read_bytes: int
    write_bytes: int
    write_ios: int

    def minus(self, other: DiskCounters) -> DiskCounters:
        return DiskCounters(self.read_bytes - other.read_bytes, self.write_bytes - other.write_bytes,
                            self.write_ios - other.write_ios)


def diskstats(dev_name: str, text: str | None = None) -> DiskCounters:
    """Counters of one block device (`loop3`) from /proc/diskstats (or `text`, for tests)."""
    if text is None:
        text = Path("/proc/diskstats").read_text()
    for line in text.splitlines():
        f = line.split()
        if len(f) >= 10 and f[2] == dev_name:
            return DiskCounters(int(f[5]) * SECTOR, int(f[9]) * SECTOR, int(f[7]))
    raise KeyError(f"{dev_name} not in /proc/diskstats")


class NodeDisk:
    def __init__(self, image: Path, mountpoint: Path, *, size_gib: int = 24, inodes: int = 2_000_000) -> None:
        self.image = image
        self.mountpoint = mountpoint
        self.size_gib = size_gib
        self.inodes = inodes
        self.device: str | None = None  # /dev/loopN
        self.state_file = image.with_suffix(".state.json")

    @property
    def dev_name(self) -> str:
        assert self.device is not None
        return os.path.basename(self.device)

    def attach(self) -> None:
        self.cleanup_stale()
        self.image.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.image.unlink()  # a lazily detached loop device may still hold the old inode; fine
        with open(self.image, "wb") as f:  # sparse; recreated every run so it never grows stale
            f.truncate(self.size_gib << 30)
        self.device = subprocess.run(["losetup", "--find", "--show", "--direct-io=on", str(self.image)],
                                     capture_output=True, text=True, check=True).stdout.strip()
        self.state_file.write_text(json.dumps({"device": self.device, "mountpoint": str(self.mountpoint),
                                               "owner": os.getpid()}))

    def mkfs_command(self) -> list[str]:
        """mkfs.ext4 with a journal (its default), everything initialised now: nothing is left for a
        background thread to write during a run. The device goes last."""
        return ["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", "-N", str(self.inodes)]

    def fresh(self) -> None:
        """A new, empty, mounted file system (any previous one is unmounted first). If the previous
        one cannot be let go (something still holds it), a new loop device on a new image takes over."""
        if not self.unmount():
            self.detach()
            self.attach()
        assert self.device is not None
        mkfs = self.mkfs_command()
        if subprocess.run([*mkfs, self.device], capture_output=True).returncode != 0:
            self.detach()
            self.attach()
            subprocess.run([*mkfs, self.device], check=True)
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "ext4", self.device, str(self.mountpoint)], check=True)

    def fresh_at(self, mountpoint: Path) -> None:
        """`fresh`, mounted at `mountpoint` (the uppers disk: inside the node directory, which
        changes per contender). Unmount it before the node disk it sits in."""
        if os.path.ismount(self.mountpoint) and self.mountpoint != mountpoint:
            self.unmount()
        self.mountpoint = mountpoint
        if self.device is not None:
            self.state_file.write_text(json.dumps({"device": self.device, "mountpoint": str(mountpoint),
                                                   "owner": os.getpid()}))
        self.fresh()

    def counters(self) -> DiskCounters:
        syncfs(self.mountpoint)
        return diskstats(self.dev_name)

    def used_bytes(self) -> int:
        st = os.statvfs(self.mountpoint)
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    def unmount(self) -> bool:
        """True when the file system is really gone; False when it had to be detached lazily."""
        if not os.path.ismount(self.mountpoint):
            return True
        for _ in range(50):
            if subprocess.run(["umount", str(self.mountpoint)], capture_output=True).returncode == 0:
                return True
            time.sleep(0.1)
        holders = ""
        if shutil.which("fuser"):
            p = subprocess.run(["fuser", "-vm", str(self.mountpoint)], capture_output=True, text=True)
            holders = p.stderr + p.stdout
        print(f"burst: node disk busy, detaching it lazily; holders:\n{holders}", file=sys.stderr)
        subprocess.run(["umount", "-l", str(self.mountpoint)], check=False)
        return False

    def detach(self) -> None:
        self.unmount()
        if self.device is not None:
            subprocess.run(["losetup", "-d", self.device], check=False)
            self.device = None
        with contextlib.suppress(FileNotFoundError):
            self.image.unlink()
        with contextlib.suppress(FileNotFoundError):
            self.state_file.unlink()

    def cleanup_stale(self) -> None:
        """A run killed outright left its loop device attached: detach what the state file names."""
        try:
            st = json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return
        owner = int(st.get("owner", 0))
        if owner != os.getpid() and Path(f"/proc/{owner}").exists():
            return
        mp = st.get("mountpoint")
        if mp and os.path.ismount(mp):
            subprocess.run(["umount", "-l", mp], check=False)
        dev = st.get("device")
        if dev:
            back = subprocess.run(["losetup", "-n", "-O", "BACK-FILE", dev], capture_output=True, text=True).stdout
            if back.strip() == str(self.image):
                subprocess.run(["losetup", "-d", dev], check=False)
        with contextlib.suppress(FileNotFoundError):
            self.state_file.unlink()
