"""Bytes the tasks actually read: one run of each environment's task on plain extracted layers, with
readahead off, then the page cache of every layer file is counted with mincore(2).

The node disk is remounted (dropping its page cache) and the loop device's readahead set to zero before
the tasks run, so a resident page is a page some task asked for: the union, at 4 KiB granularity, of the
file data the burst's tasks read (every sandbox of one environment runs the same task). This is the
workload's property, the same for every contender, and the yardstick for "bytes fetched".
"""

from __future__ import annotations

import mmap
import os
import stat
import subprocess
import time
from pathlib import Path
from typing import Any

from layerstore.linux import resident_pages

from . import oci, spec
from .conventional import mount_overlay
from .inputs import env_layers
from .nodedisk import NodeDisk, diskstats
from .sandbox import SandboxResult, parse_output, tail

PAGE = mmap.PAGESIZE

def resident_bytes(path: str | os.PathLike[str]) -> int:
    """How much of a file is in the page cache (whole pages; the last one counts fully)."""
    return sum(b & 1 for b in resident_pages(path)) * PAGE


class ReadSet:
    """The union of the pages read from a tree, over several scans (page bitmaps OR-ed per file).
    Each scan follows one task closely, so that nothing (memory pressure, another program dropping
    the caches) has long to evict what the task read."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.pages: dict[str, bytearray] = {}
        self.sizes: dict[str, int] = {}
        for dirpath, _dirs, names in os.walk(root):
            for n in names:
                p = os.path.join(dirpath, n)
                try:
                    st = os.lstat(p)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    self.sizes[p] = st.st_size

    def scan(self) -> int:
        """OR the current page cache into the set; returns the bytes resident in this scan."""
        now = 0
        for p, size in self.sizes.items():
            if size == 0:
                continue
            vec = resident_pages(p)
            if not any(b & 1 for b in vec):
                continue
            now += sum(b & 1 for b in vec) * PAGE
            have = self.pages.setdefault(p, bytearray(len(vec)))
            for i, b in enumerate(vec):
                if b & 1:
                    have[i] = 1
        return now

    def summary(self) -> dict[str, int]:
        read = 0
        for p, bits in self.pages.items():
            read += min(sum(bits) * PAGE, self.sizes[p])  # the last page holds less than a page of file data
        return {"files": len(self.sizes), "content_bytes": sum(self.sizes.values()), "files_read": len(self.pages),
                "read_bytes": read}


def _set_readahead(dev_name: str, kb: int | None) -> int:
    p = Path(f"/sys/block/{dev_name}/queue/read_ahead_kb")
    old = int(p.read_text())
    if kb is not None:
        p.write_text(str(kb))
    return old


def _remount(disk: NodeDisk) -> None:
    """Unmount and mount the node disk again: its page cache goes with the old mount (a cold start)."""
    disk.unmount()
    subprocess.run(["mount", "-t", "ext4", str(disk.device), str(disk.mountpoint)], check=True)


def measure(disk: NodeDisk, layer_tars: dict[str, Path], environments: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """Per environment: a cold remount, one run of its task, and a scan of its layers' page cache at
    once. The device's own read counter is the check: with readahead off, the scan must account for
    most of what the task read from the disk (file data; the rest is ext4 metadata); when it does not,
    pages went before the scan (memory pressure, another program dropping the caches) and the
    environment is measured again."""
    root = disk.mountpoint / "readset"
    for name, tar in layer_tars.items():
        d = root / "layers" / name
        d.mkdir(parents=True)
        subprocess.run(["tar", "--numeric-owner", "-xzf", str(tar), "-C", str(d)], check=True)
    old_ra = _set_readahead(disk.dev_name, 0)
    runs: dict[str, Any] = {}
    sets: dict[str, ReadSet] = {}
    try:
        for env in environments:
            sid = f"lsb-readset-{os.getpid()}-{env}"
            for attempt in range(4):
                _remount(disk)
                for name in env_layers(env):
                    if name not in sets:
                        sets[name] = ReadSet(root / "layers" / name)
                box = root / "sandboxes" / f"{env}-{attempt}"
                lowers = [root / "layers" / n for n in reversed(env_layers(env))]
                oci.write_bundle(box / "bundle", spec.task_command(spec.ENVIRONMENTS[env]), hostname=sid)
                rootfs = box / "bundle" / "rootfs"
                mount_overlay(lowers, box / "upper", box / "work", rootfs)
                try:
                    d0 = diskstats(disk.dev_name).read_bytes
                    t = time.time()
                    p = subprocess.run(["runc", "--root", str(root / "runc"), "run", "--bundle", str(box / "bundle"),
                                        f"{sid}-{attempt}"], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                       errors="replace")
                    dev_read = diskstats(disk.dev_name).read_bytes - d0
                    seen = sum(sets[name].scan() for name in env_layers(env))
                finally:
                    subprocess.run(["umount", str(rootfs)], check=False, capture_output=True)
                r = SandboxResult(0, env, launched=t, finished=time.time(), rc=p.returncode)
                parse_output(p.stdout, r)
                runs[env] = {"rc": p.returncode, "seconds": round(r.finished - t, 2) if r.finished else None,
                             "task": r.task, "attempts": attempt + 1, "device_read_bytes": dev_read,
                             "resident_bytes": seen, **({"error": tail(p.stderr + p.stdout)} if p.returncode else {})}
                if p.returncode != 0 or seen >= 0.7 * dev_read:
                    break
        per_layer = {name: sets[name].summary() if name in sets else ReadSet(root / "layers" / name).summary()
                     for name in layer_tars}
    finally:
        _set_readahead(disk.dev_name, old_ra)
    total_read = sum(v["read_bytes"] for v in per_layer.values())
    total = sum(v["content_bytes"] for v in per_layer.values())
    return {"runs": runs, "layers": per_layer, "read_bytes": total_read, "content_bytes": total,
            "read_fraction": round(total_read / total, 4) if total else None}
