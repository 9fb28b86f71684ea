"""Measurements: kernel memory (the run's cgroup, /proc/meminfo, /proc/slabinfo), RSS, latency
statistics, the node lock's waits and holds, "usable" (one file of each layer read), the facts taken
at each checkpoint (state size, mount table, shim start and recovery, the CLI), and the machine."""

from __future__ import annotations

import contextlib
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from . import project
from .spec import CGROUP_ENV, ENV_TAG, LAYERCTL, PROBES, SETTLE_ENV, SETTLE_S


def meminfo() -> dict[str, int]:
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        k, v = line.split(":", 1)
        if k in ("Slab", "SReclaimable", "SUnreclaim", "MemAvailable", "KernelStack", "PageTables"):
            out[k] = int(v.split()[0]) * 1024
    return out


def slabinfo() -> dict[str, int]:
    """Bytes in use per slab cache (active objects x object size)."""
    out = {}
    try:
        lines = Path("/proc/slabinfo").read_text().splitlines()[2:]
    except OSError:
        return out
    for line in lines:
        f = line.split()
        out[f[0]] = int(f[1]) * int(f[3])
    return out


def rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def cgroup_memory() -> dict[str, int]:
    """Kernel memory and all memory charged to the run's own memory cgroup (v1), if it has one."""
    cg = os.environ.get(CGROUP_ENV)
    out: dict[str, int] = {}
    if cg:
        for key, name in (("kmem", "memory.kmem.usage_in_bytes"), ("total", "memory.usage_in_bytes")):
            with contextlib.suppress(OSError, ValueError):
                out[key] = int(Path(cg, name).read_text())
    return out


def snapshot() -> dict[str, Any]:
    return {"meminfo": meminfo(), "slab": slabinfo(), "cgroup": cgroup_memory(), "t": time.monotonic()}


def per_sandbox(before: dict[str, Any], after: dict[str, Any], n: int) -> dict[str, Any]:
    mi = {k: round((after["meminfo"][k] - before["meminfo"][k]) / n) for k in ("Slab", "SReclaimable", "SUnreclaim")}
    deltas = {k: after["slab"].get(k, 0) - before["slab"].get(k, 0) for k in after["slab"]}
    top = sorted(deltas.items(), key=lambda kv: -kv[1])[:8]
    cg = {f"cgroup_{k}_bytes": round((after["cgroup"][k] - before["cgroup"][k]) / n)
          for k in after["cgroup"] if k in before["cgroup"]}
    return {**cg, "machine_slab_bytes": mi["Slab"], "machine_sreclaimable_bytes": mi["SReclaimable"],
            "machine_sunreclaim_bytes": mi["SUnreclaim"],
            "machine_top_slab_caches_bytes": {k: round(v / n) for k, v in top if v > 0}}


def stats(lat: list[float]) -> dict[str, Any]:
    if not lat:
        return {}
    s = sorted(lat)

    def pct(p: float) -> float:
        return round(s[min(len(s) - 1, int(p * len(s)))] * 1000, 3)

    return {"n": len(s), "p50_ms": pct(0.50), "p90_ms": pct(0.90), "p99_ms": pct(0.99),
            "max_ms": round(s[-1] * 1000, 3), "mean_ms": round(statistics.fmean(s) * 1000, 3)}


