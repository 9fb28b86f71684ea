"""Read throughput of EROFS images served lazily by the node daemon (`layerctl daemon`), against the
same images mounted file-backed from a local file (the physical limit here) and the plain source
directory. Same run, same data for every contender.

Workloads:
- `seq`: sequential read (1 MiB reads) of the large files of an image of random data;
- `walk_hash`: os.walk + read + blake3 of every file of a copy of a Python standard library.

Contenders (EROFS is mounted with mount(2), file-backed, no loop device; `_dio`: `-o directio`):
- `erofs_local`, `erofs_local_dio`: the image file on local disk. `erofs_local` is the reference:
  every ratio is to it;
- `fuse_warm`, `fuse_warm_dio`: EROFS on MOUNTPOINT/blobs/<digest> of a daemon whose node cache
  holds every chunk of the image (all reads are cache hits);
- `fuse_cold`, `fuse_cold_dio`: the same with an empty node cache and a local-directory store on
  the same disk (every chunk is fetched, verified, decompressed, committed and served);
- `promoted` ("layerstore warm, promoted"): the same warm node cache, the blob pinned through the
  daemon (`fuse_client.control.pin`) and EROFS mounted file-backed, buffered, on the pinned cache
  data file, as the runtime shim does for complete blobs: no FUSE hop at all;
- `source`: the plain directory the images were built from;
- `erofsfuse` (erofs-utils): reported as unavailable (see UNAVAILABLE).

Cache states are explicit and the same for every contender and every run: a fresh EROFS mount,
a freshly started daemon for the FUSE contenders (nothing of the node cache mapped or in memory
beyond its index), then `sync; echo 3 > /proc/sys/vm/drop_caches`, then the timed workload. So
"warm" means the node cache holds the chunks on local disk, and no contender reads anything from
the page cache. Cold runs mount before dropping the caches: opening the blob fetches its metadata
chunks (timed apart, as `mount_s`). The `hot` section is labelled apart: everything in the page
cache (an untimed first pass, then a fresh EROFS mount, no drop), which leaves the cost of the
FUSE path itself.

Measured with every FUSE run: the FUSE read requests (the daemon's hits + misses), bytes served and
fetched, the daemon's CPU time; with every EROFS run: the page cache held afterwards by EROFS, by
its backing file (the image file or the FUSE blob file) and by the node cache's data file
(cachestat(2)): the memory side of `directio`.

The cost of one FUSE request on the cache-hit path: O_DIRECT reads of 4 KiB, 128 KiB and 1 MiB of
a blob through the mount, the data in the page cache (wall time, and the daemon's own CPU time
from its main thread's schedstat, per request as counted by the daemon), and the read handler
alone, called without a kernel (the daemon's Python share).

S3 (`--s3`, default on): cold sequential read of an image in an S3 store on a local Ceph RGW
(testkit.ceph_cluster) against the store's own parallel GET bandwidth (16 threads, the daemon's
fetch concurrency), both measured in every round; first over loopback (RGW, the OSD and the
daemon share the 2 CPUs, no network limit), then over a shaped link, as a store is reached on a
real node: RGW in a network namespace behind a veth pair with a tbf rate limit
(bench/burst/netlink.py, bench/burst/cephstore.py), at each rate of `--s3-rates` (default 1 and
4 Gbit/s). Every pair records the CPU seconds per GB of the client, the daemon, Ceph and the
machine, and (shaped) the bytes that crossed the link.

Rounds interleave the contenders (the order rotates each round). Figures: best and median of the
rounds; ratios both as best/best and as the median of same-round ratios (the machine is shared:
see loadavg).

    python bench/read.py [--size quick|full] [--reps N] [--s3 | --no-s3] [--s3-rates MBIT,...] [--out FILE]
                         [--contenders a,b] [--workloads a,b]

`--size` defaults to $BENCH_SIZE (as `make bench` sets it), else full. quick: 256 MiB of large
files, 3 rounds, S3 with 128 MiB (about 3 minutes; results in bench/results/read-quick.json);
full: 1 GiB, 7 rounds, S3 with 512 MiB (about 10 minutes; bench/results/read.json).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import json
import mmap
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import blake3  # noqa: E402
import trio  # noqa: E402

from erofs_builder.build import build_layer, push_layer  # noqa: E402
from erofs_builder.source_dir import dir_entries  # noqa: E402
from fuse_client import linux  # noqa: E402
from fuse_client.control import DaemonNotRunning, pin, request_json, unpin  # noqa: E402
from fuse_client.daemon import open_cache  # noqa: E402
from fuse_client.fetcher import DEFAULT_CONCURRENCY, Fetcher  # noqa: E402
from fuse_client.fs import BLOBS_INODE, BlobFS  # noqa: E402
from fuse_client.stats import Stats  # noqa: E402
from layerstore import digest as digestmod  # noqa: E402
from layerstore.store import Store  # noqa: E402

MiB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")
CLK_TCK = os.sysconf("SC_CLK_TCK")
LAYERCTL = str(Path(sys.executable).with_name("layerctl"))
DAEMON_ARGS: list[str] = []  # --daemon-arg: extra `layerctl daemon` arguments for every daemon
RESULTS = ROOT / "bench" / "results"
SIZES: dict[str, dict[str, int]] = {
    "quick": {"big_mib": 256, "reps": 3, "s3_mib": 128},
    "full": {"big_mib": 1024, "reps": 7, "s3_mib": 512},
}
SMALL_SOURCE = Path(f"/usr/lib/python{sys.version_info.major}.{sys.version_info.minor}")
REFERENCE = "erofs_local"
UNAVAILABLE = {
    "erofsfuse": "not packaged in Debian 12 (erofs-utils 1.5 ships no erofsfuse binary); building it from a "
                 "fetched erofs-utils tree may not be committed, so it is not a contender here",
}
GOALS = {  # (workload or "s3", contender or S3 link, minimum ratio)
    "warm_seq": ("seq", "fuse_warm", 0.95),
    "warm_seq_dio": ("seq", "fuse_warm_dio", 0.95),
    "warm_seq_promoted": ("seq", "promoted", 0.95),
    "warm_small": ("walk_hash", "fuse_warm", 0.9),
    "warm_small_dio": ("walk_hash", "fuse_warm_dio", 0.9),
    "warm_small_promoted": ("walk_hash", "promoted", 0.9),
    "cold_s3_loopback": ("s3", "loopback", 0.8),
}
PIN_HOLDER = "bench-read"


# -- data -------------------------------------------------------------------------------------------
def make_big_tree(root: Path, total_mib: int, files: int = 4) -> None:
    root.mkdir(parents=True)
    per = total_mib * MiB // files
    for i in range(files):
        with open(root / f"big{i}.bin", "wb") as f:
            left = per
            while left:
                n = min(left, 64 * MiB)
                f.write(os.urandom(n))
                left -= n


def make_small_tree(root: Path) -> None:
    def ignore(d: str, names: list[str]) -> list[str]:
        return [n for n in names if n == "__pycache__" or not (os.path.isfile(os.path.join(d, n))
                                                              or os.path.isdir(os.path.join(d, n)))]

    shutil.copytree(SMALL_SOURCE, root, symlinks=True, ignore=ignore)


def tree_stats(root: Path) -> dict[str, int]:
    files = size = 0
    for dirpath, _dirs, names in os.walk(root):
        for n in names:
            p = os.path.join(dirpath, n)
            if os.path.isfile(p) and not os.path.islink(p):
                files += 1
                size += os.path.getsize(p)
    return {"files": files, "bytes": size}


# -- workloads (each returns the bytes read) ----------------------------------------------------------
def seq_read(root: Path) -> int:
    total = 0
    buf = bytearray(MiB)
    for name in sorted(os.listdir(root)):
        with open(root / name, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    return total


def walk_hash(root: Path) -> int:
    total = 0
    for dirpath, dirs, names in os.walk(root):
        dirs.sort()
        for n in sorted(names):
            p = os.path.join(dirpath, n)
            if os.path.islink(p) or not os.path.isfile(p):
                continue
            with open(p, "rb") as f:
                data = f.read()
            blake3.blake3(data).digest()
            total += len(data)
    return total


WORKLOADS: dict[str, tuple[str, Callable[[Path], int]]] = {
    "seq": ("big", seq_read),
    "walk_hash": ("small", walk_hash),
}


# -- the machine ------------------------------------------------------------------------------------------
def drop_caches() -> None:
    """Every contender, every run: write back, then drop clean page cache, dentries and inodes."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted",
                                               "nr_recently_evicted")]


