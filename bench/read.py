"""Read throughput of EROFS images served by the FUSE daemon, against the same images mounted from
a local file (the physical limit here) and the plain source directory.

Workloads (same data for every contender):
- `seq`: sequential read (1 MiB reads) of large files in an image of random data;
- `walk_hash`: walk + read + blake3 of a tree of many small files (a copy of a Python stdlib);
- `tar`: `tar -cf -` of that small-file tree, read from a pipe.

Contenders:
- `local`: EROFS file-backed on the image file (mount(2), no loop device), the image file in the
  page cache (the daemon's cache files are too, when warm); `local_disk`: the same with the image
  dropped from the page cache first (the disk's speed);
- `fuse_cold`: EROFS on `MOUNTPOINT/blobs/<digest>` of a fresh `layerctl daemon` (empty node
  cache, local-directory store: every chunk is fetched, verified, decompressed, cached);
- `fuse_warm`: the same after a daemon restart over the filled cache (hits only);
- `fuse_warm_directio`: as `fuse_warm`, EROFS mounted with `-o directio` (every EROFS page-cache
  miss is a FUSE request: the daemon's hit path, without the FUSE file's page cache);
- `source`: the plain directory the images were built from;
- with `--s3`: `fuse_cold_s3` (sequential read of an image in an S3 store on a local Ceph RGW,
  empty cache) against the store's own parallel GET bandwidth measured in the same run.
Page caches are made cold for every run: EROFS mounts are fresh (the daemon's FUSE file is read
with direct I/O by EROFS, so its page cache plays no part), source files get FADV_DONTNEED.
`erofsfuse` (erofs-utils) is not packaged in Debian 12 and is reported as unavailable.

Also measured: the cost of one FUSE request on the cache-hit path (O_DIRECT reads of the blob
file through the daemon versus the same reads of the cache's own data file).

    python bench/fuse_read.py [--size quick|full] [--big-mib N] [--reps N] [--s3 | --no-s3]
                              [--out bench/results/fuse_read.json]

`--size` defaults to $BENCH_SIZE (as `make bench` sets it), else quick: 256 MiB, 3 runs, S3 with
128 MiB (about a minute and a half); full: 1 GiB, 5 runs, S3 with 512 MiB.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import mmap
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import blake3  # noqa: E402

from erofs_builder.build import build_layer, push_layer  # noqa: E402
from erofs_builder.source_dir import dir_entries  # noqa: E402
from fuse_client.control import DaemonNotRunning, request_json  # noqa: E402
from layerstore import sysmount  # noqa: E402
from layerstore.store import Store  # noqa: E402

MiB = 1 << 20
LAYERCTL = str(Path(sys.executable).with_name("layerctl"))
DEFAULT_OUT = ROOT / "bench" / "results" / "fuse_read.json"
SIZES: dict[str, dict[str, int]] = {
    "quick": {"big_mib": 256, "reps": 3, "s3_mib": 128},
    "full": {"big_mib": 1024, "reps": 5, "s3_mib": 512},
}
SMALL_SOURCE = Path(f"/usr/lib/python{sys.version_info.major}.{sys.version_info.minor}")


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


# -- workloads (each returns bytes read) ------------------------------------------------------------------
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
    for dirpath, _dirs, names in os.walk(root):
        for n in sorted(names):
            p = os.path.join(dirpath, n)
            if os.path.islink(p) or not os.path.isfile(p):
                continue
            with open(p, "rb") as f:
                data = f.read()
            blake3.blake3(data).digest()
            total += len(data)
    return total


def tar_read(root: Path) -> int:
    proc = subprocess.Popen(["tar", "-cf", "-", "-C", str(root), "."], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    total = 0
    while b := proc.stdout.read(MiB):
        total += len(b)
    if proc.wait() != 0:
        raise RuntimeError("tar failed")
    return total


WORKLOADS: dict[str, tuple[str, Callable[[Path], int]]] = {
    "seq": ("big", seq_read),
    "walk_hash": ("small", walk_hash),
    "tar": ("small", tar_read),
}


def drop_source_cache(root: Path) -> None:
    for dirpath, _dirs, names in os.walk(root):
        for n in names:
            p = os.path.join(dirpath, n)
            if os.path.islink(p) or not os.path.isfile(p):
                continue
            drop_file_cache(Path(p))


def drop_file_cache(path: Path) -> None:
    """Write back, then drop a file's pages (DONTNEED skips dirty pages)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# -- mounts and the daemon ----------------------------------------------------------------------------------
