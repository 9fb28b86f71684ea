"""Cold sequential reads from an S3 store on a real Ceph RGW (testkit.ceph_cluster) against that
store's own parallel GET rate, in every round: over loopback, then over a shaped link (RGW in a
network namespace behind a veth pair with a tbf limit: bench/burst's netlink and cephstore)."""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .inputs import make_big_tree
from .mounts import daemon, erofs_mount
from .probes import CpuMeter, drop_caches, timed
from .project import DEFAULT_CONCURRENCY, Store, build_layer, dir_entries, push_layer
from .workloads import seq_read


def cold_s3_read(url: str, env: dict[str, str], blob: str, work: Path, ceph_pids: dict[str, int],
                 link: Any = None) -> dict[str, Any]:
    """A fresh daemon with an empty node cache on the S3 store: sequential read of the image."""
    cache = work / "cache-s3"
    shutil.rmtree(cache, ignore_errors=True)
    try:
        with daemon(url, cache, work / "mnt-fuse-s3", work / "daemon.log", env) as d, \
                erofs_mount(d.blob(blob), work) as m:
            return measured_cold_read(d, blob, m, ceph_pids, link, "fuse_cold_s3_MBps", "")
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def measured_cold_read(d: Any, blob: str, mnt: Path, ceph_pids: dict[str, int], link: Any, speed_key: str,
                       prefix: str) -> dict[str, Any]:
    """The sequential read of the image mounted at `mnt` with the page cache dropped: its rate
    (`speed_key`), the daemon's fetch rate, the CPU per GB of the daemon and the store, and the
    bytes the `link` carried (`prefix` before the other keys)."""
    drop_caches()
    meter = CpuMeter(ceph_pids, d.pid)
    c0, m0 = d.counters(blob), meter.sample()
    l0 = link.counters() if link is not None else None
    secs, nbytes = timed(seq_read, mnt)
    c1, m1 = d.counters(blob), meter.sample()
    l1 = link.counters() if link is not None else None
    out = {speed_key: nbytes / secs / 1e6, f"{prefix}fetched_MBps": (c1["fetched"] - c0["fetched"]) / secs / 1e6,
           f"{prefix}cold_cpu_s_per_GB": CpuMeter.per_gb(m0, m1, nbytes)}
    if l0 is not None and l1 is not None:
        out[f"{prefix}cold_link_MB"] = (l1.rx_bytes - l0.rx_bytes) / 1e6
    return out


def cold_s3_read_fanotify(url: str, env: dict[str, str], blob: str, work: Path, ceph_pids: dict[str, int],
                          link: Any = None) -> dict[str, Any]:
    """The same cold read on the fanotify data path (docs/fanotify.md): a fresh daemon with
    LAYERSTORE_DATA_PATH=fanotify and an empty cache, EROFS mounted buffered on the attached cache
    file, every chunk fetched on pre-content events."""
    from fuse_client.control import attach, detach

    cache = work / "cache-s3-fan"
    shutil.rmtree(cache, ignore_errors=True)
    try:
        with daemon(url, cache, work / "mnt-fuse-s3", work / "daemon.log",
                    {**env, "LAYERSTORE_DATA_PATH": "fanotify"}) as d:
            got = attach(cache, blob, "bench-read-s3")
            if got is None:
                raise RuntimeError("the daemon does not serve the fanotify data path here")
            try:
                with erofs_mount(Path(got["path"]), work) as m:
                    return measured_cold_read(d, blob, m, ceph_pids, link, "fanotify_cold_s3_MBps", "fanotify_")
            finally:
                detach(cache, blob, "bench-read-s3")
    finally:
        shutil.rmtree(cache, ignore_errors=True)


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
                     **cold_s3_read(url, env, layer.blob, work, ceph_pids, link),
                     **cold_s3_read_fanotify(url, env, layer.blob, work, ceph_pids, link)}
                if link is not None:
                    r["get_link_MB"] = get_link
                r["ratio"] = r["fuse_cold_s3_MBps"] / r["parallel_get_MBps"]
                r["fanotify_ratio"] = r["fanotify_cold_s3_MBps"] / r["parallel_get_MBps"]
                rounds.append(r)
                print(f"s3 {label}: parallel GET {r['parallel_get_MBps']:.0f} MB/s "
                      f"(GET+verify {r['parallel_get_chunk_MBps']:.0f}); "
                      f"fuse_cold_s3 seq {r['fuse_cold_s3_MBps']:.0f} MB/s ({r['ratio']:.2f}x, daemon "
                      f"{r['cold_cpu_s_per_GB']['daemon']:.2f} CPU s/GB); fanotify_cold_s3 "
                      f"{r['fanotify_cold_s3_MBps']:.0f} MB/s ({r['fanotify_ratio']:.2f}x, daemon "
                      f"{r['fanotify_cold_cpu_s_per_GB']['daemon']:.2f} CPU s/GB); "
                      f"load {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return summarize_s3(label, rounds)


def summarize_s3(label: str, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "link": label,
        "rounds": [{k: ({kk: round(vv, 2) for kk, vv in v.items()} if isinstance(v, dict)
                        else round(v, 3 if k.endswith("ratio") else 1)) for k, v in r.items()} for r in rounds],
        "cpu_s_per_GB_median": {
            phase: {k: round(statistics.median(r[phase][k] for r in rounds), 2) for k in rounds[0][phase]}
            for phase in ("get_cpu_s_per_GB", "cold_cpu_s_per_GB", "fanotify_cold_cpu_s_per_GB")},
        "parallel_get_MBps_best": round(max(r["parallel_get_MBps"] for r in rounds), 1),
        "parallel_get_MBps_median": round(statistics.median(r["parallel_get_MBps"] for r in rounds), 1),
        "fuse_cold_s3_MBps_best": round(max(r["fuse_cold_s3_MBps"] for r in rounds), 1),
        "fuse_cold_s3_MBps_median": round(statistics.median(r["fuse_cold_s3_MBps"] for r in rounds), 1),
        "ratio_best": round(max(r["fuse_cold_s3_MBps"] for r in rounds)
                            / max(r["parallel_get_MBps"] for r in rounds), 3),
        "ratio_paired_median": round(statistics.median(r["ratio"] for r in rounds), 3),
        "fanotify_cold_s3_MBps_best": round(max(r["fanotify_cold_s3_MBps"] for r in rounds), 1),
        "fanotify_cold_s3_MBps_median": round(statistics.median(r["fanotify_cold_s3_MBps"] for r in rounds), 1),
        "fanotify_ratio_paired_median": round(statistics.median(r["fanotify_ratio"] for r in rounds), 3),
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