_libc = ctypes.CDLL(None, use_errno=True)
SYS_CACHESTAT = 451  # x86_64 and most others (Linux 6.5+)


def cached_bytes(path: str | Path) -> int:
    """Bytes of `path` in the page cache (cachestat(2)); 0 if it cannot be asked."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return 0
    try:
        rng, st = _CachestatRange(0, 0), _Cachestat()
        if _libc.syscall(SYS_CACHESTAT, fd, ctypes.byref(rng), ctypes.byref(st), 0) != 0:
            return 0
        return st.nr_cache * PAGE
    finally:
        os.close(fd)


def tree_cached_bytes(root: Path) -> int:
    total = 0
    for dirpath, _dirs, names in os.walk(root):
        for n in names:
            p = os.path.join(dirpath, n)
            if not os.path.islink(p):
                total += cached_bytes(p)
    return total


def process_cpu_s(pid: int) -> float:
    """utime + stime of the whole process, exited threads included (clock-tick resolution)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def thread_sched_ns(pid: int, tid: int) -> tuple[int, int]:
    """(time on a CPU, time runnable but waiting for a CPU) of one thread, in ns (schedstat)."""
    with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
        on_cpu, waiting, _slices = f.read().split()
    return int(on_cpu), int(waiting)


# -- mounts and the daemon ----------------------------------------------------------------------------------
@contextlib.contextmanager
def erofs_mount(image: Path, work: Path, options: str = "") -> Iterator[Path]:
    target = Path(tempfile.mkdtemp(prefix="mnt-erofs-", dir=work))
    linux.mount_erofs(image, target, options)
    try:
        yield target
    finally:
        linux.umount(target, lazy=True)
        target.rmdir()