@contextlib.contextmanager
def erofs_mount(image: Path, work: Path, options: str = "") -> Iterator[Path]:
    target = Path(tempfile.mkdtemp(prefix="mnt-", dir=work))
    sysmount.mount_erofs(image, target, options)
    try:
        yield target
    finally:
        sysmount.umount(target, lazy=True)
        target.rmdir()


@contextlib.contextmanager
def daemon(store: Path | str, cache: Path, mnt: Path, log: Path, env: dict[str, str] | None = None) -> Iterator[Path]:
    mnt.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as logf:
        proc = subprocess.Popen([LAYERCTL, "daemon", "--store", str(store), "--cache", str(cache),
                                 "--mountpoint", str(mnt), "--log-level", "warning"], stdout=logf, stderr=logf,
                                env={**os.environ, **(env or {})})
    try:
        end = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"daemon exited; see {log}")
            if sysmount.is_mountpoint(mnt):
                with contextlib.suppress(DaemonNotRunning, OSError):
                    request_json(cache, "GET", "/stats", timeout=5)
                    break
            if time.monotonic() > end:
                raise RuntimeError("daemon did not mount")
            time.sleep(0.02)
        yield mnt
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if sysmount.is_mountpoint(mnt):
            sysmount.umount(mnt, lazy=True)


def timed(fn: Callable[[Path], int], root: Path) -> tuple[float, int]:
    t0 = time.perf_counter()
    n = fn(root)
    return time.perf_counter() - t0, n


def hit_path_cost(blob_file: Path, cache_file: Path, size: int, block: int, limit: int) -> dict[str, float]:
    """Reads of `block` bytes over the blob through FUSE (O_DIRECT: every read is a request) vs.
    the same preads on the cache's data file (in the page cache, as the daemon does them)."""
    buf = mmap.mmap(-1, block)
    n = min(size, limit) // block

    def run(path: Path, flags: int) -> float:
        fd = os.open(path, os.O_RDONLY | flags)
        try:
            t0 = time.perf_counter()
            for k in range(n):
                os.preadv(fd, [buf], k * block)
            return time.perf_counter() - t0
        finally:
            os.close(fd)

    run(blob_file, os.O_DIRECT)  # warm both paths once
    run(cache_file, 0)
    fuse = min(run(blob_file, os.O_DIRECT) for _ in range(3))
    local = min(run(cache_file, 0) for _ in range(3))
    buf.close()
    return {"block": block, "requests": n, "fuse_us_per_request": fuse / n * 1e6,
            "cache_file_us_per_request": local / n * 1e6, "fuse_overhead_us": (fuse - local) / n * 1e6,
            "fuse_MBps": n * block / fuse / 1e6}