class TimedLock:
    """Wraps the shim's node lock to record how long each acquisition waited and was held."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.waits: list[float] = []
        self.holds: list[float] = []
        self._depth = 0
        self._t = 0.0

    def __enter__(self) -> TimedLock:
        t = time.perf_counter()
        self.inner.__enter__()
        if self._depth == 0:
            self._t = time.perf_counter()
            self.waits.append(self._t - t)
        self._depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth == 0:
            self.holds.append(time.perf_counter() - self._t)
        self.inner.__exit__(*exc)


def usable(target: str) -> None:
    for p in PROBES:
        with open(os.path.join(target, p), "rb") as f:
            if not f.read(1):
                raise RuntimeError(f"{target}/{p} is empty")


def settle() -> None:
    """Flush the previous contender's writes and pause, so that their writeback does not land in
    the next contender's measurement. (On an ext4 without a journal, as with `--disk workdir` on
    this machine's root file system, it does not undo what a mass teardown leaves: the inode
    allocator skips inodes deleted in the last 60 s, so creating a sandbox's three directories
    cost 0.11 ms on a fresh file system and 0.29 ms after 10,000 sandboxes' directories were
    deleted, still after a sync and 6 s. The default node disk, a journaled ext4, has no such
    delay; the order, reversed every other round, gives each contender both states either way.)"""
    os.sync()
    time.sleep(float(os.environ.get(SETTLE_ENV, SETTLE_S)))


def node_facts(kind: str, cfg: dict[str, Any], mounted: int, cli_sample: int) -> dict[str, Any]:
    """Measured at a checkpoint: the shim's state size, what reading the mount table costs, the CLI."""
    linux = project.linux()

    facts: dict[str, Any] = {}
    t = time.perf_counter()
    with open(linux.MOUNTINFO, "rb") as f:
        size = len(f.read())
    read_s = time.perf_counter() - t
    t = time.perf_counter()
    n = len(linux.read_mounts())
    facts["mountinfo"] = {"bytes": size, "mounts": n, "read_ms": round(read_s * 1000, 2),
                          "read_and_parse_ms": round((time.perf_counter() - t) * 1000, 2)}
    t = time.perf_counter()
    subprocess.run(["unshare", "--mount", "true"], check=True)
    facts["new_mount_namespace_ms"] = round((time.perf_counter() - t) * 1000, 2)
    if kind.startswith("layerstore"):
        shim_cls, node_state_cls = project.shim_class(), project.node_state_class()
        node = Path(cfg["node"])
        with node_state_cls(node / "state") as st:
            size_b = st.size()
        sdir = next(node.glob("sandboxes/c*"), None)
        rec = project.record_of(sdir) if sdir else None
        facts["state"] = {"lmdb_used_bytes_per_sandbox": round(size_b["used"] / (mounted + 1)),  # + the anchor
                          "lmdb_file_bytes": size_b["file"],
                          "record_bytes": len(rec) if rec else None}
        t = time.perf_counter()
        shim = shim_cls.for_node(node, cfg["store"], auto_recover=False)
        t1 = time.perf_counter()
        shim.recover_if_needed()
        t2 = time.perf_counter()
        rep = shim.recover()
        t3 = time.perf_counter()
        daemon = None
        with shim.state.read() as txn:
            d = txn.daemon()
            daemon = d.pid if d else None
        shim.close()
        facts["shim_start_ms"] = round((t1 - t) * 1000, 2)
        facts["startup_recovery_check_ms"] = round((t2 - t1) * 1000, 2)
        facts["full_recover_ms"] = round((t3 - t2) * 1000, 1)
        facts["full_recover_changed"] = rep.changed
        facts["daemon_rss_bytes"] = rss(daemon) if daemon else None
        if cli_sample and kind == "layerstore-api":
            facts["cli"] = cli_round(cfg, cli_sample, f"{mounted}")
    return facts


def cli_round(cfg: dict[str, Any], n: int, tag: str) -> dict[str, Any]:
    """`layerctl mount` then `layerctl umount`, n each, as processes, one at a time. Each mount keeps a
    256 MiB upper image: the node refuses kept uppers its disk cannot hold all together (issue 27), and
    n of the default 10 GiB would not fit the bench's 32 GiB node disk."""
    targets = [Path(cfg["work"]) / "cli" / f"{tag}-{i}" for i in range(n)]
    ml, ul = [], []
    for tgt in targets:
        t = time.perf_counter()
        p = subprocess.run([LAYERCTL, "mount", "--node-dir", cfg["node"], "--store", cfg["store"],
                            "--upper-size", "256M", ENV_TAG, str(tgt)],
                           capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"layerctl mount: {p.stderr.strip()}")
        usable(str(tgt))
        ml.append(time.perf_counter() - t)
    for tgt in targets:
        t = time.perf_counter()
        p = subprocess.run([LAYERCTL, "umount", "--node-dir", cfg["node"], str(tgt)], capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"layerctl umount: {p.stderr.strip()}")
        ul.append(time.perf_counter() - t)
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    bare = time.perf_counter() - t
    return {"mount": stats(ml), "umount": stats(ul), "bare_python_start_ms": round(bare * 1000, 1)}


def limits() -> dict[str, Any]:
    def read(p: str) -> str | None:
        try:
            return Path(p).read_text().strip()
        except OSError:
            return None

    return {"fs.mount-max": read("/proc/sys/fs/mount-max"), "nofile": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
            "fs.inotify.max_user_watches": read("/proc/sys/fs/inotify/max_user_watches"),
            "fs.inotify.max_user_instances": read("/proc/sys/fs/inotify/max_user_instances"),
            "fs.file-max": read("/proc/sys/fs/file-max"), "user.max_mnt_namespaces":
            read("/proc/sys/user/max_mnt_namespaces")}


def machine() -> dict[str, Any]:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "unknown")
    return {"cpu": cpu, "cores": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version(),
            "loadavg_at_start": os.getloadavg()}