@dataclass
class DaemonRun:
    pid: int
    mnt: Path
    cache: Path

    def blob(self, digest: str) -> Path:
        return self.mnt / "blobs" / digest

    def counters(self, blob: str) -> dict[str, float]:
        st = request_json(self.cache, "GET", "/stats", timeout=10)["blobs"].get(blob, {})
        on_cpu, waiting = thread_sched_ns(self.pid, self.pid)
        return {"requests": st.get("hits", 0) + st.get("misses", 0), "misses": st.get("misses", 0),
                "served": st.get("served_bytes", 0), "fetched": st.get("fetched_bytes", 0),
                "cpu_s": process_cpu_s(self.pid), "main_cpu_ns": on_cpu, "main_wait_ns": waiting}

    def data_file(self, blob: str) -> Path:
        hexd = digestmod.hex_of(blob)
        return self.cache / "data" / hexd[:2] / hexd


@contextlib.contextmanager
def daemon(store: str, cache: Path, mnt: Path, log: Path, env: dict[str, str] | None = None,
           extra: list[str] | None = None) -> Iterator[DaemonRun]:
    """A `layerctl daemon` subprocess (its defaults as shipped, unless `extra` arguments say
    otherwise); stopped and unmounted even on failure."""
    mnt.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as logf:
        proc = subprocess.Popen([LAYERCTL, "daemon", "--store", store, "--cache", str(cache), "--mountpoint", str(mnt),
                                 "--log-level", "warning", *(extra or DAEMON_ARGS)], stdout=logf, stderr=logf,
                                env={**os.environ, **(env or {})})
    try:
        end = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {proc.returncode}; see {log}")
            if linux.is_mount(mnt):
                with contextlib.suppress(DaemonNotRunning, OSError):
                    request_json(cache, "GET", "/stats", timeout=5)
                    break
            if time.monotonic() > end:
                raise RuntimeError(f"daemon did not mount; see {log}")
            time.sleep(0.02)
        yield DaemonRun(proc.pid, mnt, cache)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if linux.is_mount(mnt):
            linux.umount(mnt, lazy=True)


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


# -- the contenders -------------------------------------------------------------------------------------------
@dataclass
class Images:
    store: str
    work: Path
    trees: dict[str, Path]
    paths: dict[str, Path]
    blobs: dict[str, str]
    warm_cache: Path
    daemon_env: dict[str, str]


CONTENDERS = ["source", "erofs_local", "erofs_local_dio", "fuse_warm", "fuse_warm_dio", "promoted", "fuse_cold",
              "fuse_cold_dio"]
HOT_CONTENDERS = ["source", "erofs_local", "erofs_local_dio", "fuse_warm", "fuse_warm_dio", "promoted"]


def run_one(im: Images, contender: str, workload: str, *, hot: bool = False) -> dict[str, Any]:
    """One timed run of `workload` on `contender`, cache state as the module doc says."""
    tree, fn = WORKLOADS[workload]
    opts = "directio" if contender.endswith("_dio") else ""
    kind = contender.removesuffix("_dio")
    out: dict[str, Any] = {}
    # hot: an untimed pass first (through a mount of its own), so everything is in the page cache
    # except EROFS's own pages (each run mounts afresh).
    if kind == "source":
        if hot:
            fn(im.trees[tree])
        else:
            drop_caches()
        out["seconds"], out["bytes"] = timed(fn, im.trees[tree], out)
        return out
    if kind == "erofs_local":
        image = im.paths[tree]
        if hot:
            with erofs_mount(image, im.work, opts) as m:
                fn(m)
        with erofs_mount(image, im.work, opts) as m:
            if not hot:
                drop_caches()
            out["seconds"], out["bytes"] = timed(fn, m, out)
            out["memory"] = {"erofs": tree_cached_bytes(m), "backing": cached_bytes(image)}
        return out
    blob = im.blobs[tree]
    if kind == "promoted":
        return run_promoted(im, blob, fn, hot, out)
    cold = kind == "fuse_cold"
    cache = im.work / "cache-cold" if cold else im.warm_cache
    if cold:
        shutil.rmtree(cache, ignore_errors=True)
    try:
        with daemon(im.store, cache, im.work / "mnt-fuse", im.work / "daemon.log", im.daemon_env) as d:
            if hot:
                with erofs_mount(d.blob(blob), im.work, opts) as m:
                    fn(m)
            t0 = time.perf_counter()
            with erofs_mount(d.blob(blob), im.work, opts) as m:
                out["mount_s"] = time.perf_counter() - t0
                if not hot:
                    drop_caches()
                c0 = d.counters(blob)
                out["seconds"], out["bytes"] = timed(fn, m, out)
                c1 = d.counters(blob)
                out["memory"] = {"erofs": tree_cached_bytes(m), "backing": cached_bytes(d.blob(blob)),
                                 "node_cache_file": cached_bytes(d.data_file(blob))}
            out["fuse"] = {k: c1[k] - c0[k] for k in c0}
    finally:
        if cold:
            shutil.rmtree(cache, ignore_errors=True)
    return out