# -- the run -------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default=os.environ.get("BENCH_SIZE", "quick"))
    ap.add_argument("--big-mib", type=int, default=None)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--workdir", type=Path, default=None, help="default: a temporary directory under /var/tmp")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--s3", action=argparse.BooleanOptionalAction, default=True,
                    help="also: cold reads from S3 on a local Ceph RGW (default on)")
    ap.add_argument("--s3-mib", type=int, default=None)
    args = ap.parse_args(argv)
    preset = SIZES[args.size]
    for name, value in preset.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if os.geteuid() != 0:
        print("needs root (mounts)", file=sys.stderr)
        return 2

    work = Path(tempfile.mkdtemp(prefix="fuse-read-", dir=args.workdir or "/var/tmp"))
    try:
        return run(args, work)
    finally:
        for p in work.glob("**/mnt*"):
            if sysmount.is_mountpoint(p):
                sysmount.umount(p, lazy=True)
        shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace, work: Path) -> int:
    print(f"workdir {work}", flush=True)
    load_start = os.getloadavg()
    trees = {"big": work / "src-big", "small": work / "src-small"}
    make_big_tree(trees["big"], args.big_mib)
    make_small_tree(trees["small"])
    store_dir = work / "store"
    store = Store.open(str(store_dir))
    store.init()
    images: dict[str, dict[str, Any]] = {}
    for name, src in trees.items():
        t0 = time.perf_counter()
        layer = build_layer(dir_entries(src, all_root=True), work / f"{name}.erofs", all_root=True)
        push_layer(store, layer)
        images[name] = {"blob": layer.blob, "size": layer.size, "chunks": len(layer.refs),
                        "metadata_chunks": sum(r.metadata for r in layer.refs), **tree_stats(src),
                        "build_and_push_s": round(time.perf_counter() - t0, 2), "path": work / f"{name}.erofs"}
        print(f"image {name}: {layer.size / MiB:.1f} MiB, {len(layer.refs)} chunks", flush=True)
    store.close()

    results: dict[str, dict[str, Any]] = {}

    def record(contender: str, workload: str, samples: list[tuple[float, int]]) -> None:
        # Best of N is the figure (the machine is shared: noise only ever slows a run down);
        # the median is kept alongside.
        secs = [s for s, _ in samples]
        nbytes = samples[0][1]
        best, med = min(secs), statistics.median(secs)
        results.setdefault(contender, {})[workload] = {
            "bytes": nbytes, "seconds": [round(s, 4) for s in secs], "best_s": round(best, 4),
            "median_s": round(med, 4), "MBps": round(nbytes / best / 1e6, 1),
            "median_MBps": round(nbytes / med / 1e6, 1)}
        print(f"{contender:18s} {workload:10s} {nbytes / best / 1e6:9.1f} MB/s best, {nbytes / med / 1e6:9.1f} median",
              flush=True)

    for workload, (tree, fn) in WORKLOADS.items():
        image = images[tree]["path"]
        blob = images[tree]["blob"]
        # source directory
        samples = []
        for _ in range(args.reps):
            drop_source_cache(trees[tree])
            samples.append(timed(fn, trees[tree]))
        record("source", workload, samples)
        # EROFS on a local file: the image in the page cache (as the daemon's cache files are when
        # warm), and dropped from it (the disk's own speed)
        samples, cold_samples = [], []
        for _ in range(args.reps):
            with erofs_mount(image, work) as m:
                samples.append(timed(fn, m))
            drop_file_cache(image)
            with erofs_mount(image, work) as m:
                cold_samples.append(timed(fn, m))
        record("local", workload, samples)
        record("local_disk", workload, cold_samples)
        # EROFS on the FUSE daemon, cold then warm (a restarted daemon: a fresh FUSE page cache)
        cold, warm, warm_dio = [], [], []
        for rep in range(args.reps):
            cache = work / f"cache-{workload}-{rep}"
            mnt = work / f"mnt-fuse-{workload}"
            log = work / "daemon.log"
            with daemon(store_dir, cache, mnt, log) as fm, erofs_mount(fm / "blobs" / blob, work) as m:
                cold.append(timed(fn, m))
            with daemon(store_dir, cache, mnt, log) as fm, erofs_mount(fm / "blobs" / blob, work) as m:
                warm.append(timed(fn, m))
            with daemon(store_dir, cache, mnt, log) as fm, erofs_mount(fm / "blobs" / blob, work, "directio") as m:
                warm_dio.append(timed(fn, m))
            if rep:
                shutil.rmtree(work / f"cache-{workload}-{rep - 1}", ignore_errors=True)
        record("fuse_cold", workload, cold)
        record("fuse_warm", workload, warm)
        record("fuse_warm_directio", workload, warm_dio)

    # The hit path: cost of one FUSE request, with the big blob fully cached.
    big = images["big"]
    cache = work / f"cache-seq-{args.reps - 1}"
    hexd = big["blob"][3:]
    with daemon(store_dir, cache, work / "mnt-hit", work / "daemon.log") as fm:
        blob_file = fm / "blobs" / big["blob"]
        request_json(cache, "POST", "/prefetch", {"blob": big["blob"], "all": True, "wait": True}, timeout=None)
        hit = [hit_path_cost(blob_file, cache / "data" / hexd[:2] / hexd, big["size"], block, limit)
               for block, limit in ((128 * 1024, 1 << 30), (4096, 64 << 20))]
    for h in hit:
        print(f"hit path, {h['block']} B requests: {h['fuse_us_per_request']:.1f} us each through FUSE, "
              f"{h['cache_file_us_per_request']:.1f} us on the cache file; overhead {h['fuse_overhead_us']:.1f} us",
              flush=True)

    ratios = {c: {w: round(results[c][w]["MBps"] / results["local"][w]["MBps"], 3) for w in results[c]}
              for c in results}
    s3 = run_s3(args, work) if args.s3 else None
    doc = {
        "benchmark": "fuse_read",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()},
        "params": {"size": args.size, "big_mib": args.big_mib, "reps": args.reps, "s3_mib": args.s3_mib if args.s3
                   else None, "small_source": str(SMALL_SOURCE)},
        "images": {k: {kk: vv for kk, vv in v.items() if kk != "path"} for k, v in images.items()},
        "results": results,
        "ratio_to_local": ratios,
        "hit_path": hit,
        "s3": s3,
        "loadavg_at_start": load_start,
        "loadavg_at_end": os.getloadavg(),
        "notes": [
            "MBps is best of `reps` runs (the machine is shared with other work; see loadavg); median_MBps too",
            "ratios are to `local`: EROFS file-backed on the image file, image in the page cache",
            "fuse_warm: EROFS buffered over the FUSE file (kernel readahead 1 MiB); fuse_warm_directio: "
            "EROFS -o directio, every EROFS page-cache miss is a FUSE request",
            "hit_path: per-request cost through FUSE (O_DIRECT on the blob file) vs pread of the cache file",
        ],
        "unavailable": {"erofsfuse": "not packaged in Debian 12 (erofs-utils 1.5 ships no erofsfuse)"},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    print(json.dumps(ratios, indent=2))
    print(f"results written to {args.out}")
    return 0


