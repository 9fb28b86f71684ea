"""Fairness and batching of the node cache's store requests (docs/node-cache.md, "Fairness under
a burst"; docs/service.md, "Batched reads for the node daemon").

**fairness** (in-process, no kernel): the node cache (`LazyCache`) on a slow store: a local
directory behind `testkit.slow_store.SlowBackend`, which adds a latency to every request and sends
every object over one shared link (`--rate-mbit`, `--latency-ms`). A big prefetch of one blob
(every chunk) starts; once it is running, `--readers` sandboxes each make `--reads` first-touch
reads (4 KiB at the start of a chunk none has read, of their own blob), with a seeded think time
between reads. Measured per read: the time a reader waits (p50, p99, mean), and the prefetch's
time to complete. Contenders, alternated within each round, fresh cache each: `fifo` (one queue
in arrival order, background may take every slot: no priorities), `priority` (urgent first and
a quarter of the slots kept for it, no throttle: the limiter before this change), `fair` (the
daemon's default: `priority` plus background throttled to an eighth of the slots while urgent
work waits or runs).

**batching** (root, FUSE): the node daemon (`layerctl daemon`) reading one layer's blob file cold
and sequentially (1 MiB reads) through the store service (`layerctl serve`, 2 workers) in front
of a local store, with batched reads (`LAYERSTORE_FETCH_BATCH=16`, the default) and without (1),
alternating, a fresh cache and mount per read. MiB/s, the daemon's CPU seconds per read, and the
requests the service answered (batched reads, single GETs: from its /metrics).
**batching-s3**: the same with the service in front of S3 on the real single-node Ceph (started
here, ~2 s), plus the daemon reading S3 directly (the issue's peer for "over http").

    python bench/fetch_fairness.py [--size quick|full] [--rate-mbit 250] [--latency-ms 20]
                                   [--rounds N] [--readers N] [--reads N] [--big-mib N]
                                   [--batch-mib N] [--parts fairness,batching,batching-s3] [--out FILE]

The prefetch is sized to outlast the readers (every read is made while it runs; the results say
how many reads ended before it did: `during_prefetch`).

quick (the default, or $BENCH_SIZE): fairness with a 256 MiB prefetch, 4 readers x 10 reads, one
round (every contender once, fresh cache each: still the three side by side); batching with a 64
MiB layer, one round. full: 512 MiB, 8 x 16, 3 rounds; 128 MiB, 3 rounds. (Until issue 19's
benchmark-time work quick ran 2 rounds and 128 MiB: bench/results/fetch_fairness.json is such a run.)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import trio  # noqa: E402
from testkit.slow_store import SlowBackend  # noqa: E402

from fuse_client.nodecache import LazyCache, open_cache  # noqa: E402
from fuse_client.nodecache.fetcher import DEFAULT_CONCURRENCY, Fetcher  # noqa: E402
from layerstore.backends.posix import PosixBackend  # noqa: E402
from layerstore.chunkmap import ChunkMap, ChunkRef  # noqa: E402
from layerstore.store import Store  # noqa: E402

MiB = 1 << 20
CHUNK = MiB
DEFAULT_OUT = ROOT / "bench" / "results" / "fetch_fairness.json"
SIZES = {"quick": {"big_mib": 256, "readers": 4, "reads": 10, "rounds": 1, "batch_mib": 64},
         "full": {"big_mib": 512, "readers": 8, "reads": 16, "rounds": 3, "batch_mib": 128}}
CONTENDERS = {"fifo": {"priorities": False}, "priority": {"background_busy": 10**6}, "fair": {}}


def put_blob(store: Store, nchunks: int, seed: int) -> ChunkMap:
    """A blob of `nchunks` incompressible 1 MiB chunks."""
    rng = random.Random(seed)
    refs = []
    for n in range(nchunks):
        digest, _ = store.put_chunk(rng.randbytes(CHUNK))
        refs.append(ChunkRef(n * CHUNK, CHUNK, digest, 0))
    cmap = ChunkMap.build(refs)
    store.put_chunk_map(cmap)
    return cmap


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


async def fairness_run(store: Store, cache_dir: Path, big: ChunkMap, images: list[ChunkMap], reads: int,
                       seed: int, fetcher_kw: dict[str, Any]) -> dict[str, Any]:
    with contextlib.ExitStack() as stack:
        cache = open_cache(cache_dir, None, stack)
        async with trio.open_nursery() as nursery:
            await nursery.start(cache.run)
            lazy = LazyCache(cache, store, nursery=nursery, deadline=120.0, batch=1)
            lazy.fetcher = Fetcher(store, cache, lazy.stats, nursery=nursery, deadline=120.0, batch=1, **fetcher_kw)
            e_big = await lazy.entry(big.blob)
            entries = [await lazy.entry(cm.blob) for cm in images]
            t0 = trio.current_time()
            prefetch_done: list[float] = []

            async def prefetch() -> None:
                await lazy.fetcher.prefetch(e_big, list(range(len(big.chunks))))
                prefetch_done.append(trio.current_time() - t0)

            nursery.start_soon(prefetch)
            await trio.sleep(0.3)  # the prefetch fills its slots and the link
            waits: list[float] = []
            starts: list[float] = []

            async def sandbox(k: int) -> None:
                rng = random.Random(seed * 1000 + k)
                entry = entries[k]
                order = rng.sample(range(len(entry.present)), reads)
                reader = lazy.open_reader(entry)
                try:
                    for i in order:
                        t = trio.current_time()
                        await reader.read_missing(i * CHUNK, 4096)
                        waits.append(trio.current_time() - t)
                        starts.append(t - t0)
                        await trio.sleep(rng.uniform(0.05, 0.2))
                finally:
                    reader.close()

            async with trio.open_nursery() as sandboxes:
                for k in range(len(entries)):
                    sandboxes.start_soon(sandbox, k)
            readers_done = trio.current_time() - t0
            with trio.fail_after(600):
                while not prefetch_done:
                    await trio.sleep(0.05)
            await cache.shutdown_flush()
            nursery.cancel_scope.cancel()
    during = [w for w, t in zip(waits, starts, strict=True) if t + w <= prefetch_done[0]]
    return {"during_prefetch": len(during),
            "p50_ms": round(pct(waits, 0.5) * 1000, 1), "p99_ms": round(pct(waits, 0.99) * 1000, 1),
            "mean_ms": round(statistics.mean(waits) * 1000, 1), "max_ms": round(max(waits) * 1000, 1),
            "reads": len(waits), "readers_done_s": round(readers_done, 2),
            "prefetch_s": round(prefetch_done[0], 2), "waits_ms": [round(w * 1000, 1) for w in waits]}


def fairness(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    inner = PosixBackend(work / "store", fsync=False)
    inner.create()
    slow = SlowBackend(inner, latency=args.latency_ms / 1000, rate=args.rate_mbit * 1e6 / 8)
    store = Store(slow)
    store.init()
    slow.link.rate, latency = None, slow.latency  # no shaping while the blobs are pushed
    slow.latency = 0.0
    big = put_blob(store, args.big_mib, 1)
    images = [put_blob(store, args.reads + 4, 100 + k) for k in range(args.readers)]
    slow.link.rate, slow.latency = args.rate_mbit * 1e6 / 8, latency
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in CONTENDERS}
    for rnd in range(args.rounds):
        names = list(CONTENDERS) if rnd % 2 == 0 else list(reversed(CONTENDERS))
        for name in names:
            cache_dir = work / f"cache-{name}-{rnd}"
            r = trio.run(fairness_run, store, cache_dir, big, images, args.reads, rnd, CONTENDERS[name])
            shutil.rmtree(cache_dir, ignore_errors=True)
            r["load"] = round(os.getloadavg()[0], 1)
            runs[name].append(r)
            print(f"round {rnd + 1} {name:8s}: first touch p50 {r['p50_ms']:7.1f} ms p99 {r['p99_ms']:7.1f} ms "
                  f"mean {r['mean_ms']:7.1f} ms; prefetch {r['prefetch_s']:.1f} s (load {r['load']})", file=sys.stderr)
    summary: dict[str, Any] = {}
    for name, rs in runs.items():
        waits = [w for r in rs for w in r["waits_ms"]]
        summary[name] = {"p50_ms": round(pct(waits, 0.5), 1), "p99_ms": round(pct(waits, 0.99), 1),
                         "mean_ms": round(statistics.mean(waits), 1), "reads": len(waits),
                         "reads_during_prefetch": sum(r["during_prefetch"] for r in rs),
                         "prefetch_s_median": sorted(r["prefetch_s"] for r in rs)[len(rs) // 2]}
    fair, fifo, prio = summary["fair"], summary["fifo"], summary["priority"]
    return {
        "store": {"rate_mbit": args.rate_mbit, "latency_ms": args.latency_ms, "chunk_bytes": CHUNK,
                  "concurrency": DEFAULT_CONCURRENCY},
        "prefetch_mib": args.big_mib, "readers": args.readers, "reads_per_reader": args.reads,
        "summary": summary,
        "ratio_fifo_to_fair": {"p50": round(fifo["p50_ms"] / fair["p50_ms"], 2),
                               "p99": round(fifo["p99_ms"] / fair["p99_ms"], 2)},
        "ratio_priority_to_fair": {"p50": round(prio["p50_ms"] / fair["p50_ms"], 2),
                                   "p99": round(prio["p99_ms"] / fair["p99_ms"], 2)},
        "runs": {k: [{x: y for x, y in r.items() if x != "waits_ms"} for r in rs] for k, rs in runs.items()},
    }


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def service_requests(url: str) -> dict[str, float]:
    """Requests the service answered, per "METHOD route", from its /metrics."""
    import httpx

    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("layerstore_service_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            lab = dict(kv.split("=", 1) for kv in labels[labels.index("{") + 1:-1].split(","))
            key = f"{lab['method'].strip(chr(34))} {lab['route'].strip(chr(34))}"
            out[key] = out.get(key, 0.0) + float(value)
    return out


def batching(work: Path, args: argparse.Namespace, behind: str) -> dict[str, Any]:
    """Cold read through the node daemon over the store service in front of `behind` ("local"
    or "s3"), batched reads on and off; for S3 also the daemon on S3 directly."""
    from testkit.ceph_cluster import CephCluster
    from testkit.fuse_helpers import DaemonProcess, build_and_push, make_tree
    from testkit.store_service import make_tokens, start_service

    from fuse_client.control import request_json

    ceph: CephCluster | None = None
    env: dict[str, str] = {}
    if behind == "s3":
        ceph = CephCluster(work / "ceph")
        ceph.start(cephfs=False)
        env = {**ceph.s3_env(), "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}
        os.environ.update(env)  # for the push made in this process
        inner = f"s3://bench-batching/store?endpoint={ceph.endpoint}"
    else:
        inner = str(work / f"http-store-{behind}")
    svc = None
    try:
        with Store.open(inner) as s:
            s.init()
            src = make_tree(work / f"batch-src-{behind}", small=4, big=(args.batch_mib * MiB,))
            layer = build_and_push(s, src, work / f"batch-image-{behind}.erofs")
        tokens = make_tokens(work / f"tokens-{behind}.json", {"node": ["read", "lease"]})
        svc = start_service(inner, work / f"service-{behind}", tokens=work / f"tokens-{behind}.json", workers=2,
                            env=env)
        node_env = {**env, "LAYERSTORE_TOKEN": tokens["node"]}
        kinds = {"batched": (svc.url, {**node_env, "LAYERSTORE_FETCH_BATCH": "16"}),
                 "single": (svc.url, {**node_env, "LAYERSTORE_FETCH_BATCH": "1"})}
        for size in args.batch_sizes:
            kinds[f"batched-{size}"] = (svc.url, {**node_env, "LAYERSTORE_FETCH_BATCH": str(size)})
        if behind == "s3":
            kinds["s3-direct"] = (inner, env)
        runs: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
        for rnd in range(args.rounds):
            names = list(kinds) if rnd % 2 == 0 else list(reversed(kinds))
            for kind in names:
                place = work / f"daemon-{behind}-{kind}-{rnd}"
                url, kind_env = kinds[kind]
                d = DaemonProcess(url, place / "cache", place / "mnt", env=kind_env,
                                  log=work / f"daemon-{behind}-{kind}.log")
                try:
                    d.start()
                    req0 = service_requests(svc.url)
                    cpu0 = cpu_seconds(d.pid)
                    t0 = time.perf_counter()
                    n = 0
                    with open(d.blob(layer.blob), "rb", buffering=0) as f:
                        while part := f.read(MiB):
                            n += len(part)
                    secs = time.perf_counter() - t0
                    cpu = cpu_seconds(d.pid) - cpu0
                    time.sleep(0.5)  # the service counts a request once its answer is sent whole
                    req1 = service_requests(svc.url)
                    delta = {k: v - req0.get(k, 0) for k, v in req1.items()}
                    d.stop()
                    d.cleanup()
                    shutil.rmtree(place, ignore_errors=True)
                    # The whole blob at once (`prefetch --all --wait`, a fresh cache): as many
                    # chunks wanted as there are, where batches have room to pay.
                    d = DaemonProcess(url, place / "cache", place / "mnt", env=kind_env,
                                      log=work / f"daemon-{behind}-{kind}.log")
                    d.start()
                    cpu1 = cpu_seconds(d.pid)
                    t1 = time.perf_counter()
                    got = request_json(place / "cache", "POST", "/prefetch",
                                       {"blob": layer.blob, "all": True, "wait": True}, timeout=600)
                    psecs = time.perf_counter() - t1
                    pcpu = cpu_seconds(d.pid) - cpu1
                    runs[kind].append({"mib_s": round(n / MiB / secs, 1), "daemon_cpu_s": round(cpu, 2),
                                       "load": round(os.getloadavg()[0], 1),
                                       "batched_requests": delta.get("POST /v1/batch", 0),
                                       "object_gets": delta.get("GET /v1/objects/{key:path}", 0),
                                       "prefetch_all_mib_s": round(layer.size / MiB / psecs, 1),
                                       "prefetch_all_daemon_cpu_s": round(pcpu, 2),
                                       "prefetch_all_failed": got.get("failed")})
                    d.stop()
                finally:
                    d.cleanup()
                    shutil.rmtree(place, ignore_errors=True)
                r = runs[kind][-1]
                print(f"round {rnd + 1} daemon, {behind}, {kind:9s}: cold read {r['mib_s']:7.1f} MiB/s, daemon CPU "
                      f"{r['daemon_cpu_s']:.2f} s for {n / MiB:.0f} MiB, {r['batched_requests']:.0f} batches, "
                      f"{r['object_gets']:.0f} GETs; prefetch --all {r['prefetch_all_mib_s']:7.1f} MiB/s, CPU "
                      f"{r['prefetch_all_daemon_cpu_s']:.2f} s (load {r['load']})", file=sys.stderr)
    finally:
        if svc is not None:
            svc.stop()
        if ceph is not None:
            ceph.stop()
    med = {k: sorted(r["mib_s"] for r in v)[len(v) // 2] for k, v in runs.items()}
    cpu = {k: sorted(r["daemon_cpu_s"] for r in v)[len(v) // 2] for k, v in runs.items()}
    pmed = {k: sorted(r["prefetch_all_mib_s"] for r in v)[len(v) // 2] for k, v in runs.items()}
    pcpu = {k: sorted(r["prefetch_all_daemon_cpu_s"] for r in v)[len(v) // 2] for k, v in runs.items()}
    paired = [round(x["mib_s"] / y["mib_s"], 2) for x, y in zip(runs["batched"], runs["single"], strict=True)]
    out = {"behind": behind, "blob_mib": round(layer.size / MiB, 1), "mib_s": med, "daemon_cpu_s": cpu,
           "runs": runs, "ratio_batched_to_single": round(med["batched"] / med["single"], 3),
           "ratio_batched_to_single_per_round": paired,
           "cpu_ratio_batched_to_single": round(cpu["batched"] / cpu["single"], 3) if cpu["single"] else None,
           "prefetch_all_mib_s": pmed, "prefetch_all_daemon_cpu_s": pcpu,
           "prefetch_all_ratio_batched_to_single": round(pmed["batched"] / pmed["single"], 3),
           "prefetch_all_cpu_ratio_batched_to_single": round(pcpu["batched"] / pcpu["single"], 3)
           if pcpu["single"] else None}
    if "s3-direct" in med:
        out["ratio_http_batched_to_s3"] = round(med["batched"] / med["s3-direct"], 3)
        out["ratio_http_single_to_s3"] = round(med["single"] / med["s3-direct"], 3)
    return out


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default=os.environ.get("BENCH_SIZE") or "quick")
    ap.add_argument("--rate-mbit", type=float, default=250.0, help="the slow store's link (fairness)")
    ap.add_argument("--latency-ms", type=float, default=20.0, help="the slow store's latency per request")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--readers", type=int)
    ap.add_argument("--reads", type=int)
    ap.add_argument("--big-mib", type=int)
    ap.add_argument("--batch-mib", type=int)
    ap.add_argument("--parts", default="fairness,batching,batching-s3")
    ap.add_argument("--batch-sizes", type=lambda v: [int(x) for x in v.split(",") if x], default=[],
                    help="more batch sizes to compare beside 16 and 1 (e.g. 4,8)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    if args.size not in SIZES:
        args.size = "quick"
    for k, v in SIZES[args.size].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if bad := [k for k in SIZES[args.size] if getattr(args, k) < 1]:
        ap.error(", ".join(f"--{k.replace('_', '-')}" for k in bad) + ": must be at least 1")
    if not (args.rate_mbit > 0 and args.latency_ms >= 0) or any(b < 1 for b in args.batch_sizes):
        ap.error("--rate-mbit must be > 0, --latency-ms >= 0, every --batch-sizes at least 1")
    parts = set(args.parts.split(","))
    if unknown := parts - {"fairness", "batching", "batching-s3"}:
        ap.error(f"--parts: unknown {', '.join(sorted(unknown))} (fairness, batching, batching-s3)")
    out: dict[str, Any] = {"bench": "fetch_fairness", "size": args.size, "git": git_commit(),
                           "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                           "cpus": os.cpu_count(), "load_at_start": round(os.getloadavg()[0], 1)}
    with tempfile.TemporaryDirectory(prefix="fetch-fairness-") as tmp:
        work = Path(tmp)
        if "fairness" in parts:
            out["fairness"] = fairness(work, args)
        for behind in ("local", "s3"):
            part = "batching" if behind == "local" else "batching-s3"
            if part not in parts:
                continue
            if os.geteuid() != 0:
                print(f"{part}: needs root (FUSE); skipped", file=sys.stderr)
                out[part] = None
            else:
                out[part] = batching(work, args, behind)
    out["load_at_end"] = round(os.getloadavg()[0], 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    shown = {k: v for k, v in out.items() if k in ("fairness", "batching", "batching-s3")}
    print(json.dumps(shown, indent=1, default=str)[:3000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