def run_promoted(im: Images, blob: str, fn: Callable[[Path], int], hot: bool, out: dict[str, Any]) -> dict[str, Any]:
    """EROFS on the pinned cache data file of a complete blob (buffered: it is a local file),
    the daemon running as on a node; pinned before the mount, unpinned after the unmount."""
    with daemon(im.store, im.warm_cache, im.work / "mnt-fuse", im.work / "daemon.log", im.daemon_env) as d:
        t0 = time.perf_counter()
        image = pin(im.warm_cache, blob, PIN_HOLDER)
        out["pin_s"] = time.perf_counter() - t0
        if image is None:
            raise RuntimeError(f"blob {blob} is not complete in the warm cache")
        try:
            if hot:
                with erofs_mount(image, im.work) as m:
                    fn(m)
            with erofs_mount(image, im.work) as m:
                if not hot:
                    drop_caches()
                c0 = d.counters(blob)
                out["seconds"], out["bytes"] = timed(fn, m, out)
                c1 = d.counters(blob)
                out["memory"] = {"erofs": tree_cached_bytes(m), "backing": cached_bytes(image)}
            out["daemon_requests"] = c1["requests"] - c0["requests"]  # 0: the daemon is not on the path
        finally:
            unpin(im.warm_cache, blob, PIN_HOLDER)
    return out


def summarize(samples: list[dict[str, Any]]) -> dict[str, Any]:
    secs = [s["seconds"] for s in samples]
    nbytes = samples[0]["bytes"]
    if any(s["bytes"] != nbytes for s in samples):
        raise RuntimeError(f"runs read different amounts of data: {[s['bytes'] for s in samples]}")
    best, med = min(secs), statistics.median(secs)
    out: dict[str, Any] = {"bytes": nbytes, "seconds": [round(s, 4) for s in secs],
                           "MBps": round(nbytes / best / 1e6, 1), "median_MBps": round(nbytes / med / 1e6, 1)}
    if "reader" in samples[0]:
        out["reader_thread_ms"] = {
            k.removesuffix("_ns"): round(statistics.median(s["reader"][k] for s in samples) / 1e6, 1)
            for k in ("cpu_ns", "wait_ns")}
    if "mount_s" in samples[0]:
        out["mount_s_median"] = round(statistics.median(s["mount_s"] for s in samples), 4)
    if "pin_s" in samples[0]:
        out["pin_s_median"] = round(statistics.median(s["pin_s"] for s in samples), 4)
        out["daemon_requests"] = max(s["daemon_requests"] for s in samples)
    if "memory" in samples[0]:
        out["page_cache_MiB"] = {k: round(statistics.median(s["memory"][k] for s in samples) / MiB, 1)
                                 for k in samples[0]["memory"]}
    if "fuse" in samples[0]:
        f = [s["fuse"] for s in samples]
        reqs = statistics.median(x["requests"] for x in f)
        served = statistics.median(x["served"] for x in f)
        cpu = statistics.median(x["cpu_s"] for x in f)
        out["fuse"] = {
            "requests": reqs, "misses": statistics.median(x["misses"] for x in f),
            "mean_request_KiB": round(served / reqs / 1024, 1) if reqs else None,
            "served_MiB": round(served / MiB, 1),
            "fetched_MiB": round(statistics.median(x["fetched"] for x in f) / MiB, 1),
            "daemon_cpu_s": round(cpu, 3),
            "daemon_cpu_s_per_GB_served": round(cpu / served * 1e9, 3) if served else None,
            "daemon_main_thread_us_per_request": round(statistics.median(x["main_cpu_ns"] for x in f) / reqs / 1e3, 1)
            if reqs else None,
            "daemon_main_thread_ms": {"cpu": round(statistics.median(x["main_cpu_ns"] for x in f) / 1e6, 1),
                                      "wait": round(statistics.median(x["main_wait_ns"] for x in f) / 1e6, 1)},
        }
    return out


