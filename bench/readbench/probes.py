"""Measurements on this machine: dropping caches, page cache held per file (cachestat), CPU time of a
process, of one thread (schedstat), of the machine, and the timer every workload runs under."""

from __future__ import annotations

import contextlib
import os
import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .project import linux

PAGE = os.sysconf("SC_PAGE_SIZE")
CLK_TCK = os.sysconf("SC_CLK_TCK")


def drop_caches() -> None:
    """Every contender, every run: write back, then drop clean page cache, dentries and inodes."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def tree_cached_bytes(root: Path) -> int:
    total = 0
    for dirpath, _dirs, names in os.walk(root):
        for n in names:
            p = os.path.join(dirpath, n)
            if not os.path.islink(p):
                total += linux.cached_bytes(p)
    return total


def process_cpu_s(pid: int) -> float:
    """utime + stime of the whole process, exited threads included (clock-tick resolution)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def process_faults(pid: int) -> int:
    """Page faults of the whole process (minor + major): with the request count and size, a cost
    that load does not move (the warm hit path faults only on the data file's mapping)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[7]) + int(fields[9])


def thread_sched_ns(pid: int, tid: int) -> tuple[int, int]:
    """(time on a CPU, time runnable but waiting for a CPU) of one thread, in ns (schedstat)."""
    with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
        on_cpu, waiting, _slices = f.read().split()
    return int(on_cpu), int(waiting)


def timed(fn: Callable[[Path], int], root: Path, out: dict[str, Any] | None = None) -> tuple[float, int]:
    """Run the workload in this thread; with `out`, also record this thread's CPU time and its
    time waiting for a CPU (the machine is shared: waits are what other load costs us)."""
    me = os.getpid()
    s0 = thread_sched_ns(me, me)
    t0 = time.perf_counter()
    n = fn(root)
    secs = time.perf_counter() - t0
    s1 = thread_sched_ns(me, me)
    if out is not None:
        out["reader"] = {"cpu_ns": s1[0] - s0[0], "wait_ns": s1[1] - s0[1]}
    return secs, n


def system_busy_s() -> float:
    """CPU time spent by the whole machine (all CPUs, everything but idle and iowait)."""
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:]]
    return (sum(vals) - vals[3] - vals[4]) / CLK_TCK


def own_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


class CpuMeter:
    """CPU seconds per GB moved, split by who spent them: this process (the GET client or the
    reader), the daemon, the Ceph daemons (RGW, OSD, ...), and the machine as a whole."""

    def __init__(self, ceph_pids: dict[str, int], daemon_pid: int | None = None) -> None:
        self.ceph_pids, self.daemon_pid = ceph_pids, daemon_pid

    def sample(self) -> dict[str, float]:
        out = {"self": own_cpu_s(), "ceph": sum(process_cpu_s(p) for p in self.ceph_pids.values()),
               "machine": system_busy_s()}
        if self.daemon_pid is not None:
            out["daemon"] = process_cpu_s(self.daemon_pid)
        return out

    @staticmethod
    def per_gb(a: dict[str, float], b: dict[str, float], nbytes: int) -> dict[str, float]:
        return {k: (b[k] - a[k]) / nbytes * 1e9 for k in a}


def read_ahead_of(path: Path) -> int | None:
    """read_ahead_kb of the device holding `path` (the node cache, the store and the images)."""
    dev = os.stat(path).st_dev
    with contextlib.suppress(OSError, ValueError):
        return int(Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb").read_text())
    return None