def run_s3(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Cold sequential read from an S3 store (local Ceph RGW) vs. that store's parallel GET rate."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.ceph_cluster import CephCluster

    ceph = CephCluster(work / "ceph")
    ceph.start(cephfs=False)
    try:
        env = {**ceph.s3_env(), "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}
        os.environ.update(env)
        url = f"s3://fuse-bench/store?endpoint={ceph.endpoint}"
        src = work / "src-s3"
        make_big_tree(src, args.s3_mib, files=2)
        with Store.open(url) as store:
            store.init()
            layer = build_layer(dir_entries(src, all_root=True), work / "s3.erofs", all_root=True)
            push_layer(store, layer)
        digests = sorted({r.digest for r in layer.refs})
        with Store.open(url) as store, ThreadPoolExecutor(16) as pool:
            t0 = time.perf_counter()
            got = sum(len(b) for b in pool.map(store.get_chunk, digests))
            get_s = time.perf_counter() - t0
        get_mbps = got / get_s / 1e6
        samples = []
        for rep in range(args.reps):
            cache = work / f"cache-s3-{rep}"
            with daemon(url, cache, work / "mnt-fuse-s3", work / "daemon.log", env) as fm, \
                    erofs_mount(fm / "blobs" / layer.blob, work) as m:
                samples.append(timed(seq_read, m))
            shutil.rmtree(cache, ignore_errors=True)
        best = min(s for s, _ in samples)
        cold_mbps = samples[0][1] / best / 1e6
        print(f"s3: parallel GET (16 threads, get_chunk) {get_mbps:.1f} MB/s; fuse_cold_s3 seq {cold_mbps:.1f} MB/s "
              f"({cold_mbps / get_mbps:.2f}x)", flush=True)
        return {"image_bytes": layer.size, "parallel_get_MBps": round(get_mbps, 1),
                "fuse_cold_s3_seq": {"seconds": [round(s, 4) for s, _ in samples], "MBps": round(cold_mbps, 1)},
                "ratio_to_parallel_get": round(cold_mbps / get_mbps, 3)}
    finally:
        ceph.stop()


if __name__ == "__main__":
    sys.exit(main())