def ratios(results: dict[str, dict[str, Any]], raw: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Per contender: best/best, and the median of same-round ratios, to the reference."""
    ref = results.get(REFERENCE)
    if ref is None:
        return {}
    out = {}
    for c, r in results.items():
        paired = [raw[REFERENCE][k]["seconds"] / s["seconds"] for k, s in enumerate(raw[c]) if k < len(raw[REFERENCE])]
        out[c] = {"best": round(r["MBps"] / ref["MBps"], 3), "paired_median": round(statistics.median(paired), 3)}
    return out


# -- the cost per request on the hit path ---------------------------------------------------------------------
def hit_path_kernel(d: DaemonRun, blob: str, size: int) -> list[dict[str, Any]]:
    """O_DIRECT reads through FUSE (every read is one request), data in the page cache."""
    out = []
    path = d.blob(blob)
    for block, n in ((4096, 20000), (128 * 1024, 4000), (MiB, 1000)):
        span = min(size, 256 * MiB) // block * block
        buf = mmap.mmap(-1, block)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        walls, cpus, mains = [], [], []
        try:
            for k in range(min(n, span // block)):  # into the page cache, mapped by the daemon
                os.preadv(fd, [buf], k * block)
            for _ in range(3):
                c0 = d.counters(blob)
                t0 = time.perf_counter()
                for k in range(n):
                    os.preadv(fd, [buf], (k * block) % span)
                wall = time.perf_counter() - t0
                c1 = d.counters(blob)
                reqs = c1["requests"] - c0["requests"]
                walls.append(wall / n * 1e6)
                cpus.append((c1["cpu_s"] - c0["cpu_s"]) / reqs * 1e6)
                mains.append((c1["main_cpu_ns"] - c0["main_cpu_ns"]) / reqs / 1e3)
        finally:
            os.close(fd)
            buf.close()
        out.append({"block": block, "requests": n, "wall_us_per_request": round(min(walls), 1),
                    "wall_us_per_request_median": round(statistics.median(walls), 1),
                    "daemon_cpu_us_per_request": round(statistics.median(cpus), 1),
                    "daemon_main_thread_us_per_request": round(statistics.median(mains), 1),
                    "MBps": round(block / min(walls), 1)})
    return out


def hit_path_handler(store_url: str, cache_dir: Path, blob: str, size: int) -> list[dict[str, Any]]:
    """`BlobFS.read` on a cache hit, called without a kernel (the daemon's Python share), next to
    an os.pread of the same range of the cache file (what a copying hit path would add)."""
    results: list[dict[str, Any]] = []

    async def main() -> None:
        with contextlib.ExitStack() as stack:
            cache = open_cache(cache_dir, None, stack)
            store = stack.enter_context(Store.open(store_url))
            stats = Stats()
            async with trio.open_nursery() as nursery:
                await nursery.start(cache.run)
                fs = BlobFS(Fetcher(store, cache, stats, nursery=nursery), cache, stats)
                attr = await fs.lookup(BLOBS_INODE, blob.encode())
                fh = (await fs.open(attr.st_ino, os.O_RDONLY)).fh
                entry = cache.get(blob)
                assert entry is not None
                for block, n in ((4096, 100000), (128 * 1024, 20000), (MiB, 3000)):
                    span = min(size, 256 * MiB) // block * block
                    best = float("inf")
                    for _ in range(3):
                        t0 = time.perf_counter()
                        for k in range(n):
                            coro = fs.read(fh, (k * block) % span, block)
                            try:
                                coro.send(None)
                            except StopIteration:
                                pass
                            else:
                                raise RuntimeError("the cache-hit path awaited")
                        best = min(best, (time.perf_counter() - t0) / n)
                    t0 = time.perf_counter()
                    for k in range(n):
                        os.pread(entry.fd, block, (k * block) % span)
                    pread = (time.perf_counter() - t0) / n
                    results.append({"block": block, "handler_us": round(best * 1e6, 2),
                                    "pread_of_the_same_range_us": round(pread * 1e6, 2)})
                await fs.release(fh)
                await cache.shutdown_flush()
                nursery.cancel_scope.cancel()

    trio.run(main)
    return results


# -- S3 -----------------------------------------------------------------------------------------------------------
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


def cold_s3_read(url: str, env: dict[str, str], blob: str, work: Path, ceph_pids: dict[str, int],
                 link: Any = None) -> dict[str, Any]:
    """A fresh daemon with an empty node cache on the S3 store: sequential read of the image."""
    cache = work / "cache-s3"
    shutil.rmtree(cache, ignore_errors=True)
    try:
        with daemon(url, cache, work / "mnt-fuse-s3", work / "daemon.log", env) as d, \
                erofs_mount(d.blob(blob), work) as m:
            drop_caches()
            meter = CpuMeter(ceph_pids, d.pid)
            c0, m0 = d.counters(blob), meter.sample()
            l0 = link.counters() if link is not None else None
            secs, nbytes = timed(seq_read, m)
            c1, m1 = d.counters(blob), meter.sample()
            l1 = link.counters() if link is not None else None
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    out = {"fuse_cold_s3_MBps": nbytes / secs / 1e6, "fetched_MBps": (c1["fetched"] - c0["fetched"]) / secs / 1e6,
           "cold_cpu_s_per_GB": CpuMeter.per_gb(m0, m1, nbytes)}
    if l0 is not None and l1 is not None:
        out["cold_link_MB"] = (l1.rx_bytes - l0.rx_bytes) / 1e6
    return out


def s3_rounds(label: str, url: str, env: dict[str, str], layer: Any, ceph_pids: dict[str, int], reps: int,
              work: Path, link: Any = None) -> dict[str, Any]:
    """`reps` rounds, each: the store's own parallel GET rate (16 threads, the daemon's fetch
    concurrency; warmed connections; the better of two passes of raw GETs of every chunk object),
    a pass of verified `get_chunk`s, then the cold read through a fresh daemon, over the same path
    to the store (loopback, or the shaped `link`)."""
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        digests = sorted({r.digest for r in layer.refs})
        rounds: list[dict[str, Any]] = []
        with Store.open(url) as store, ThreadPoolExecutor(DEFAULT_CONCURRENCY) as pool:
            keys = [store.chunk_key(dg) for dg in digests]

            def get_pass(fn: Callable[[str], bytes], items: list[str]) -> tuple[float, dict[str, float], float]:
                meter = CpuMeter(ceph_pids)
                m0, t0 = meter.sample(), time.perf_counter()
                l0 = link.counters().rx_bytes if link is not None else 0
                n = sum(len(b) for b in pool.map(fn, items))
                secs, m1 = time.perf_counter() - t0, meter.sample()
                l1 = link.counters().rx_bytes if link is not None else 0
                return n / secs, CpuMeter.per_gb(m0, m1, n), (l1 - l0) / 1e6

            get_pass(store.backend.load, keys)  # clients and connections set up, untimed
            for _ in range(reps):
                get_bps, get_cpu, get_link = max((get_pass(store.backend.load, keys) for _ in range(2)),
                                                 key=lambda x: x[0])
                get_chunk_bps, _, _ = get_pass(store.get_chunk, digests)
                r = {"parallel_get_MBps": get_bps / 1e6, "parallel_get_chunk_MBps": get_chunk_bps / 1e6,
                     "get_cpu_s_per_GB": get_cpu,
                     **cold_s3_read(url, env, layer.blob, work, ceph_pids, link)}
                if link is not None:
                    r["get_link_MB"] = get_link
                r["ratio"] = r["fuse_cold_s3_MBps"] / r["parallel_get_MBps"]
                rounds.append(r)
                print(f"s3 {label}: parallel GET {r['parallel_get_MBps']:.0f} MB/s "
                      f"(GET+verify {r['parallel_get_chunk_MBps']:.0f}); "
                      f"fuse_cold_s3 seq {r['fuse_cold_s3_MBps']:.0f} MB/s ({r['ratio']:.2f}x); "
                      f"load {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return {
        "link": label,
        "rounds": [{k: ({kk: round(vv, 2) for kk, vv in v.items()} if isinstance(v, dict)
                        else round(v, 3 if k == "ratio" else 1)) for k, v in r.items()} for r in rounds],
        "cpu_s_per_GB_median": {
            phase: {k: round(statistics.median(r[phase][k] for r in rounds), 2) for k in rounds[0][phase]}
            for phase in ("get_cpu_s_per_GB", "cold_cpu_s_per_GB")},
        "parallel_get_MBps_best": round(max(r["parallel_get_MBps"] for r in rounds), 1),
        "parallel_get_MBps_median": round(statistics.median(r["parallel_get_MBps"] for r in rounds), 1),
        "fuse_cold_s3_MBps_best": round(max(r["fuse_cold_s3_MBps"] for r in rounds), 1),
        "fuse_cold_s3_MBps_median": round(statistics.median(r["fuse_cold_s3_MBps"] for r in rounds), 1),
        "ratio_best": round(max(r["fuse_cold_s3_MBps"] for r in rounds)
                            / max(r["parallel_get_MBps"] for r in rounds), 3),
        "ratio_paired_median": round(statistics.median(r["ratio"] for r in rounds), 3),
        "loadavg_at_end": os.getloadavg(),
    }


def run_s3(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Cold sequential read from an S3 store (Ceph RGW) vs. that store's parallel GET rate, both in
    every round: over loopback (RGW and the OSD on the same 2 CPUs, no network limit), then over a
    shaped link at each of `args.s3_rates` (RGW in a network namespace behind a veth pair with a
    tbf rate limit, as a store is reached on a real node; bench/burst's netlink and cephstore)."""
    from testkit.ceph_cluster import CephCluster

    from bench.burst.cephstore import StoreProcess
    from bench.burst.netlink import Link

    src = work / "src-s3"
    make_big_tree(src, args.s3_mib, files=2)
    layer = build_layer(dir_entries(src, all_root=True), work / "s3.erofs", all_root=True)
    shutil.rmtree(src)
    out: dict[str, Any] = {"image_bytes": layer.size, "chunks": len({r.digest for r in layer.refs}),
                           "get_threads": DEFAULT_CONCURRENCY, "links": {}}
    creds = {"AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}

    def push(url: str, env: dict[str, str]) -> None:
        saved = dict(os.environ)
        os.environ.update(env)
        try:
            with Store.open(url) as store:
                store.init()
                push_layer(store, layer)
        finally:
            os.environ.clear()
            os.environ.update(saved)

    ceph = CephCluster(work / "ceph")
    ceph.start(cephfs=False)
    try:
        env = {**ceph.s3_env(), **creds}
        url = f"s3://read-bench/store?endpoint={ceph.endpoint}"
        push(url, env)
        out["links"]["loopback"] = s3_rounds("loopback", url, env, layer, {n: d.pid for n, d in ceph.daemons.items()},
                                             args.reps, work)
    finally:
        ceph.stop()
    if args.s3_rates:
        with Link(work.parent / "read-bench-links", rate_mbit=args.s3_rates[0]) as link:
            store = StoreProcess(link, work / "ceph-ns")
            store.start()
            try:
                env = {**store.s3_env(), **creds}
                url = f"s3://read-bench/store?endpoint={store.endpoint}"
                push(url, env)
                for rate in args.s3_rates:
                    link.set_rate(rate)
                    label = f"{rate:g}mbit"
                    res = s3_rounds(label, url, env, layer, store.info["pids"], args.reps, work, link)
                    res["rate_mbit"] = rate
                    res["qdisc"] = link.qdisc_stats()
                    out["links"][label] = res
            finally:
                store.stop()
    return out


# -- the run ---------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default=os.environ.get("BENCH_SIZE") or "full")
    ap.add_argument("--big-mib", type=int, default=None)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--s3-mib", type=int, default=None)
    ap.add_argument("--s3", action=argparse.BooleanOptionalAction, default=True,
                    help="also: cold reads from S3 on a local Ceph RGW (default on)")
    ap.add_argument("--s3-rates", default="1000,4000", metavar="MBIT,...",
                    help="shaped-link rates (Mbit/s) for the S3 pair, besides loopback; empty: loopback only")
    ap.add_argument("--contenders", default=",".join(CONTENDERS),
                    help="comma-separated subset of " + ",".join(CONTENDERS))
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset of " + ",".join(WORKLOADS))
    ap.add_argument("--hot", action=argparse.BooleanOptionalAction, default=True, help="the all-in-page-cache section")
    ap.add_argument("--daemon-env", action="append", default=[], metavar="KEY=VALUE",
                    help="extra environment for the daemon (e.g. for profiling)")
    ap.add_argument("--daemon-arg", action="append", default=[], metavar="ARG",
                    help="extra `layerctl daemon` argument (repeat for each; default: the shipped defaults)")
    ap.add_argument("--workdir", type=Path, default=None, help="default: a temporary directory under /var/tmp")
    ap.add_argument("--out", type=Path, default=None,
                    help="default: bench/results/read.json (full) or read-<size>.json")
    args = ap.parse_args(argv)
    for name, value in SIZES[args.size].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.out is None:
        args.out = RESULTS / ("read.json" if args.size == "full" else f"read-{args.size}.json")
    DAEMON_ARGS[:] = args.daemon_arg
    args.s3_rates = [float(r) for r in args.s3_rates.split(",") if r]
    args.contenders = [c for c in args.contenders.split(",") if c]
    args.workloads = [w for w in args.workloads.split(",") if w]
    if unknown := (set(args.contenders) - set(CONTENDERS)) | (set(args.workloads) - set(WORKLOADS)):
        ap.error(f"unknown contender or workload: {', '.join(sorted(unknown))}")
    if os.geteuid() != 0:
        print("needs root (mounts, drop_caches)", file=sys.stderr)
        return 2

    work = Path(tempfile.mkdtemp(prefix="read-bench-", dir=args.workdir or "/var/tmp"))
    try:
        return run(args, work)
    finally:
        for p in sorted(work.glob("**/mnt*"), reverse=True):
            if linux.is_mount(p):
                linux.umount(p, lazy=True)
        shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace, work: Path) -> int:
    print(f"workdir {work}", flush=True)
    load_start = os.getloadavg()
    t_start = time.perf_counter()
    trees = {"big": work / "src-big", "small": work / "src-small"}
    make_big_tree(trees["big"], args.big_mib)
    make_small_tree(trees["small"])
    store_url = str(work / "store")
    images: dict[str, dict[str, Any]] = {}
    with Store.open(store_url) as store:
        store.init()
        for name, src in trees.items():
            t0 = time.perf_counter()
            layer = build_layer(dir_entries(src, all_root=True), work / f"{name}.erofs", all_root=True)
            push_layer(store, layer)
            images[name] = {"blob": layer.blob, "size": layer.size, "chunks": len(layer.refs),
                            "metadata_chunks": sum(r.metadata for r in layer.refs), **tree_stats(src),
                            "build_and_push_s": round(time.perf_counter() - t0, 2)}
            print(f"image {name}: {layer.size / MiB:.1f} MiB, {len(layer.refs)} chunks, {images[name]['files']} files",
                  flush=True)
    env = dict(kv.split("=", 1) for kv in args.daemon_env)
    im = Images(store_url, work, trees, {n: work / f"{n}.erofs" for n in trees},
                {n: v["blob"] for n, v in images.items()}, work / "cache-warm", env)
    # The warm node cache: every chunk of both images fetched once, then the daemon stopped.
    with daemon(store_url, im.warm_cache, work / "mnt-fuse", work / "daemon.log", env):
        for blob in im.blobs.values():
            request_json(im.warm_cache, "POST", "/prefetch", {"blob": blob, "all": True, "wait": True}, timeout=None)
        ls = request_json(im.warm_cache, "GET", "/cache", timeout=30)
        if any(b["cached_chunks"] != b["chunks"] for b in ls["blobs"]):
            raise RuntimeError(f"warm cache incomplete: {ls}")

    raw: dict[str, dict[str, list[dict[str, Any]]]] = {w: {} for w in args.workloads}
    raw_hot: dict[str, dict[str, list[dict[str, Any]]]] = {w: {} for w in args.workloads}
    hot_contenders = [c for c in HOT_CONTENDERS if c in args.contenders] if args.hot else []
    for rnd in range(args.reps):
        for workload in args.workloads:
            k = rnd % len(args.contenders)
            for c in args.contenders[k:] + args.contenders[:k]:
                r = run_one(im, c, workload)
                raw[workload].setdefault(c, []).append(r)
                extra = f", {r['fuse']['requests']} requests" if "fuse" in r else ""
                print(f"round {rnd} {workload:9s} {c:16s} {r['bytes'] / r['seconds'] / 1e6:8.1f} MB/s{extra}",
                      flush=True)
            for c in hot_contenders:
                r = run_one(im, c, workload, hot=True)
                raw_hot[workload].setdefault(c, []).append(r)
                print(f"round {rnd} {workload:9s} {c + ' (hot)':16s} {r['bytes'] / r['seconds'] / 1e6:8.1f} MB/s",
                      flush=True)

    def build(rw: dict[str, dict[str, list[dict[str, Any]]]]) -> tuple[dict[str, Any], dict[str, Any]]:
        res = {w: {c: summarize(s) for c, s in per.items()} for w, per in rw.items()}
        for w, per in res.items():
            sizes = {r["bytes"] for r in per.values()}
            if len(sizes) > 1:
                raise RuntimeError(f"{w}: contenders read different amounts of data: {sizes}")
        return res, {w: ratios(res[w], rw[w]) for w in res}

    results, ratio = build(raw)
    hot_results, hot_ratio = build(raw_hot) if hot_contenders else ({}, {})

    # The cost per FUSE request on the cache-hit path.
    big = images["big"]
    with daemon(store_url, im.warm_cache, work / "mnt-hit", work / "daemon.log", env) as d:
        hit_kernel = hit_path_kernel(d, big["blob"], big["size"])
    hit_handler = hit_path_handler(store_url, im.warm_cache, big["blob"], big["size"])
    for h in hit_kernel:
        print(f"hit path through the kernel, {h['block']:>7} B: {h['wall_us_per_request']:.1f} us/request wall, "
              f"daemon CPU {h['daemon_cpu_us_per_request']:.1f} us/request", flush=True)
    for h in hit_handler:
        print(f"read handler alone, {h['block']:>7} B: {h['handler_us']:.2f} us (a pread of it: "
              f"{h['pread_of_the_same_range_us']:.2f} us)", flush=True)

    s3 = run_s3(args, work) if args.s3 else None
    goals: dict[str, Any] = {}
    goal_table = dict(GOALS)
    for rate in args.s3_rates if args.s3 else ():
        goal_table[f"cold_s3_{rate:g}mbit"] = ("s3", f"{rate:g}mbit", 0.8)
    for name, (w, c, need) in goal_table.items():
        if w == "s3":
            if s3 is not None and c in s3["links"]:
                r3 = s3["links"][c]
                goals[name] = {"need": need, "ratio_paired_median": r3["ratio_paired_median"],
                               "ratio_best": r3["ratio_best"], "met": r3["ratio_paired_median"] >= need}
        elif c in ratio.get(w, {}):
            r = ratio[w][c]
            goals[name] = {"need": need, "ratio_paired_median": r["paired_median"], "ratio_best": r["best"],
                           "met": r["paired_median"] >= need}
    doc = {
        "benchmark": "read",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version(),
                    "disk_read_ahead_kb": _read_ahead_of(work)},
        "params": {"size": args.size, "big_mib": args.big_mib, "reps": args.reps,
                   "s3_mib": args.s3_mib if args.s3 else None, "s3_rates_mbit": args.s3_rates if args.s3 else None,
                   "small_source": str(SMALL_SOURCE),
                   "contenders": args.contenders, "workloads": args.workloads, "daemon_env": env,
                   "daemon_args": DAEMON_ARGS},
        "images": images,
        "reference": REFERENCE,
        "results": results,
        "ratio_to_erofs_local": ratio,
        "hot": {"results": hot_results, "ratio_to_erofs_local": hot_ratio},
        "hit_path": {"through_kernel": hit_kernel, "handler_alone": hit_handler},
        "s3": s3,
        "goals": goals,
        "unavailable": UNAVAILABLE,
        "loadavg_at_start": load_start,
        "loadavg_at_end": os.getloadavg(),
        "duration_s": round(time.perf_counter() - t_start, 1),
        "notes": [
            "every run: fresh EROFS mount, fresh daemon, then sync + drop_caches (3), then the timed workload; "
            "`hot`: no drop, an untimed pass first, then a fresh EROFS mount",
            "MBps: best of the rounds; median_MBps: median; ratio best: best/best; paired_median: median over "
            "rounds of the same-round ratio to erofs_local (rounds interleave contenders, order rotating)",
            "_dio: EROFS mounted with -o directio (EROFS reads its backing file with direct I/O)",
            "fuse.requests: FUSE read requests the daemon answered (hits + misses); daemon_cpu_s: the daemon "
            "process's utime+stime during the run (10 ms ticks); main thread: schedstat of the trio thread",
            "reader_thread_ms / daemon_main_thread_ms: time on a CPU and time runnable but waiting for one "
            "(schedstat): on a shared machine every FUSE round trip adds two wake-ups that may wait",
            "page_cache_MiB after the run: erofs = EROFS's own page cache (all files), backing = the image file "
            "or the FUSE blob file, node_cache_file = the node cache's data file of the blob",
        ],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    print(json.dumps({"ratio_to_erofs_local": ratio, "hot": hot_ratio, "goals": goals}, indent=1))
    print(f"results written to {args.out}")
    return 0


def _read_ahead_of(path: Path) -> int | None:
    """read_ahead_kb of the device holding `path` (the node cache, the store and the images)."""
    dev = os.stat(path).st_dev
    with contextlib.suppress(OSError, ValueError):
        return int(Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb").read_text())
    return None


if __name__ == "__main__":
    sys.exit(main())
