"""Store throughput per backend: put and get MiB/s of ~1 MiB chunks through `Store`, for 1 and N
parallel clients, on a local directory (the baseline), CephFS via ceph-fuse, S3 on radosgw, and the
HTTP store service (`layerctl serve`, 2 uvicorn workers, with tokens) in front of a local
directory (`http`) and in front of radosgw (`http-s3`), each compared with the same store
accessed directly in the same run (`ratio_http_to_direct`).

A client is a separate process with its own `Store` (and so its own thread pool and, for S3, its
own boto3 client), like separate sandbox nodes sharing one store. Each client stores distinct,
mostly incompressible chunks with `put_chunks`, then reads every one back with `get_chunk`
(decompress + blake3 verify included), then reads them all again `--batch` chunks a call of the
Backend's `load_many` (`get_batched`: the service's batched read over http, a `load` each on the
other backends; each chunk verified as `get_chunk` does). Throughput is the bytes of payload moved
by all clients divided by the wall time from the first client's start to the last client's end.
Each read phase also counts the CPU time it cost per MiB (the clients' own, plus the service's
processes' from the scheduler's accounting): on saturated cores that ratio is the throughput
ratio, and it moves far less with other work on the machine than wall time does.
`loopback_floor_cpu_ms_per_mib` is the CPU a bare TCP transfer of the same buffers costs on this
host (no HTTP, no Python protocol code): `best_possible_over_loopback` is the ratio a service over
loopback could reach at best against the direct local read.

The Ceph cluster is started here through testkit.ceph_cluster (and stopped at the end), unless
`--ceph-dir DIR` names one left running by `python testkit.ceph_cluster start DIR`.

    python bench/store_throughput.py [--size quick|full] [--size-mib N] [--repeat N] [--clients 1,8]
                                     [--backends local,cephfs,s3,http,http-s3] [--daemon-mib N] [--batch N]

With s3 and http-s3 among the backends (and root, for FUSE), `daemon_cold_read` also compares a
node daemon (`layerctl daemon`) reading one layer cold, sequentially, straight from S3 against the
same daemon whose store is the service in front of that same bucket: one layer of a file of
`--daemon-mib` MiB pushed once, a fresh cache and mount for every read, the two kinds alternating
within each round.

`--size` defaults to $BENCH_SIZE (as `make bench` sets it), else quick: 64 MiB a run, one round,
1 and 4 clients, every backend but CephFS, a 32 MiB layer for the daemon (about a minute; the
earlier quick, 128 MiB, 2 rounds, 1 and 8 clients, every backend, took ~4 minutes at load 8-17);
full: 256 MiB a run, 3 rounds, 1 and 8 clients, every backend, 64 MiB. Explicit options win. (The
committed bench/results/store_throughput.json is a run of that earlier quick size.)
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import platform
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from testkit.ceph_cluster import CephCluster  # noqa: E402
from testkit.fuse_helpers import DaemonProcess, build_and_push, make_tree  # noqa: E402
from testkit.store_service import Service, make_tokens, start_service  # noqa: E402

from layerstore import chunkobj  # noqa: E402
from layerstore.store import DEFAULT_WORKERS, MAX_OBJECT_SIZE, Store  # noqa: E402

MiB = 1 << 20
DEFAULT_OUT = ROOT / "bench" / "results" / "store_throughput.json"
# quick: CephFS left out (no peer of its own in the run) and 4 clients, not 8 (each client is a
# process that imports the project and boto3: ~1 CPU-second each before it moves a byte)
SIZES: dict[str, dict[str, Any]] = {
    "quick": {"size_mib": 64, "repeat": 1, "daemon_mib": 32, "clients": "1,4", "backends": "local,s3,http,http-s3"},
    "full": {"size_mib": 256, "repeat": 3, "daemon_mib": 64, "clients": "1,8",
             "backends": "local,cephfs,s3,http,http-s3"}}


def make_chunk(seed: int, size: int) -> bytes:
    """Mostly incompressible: 7/8 random bytes, 1/8 repeated text (zstd gains a little)."""
    rnd = random.Random(seed).randbytes(size - size // 8)
    text = (f"chunk {seed} ".encode() * (size // 8 // 8 + 1))[: size // 8]
    return rnd + text


def client(url: str, env: dict[str, str], index: int, nchunks: int, chunk_size: int, batch: int, barrier: Any,
           results: Any) -> None:
    os.environ.update(env)
    payloads = [make_chunk(index * 1_000_003 + i, chunk_size) for i in range(nchunks)]
    with Store.open(url) as store:
        barrier.wait()
        t0 = time.time()
        digests, stored = [], 0
        for digest, stats in store.put_chunks(payloads):
            digests.append(digest)
            stored += stats.stored_bytes
        t1 = time.time()
        barrier.wait()
        t2, c2 = time.time(), time.process_time()
        ok = True
        for payload, data in zip(payloads, store.pool.map(store.get_chunk, digests), strict=True):
            ok = ok and data == payload
        t3, c3 = time.time(), time.process_time()
        barrier.wait()
        # The same reads, `batch` chunks a call of the Backend's `load_many` (the service's batched
        # read over http, a `load` each on the others), each chunk verified as `get_chunk` does.
        batches = [digests[i : i + batch] for i in range(0, len(digests), batch)]
        t4, c4 = time.time(), time.process_time()
        for ds, datas in zip(batches, store.pool.map(lambda ds: read_batch(store, ds), batches), strict=True):
            ok = ok and datas == payloads[digests.index(ds[0]) : digests.index(ds[0]) + len(ds)]
        t5, c5 = time.time(), time.process_time()
        barrier.wait()
    results.put({"client": index, "put": (t0, t1), "get": (t2, t3), "get_batched": (t4, t5),
                 "cpu": {"get": c3 - c2, "get_batched": c5 - c4},
                 "bytes": nchunks * chunk_size, "stored_bytes": stored, "ok": ok,
                 "first": digests[0] if digests else None})


def read_batch(store: Store, digests: list[str]) -> list[bytes]:
    out = []
    for (_key, data), digest in zip(store.backend.load_many([store.chunk_key(d) for d in digests],
                                                            max_size=MAX_OBJECT_SIZE["chunks"]), digests, strict=True):
        if isinstance(data, Exception):
            raise data
        out.append(chunkobj.decode(data, digest))
    return out


def run(url: str, env: dict[str, str], nclients: int, total_mib: int, chunk_size: int, batch: int) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    with Store.open(url) as s:
        s.init()
    nchunks = max(1, total_mib * MiB // chunk_size // nclients)
    barrier = ctx.Barrier(nclients + 1)  # and this process, to take the service's CPU time per phase
    results = ctx.Queue()
    procs = [ctx.Process(target=client, args=(url, env, i, nchunks, chunk_size, batch, barrier, results))
             for i in range(nclients)]
    for p in procs:
        p.start()
    service = SERVICES[url][0].proc.pid if url in SERVICES else None
    marks = []
    for _ in range(4):  # before the puts, the gets, the batched gets, after them
        barrier.wait(1800)
        marks.append(group_cpu(service) if service else 0.0)
    out = [results.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join(60)
        if p.exitcode != 0:
            raise SystemExit(f"a client failed (exit {p.exitcode})")
    if not all(r["ok"] for r in out):
        raise SystemExit(f"{url}: data read back differs from data written")
    moved = sum(r["bytes"] for r in out)
    put_s = max(r["put"][1] for r in out) - min(r["put"][0] for r in out)
    get_s = max(r["get"][1] for r in out) - min(r["get"][0] for r in out)
    batched_s = max(r["get_batched"][1] for r in out) - min(r["get_batched"][0] for r in out)
    return {
        "clients": nclients,
        "chunks": nchunks * nclients,
        "payload_mib": round(moved / MiB, 1),
        "stored_mib": round(sum(r["stored_bytes"] for r in out) / MiB, 1),
        "put_seconds": round(put_s, 3),
        "get_seconds": round(get_s, 3),
        "put_mib_s": round(moved / MiB / put_s, 1),
        "get_mib_s": round(moved / MiB / get_s, 1),
        "get_batched_mib_s": round(moved / MiB / batched_s, 1),
        # CPU time (clients + the service, all cores) per MiB read: what the throughput is on
        # saturated cores, less shaken by other work on the machine than wall time
        "cpu_ms_per_mib": {what: round((sum(r["cpu"][what] for r in out) + service_s) * 1000 / (moved / MiB), 3)
                           for what, service_s in (("get", marks[2] - marks[1]), ("get_batched", marks[3] - marks[2]))},
        "service_cpu_ms_per_mib": {"get": round((marks[2] - marks[1]) * 1000 / (moved / MiB), 3),
                                   "get_batched": round((marks[3] - marks[2]) * 1000 / (moved / MiB), 3)},
    }


def group_cpu(pgid: int) -> float:
    """CPU seconds of the live threads of process group `pgid` (the service and its workers), from
    the scheduler's own accounting (`schedstat`, nanoseconds: the ticks of `stat` are too coarse
    for a phase of a second)."""
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            for tid in os.listdir(f"/proc/{pid}/task"):
                total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return total / 1e9


def loopback_floor(mib: int, chunk_size: int) -> float:
    """CPU ms per MiB of moving `chunk_size` buffers over a loopback TCP connection with no
    protocol at all (one thread `sendall`, another `recv_into` a reused buffer): what any service
    on this host costs at least on top of reading the store directly, whatever its HTTP stack."""
    listener = socket.create_server(("127.0.0.1", 0))
    data = random.Random(1).randbytes(chunk_size)
    count = max(1, mib * MiB // chunk_size)
    with listener, socket.create_connection(listener.getsockname()) as rx:
        tx, _ = listener.accept()
        with tx:
            sender = threading.Thread(target=lambda: [tx.sendall(data) for _ in range(count)])
            view = memoryview(bytearray(chunk_size))
            c0 = time.process_time()
            sender.start()
            for _ in range(count):
                got = 0
                while got < chunk_size:
                    got += rx.recv_into(view[got:], chunk_size - got)
            sender.join()
            return round((time.process_time() - c0) * 1000 / (count * chunk_size / MiB), 3)


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The first run with the median figures for put and get (each taken on its own), plus every
    run's figures: other work on a shared machine shows up as spread."""
    out = dict(runs[0])
    for what in ("put", "get", "get_batched"):
        values = sorted(r[f"{what}_mib_s"] for r in runs)
        out[f"{what}_mib_s"] = values[len(values) // 2]
        out[f"{what}_mib_s_runs"] = [r[f"{what}_mib_s"] for r in runs]
    out["cpu_ms_per_mib"] = dict(runs[0]["cpu_ms_per_mib"])
    out.pop("service_cpu_ms_per_mib", None)
    out["service_cpu_ms_per_mib_runs"] = [r["service_cpu_ms_per_mib"] for r in runs]
    for what in ("get", "get_batched"):
        values = sorted(r["cpu_ms_per_mib"][what] for r in runs)
        out["cpu_ms_per_mib"][what] = values[len(values) // 2]
        out.setdefault("cpu_ms_per_mib_runs", {})[what] = [r["cpu_ms_per_mib"][what] for r in runs]
    out.pop("put_seconds", None)
    out.pop("get_seconds", None)
    return out


def machine_info(ceph: CephCluster | None) -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_kib = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_kib = int(line.split()[1])
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu": cpu, "cores": os.cpu_count(), "mem_gib": round(mem_kib / (1 << 20), 1),
        "kernel": platform.release(), "python": platform.python_version(),
        "loadavg_at_start": os.getloadavg()[0],
    }
    try:
        import boto3

        info["boto3"] = boto3.__version__
    except ImportError:
        pass
    if ceph is not None:
        info.pop("loadavg_at_start")
        with_version = subprocess.run(["ceph", "--version"], capture_output=True, text=True, check=False)
        info["ceph"] = with_version.stdout.strip()
        info["ceph_osd"] = "one memstore OSD, pool size 1, on the same cores as the clients"
    return info


def git_commit() -> str | None:
    p = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                       check=False)
    return p.stdout.strip() or None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default=os.environ.get("BENCH_SIZE", "quick"))
    ap.add_argument("--size-mib", type=int, help="payload per run, split among the clients")
    ap.add_argument("--chunk-kib", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8, help="chunks per load_many call in the batched get phase")
    ap.add_argument("--clients", default=None, help="comma-separated client counts (default: the size's)")
    ap.add_argument("--backends", default=None, help="of local,cephfs,s3,http,http-s3 (default: the size's)")
    ap.add_argument("--repeat", type=int, help="rounds over every point; medians are reported")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--workdir", type=Path, help="where the local store and the cluster live (default: a temp dir)")
    ap.add_argument("--daemon-mib", type=int, default=None,
                    help="layer size of the daemon cold read (0: skip it; default: the size's)")
    ap.add_argument("--ceph-dir", type=Path, help="use a cluster left running by `ceph_cluster.py start DIR`")
    args = ap.parse_args(argv)
    if args.size_mib is None:
        args.size_mib = SIZES[args.size]["size_mib"]
    if args.repeat is None:
        args.repeat = SIZES[args.size]["repeat"]
    for name in ("daemon_mib", "clients", "backends"):
        if getattr(args, name) is None:
            setattr(args, name, SIZES[args.size][name])
    try:
        clients = [int(c) for c in args.clients.split(",")]
    except ValueError:
        ap.error(f"--clients: {args.clients!r} is not a comma-separated list of whole numbers")
    if min(clients, default=0) < 1 or args.size_mib < 1 or args.repeat < 1 or args.chunk_kib < 1 or args.batch < 1 \
            or args.daemon_mib < 0:
        ap.error("--clients, --size-mib, --repeat, --chunk-kib and --batch must be at least 1, --daemon-mib at least 0")
    backends = args.backends.split(",")
    unknown = set(backends) - {"local", "cephfs", "s3", "http", "http-s3"}
    if unknown:
        ap.error(f"unknown backend(s) {sorted(unknown)}")
    chunk_size = args.chunk_kib * 1024

    work = Path(tempfile.mkdtemp(prefix="store-bench-", dir=args.workdir))
    ceph: CephCluster | None = None
    owned = False
    machine = machine_info(None)
    results: dict[str, dict[str, Any]] = {}
    daemon: dict[str, Any] | None = None
    floors: list[float] = []
    try:
        if {"cephfs", "s3", "http-s3"} & set(backends):
            if args.ceph_dir:
                ceph = CephCluster.adopt(args.ceph_dir)
            else:
                ceph, owned = CephCluster(work / "ceph"), True
                ceph.start()
                print(f"ceph: S3 ready in {ceph.timings['s3_ready']:.1f}s, CephFS in "
                      f"{ceph.timings['cephfs_mounted']:.1f}s", file=sys.stderr)
            machine.update(machine_info(ceph))
        # Rounds go over every point before the next round starts, so that load from elsewhere on a
        # shared machine spreads over all backends instead of hitting one.
        samples: dict[tuple[str, int], list[dict[str, Any]]] = {(b, n): [] for b in backends for n in clients}
        for rnd in range(max(args.repeat, 1)):
            for backend in backends:
                for n in clients:
                    url, env = location(backend, n, work, ceph)
                    r = run(url, env, n, args.size_mib, chunk_size, args.batch)
                    samples[backend, n].append(r)
                    cleanup(backend, url, work)
                    print(f"round {rnd + 1} {backend:7s} clients={n}: put {r['put_mib_s']:8.1f} MiB/s  "
                          f"get {r['get_mib_s']:8.1f} MiB/s  batched {r['get_batched_mib_s']:8.1f} MiB/s  "
                          f"(load {os.getloadavg()[0]:.1f})", file=sys.stderr)
            floors.append(loopback_floor(args.size_mib, chunk_size))
        for (backend, n), runs in samples.items():
            results.setdefault(backend, {})[str(n)] = median_run(runs)
        if args.daemon_mib and ceph is not None and {"s3", "http-s3"} <= set(backends) and os.geteuid() == 0:
            daemon = daemon_cold_read(work, ceph, args.daemon_mib, max(args.repeat, 1))
    finally:
        for svc, _inner, _token in SERVICES.values():  # a run that failed left its service up
            svc.stop()
        if ceph is not None and owned:
            ceph.stop()
        shutil.rmtree(work, ignore_errors=True)

    ratios: dict[str, Any] = {}
    if "local" in results:
        for backend, per in results.items():
            if backend == "local":
                continue
            ratios[backend] = {
                n: {"put": round(r["put_mib_s"] / results["local"][n]["put_mib_s"], 3),
                    "get": round(r["get_mib_s"] / results["local"][n]["get_mib_s"], 3),
                    "get_batched": round(r["get_batched_mib_s"] / results["local"][n]["get_batched_mib_s"], 3)}
                for n, r in per.items() if n in results["local"]
            }
    via_http: dict[str, Any] = {}
    for http, direct in (("http", "local"), ("http-s3", "s3")):
        if http in results and direct in results:
            via_http[f"{http}/{direct}"] = {
                n: {"put": round(r["put_mib_s"] / results[direct][n]["put_mib_s"], 3),
                    "get": round(r["get_mib_s"] / results[direct][n]["get_mib_s"], 3),
                    "get_batched": round(r["get_batched_mib_s"] / results[direct][n]["get_batched_mib_s"], 3),
                    "cpu_get": round(results[direct][n]["cpu_ms_per_mib"]["get"] / r["cpu_ms_per_mib"]["get"], 3),
                    "cpu_get_batched": round(results[direct][n]["cpu_ms_per_mib"]["get_batched"]
                                             / r["cpu_ms_per_mib"]["get_batched"], 3)}
                for n, r in results[http].items() if n in results[direct]}
    floor = sorted(floors)[len(floors) // 2] if floors else None
    if floor and "local" in results:
        # the best any service could do over loopback TCP on this host: direct CPU plus the floor
        via_http["best_possible_over_loopback"] = {
            n: round(r["cpu_ms_per_mib"]["get"] / (r["cpu_ms_per_mib"]["get"] + floor), 3)
            for n, r in results["local"].items()}
    doc = {
        "benchmark": "store_throughput",
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "git": git_commit(),
        "machine": {**machine, "loadavg_at_end": os.getloadavg()[0]},
        "params": {"size": args.size, "size_mib_per_run": args.size_mib, "chunk_kib": args.chunk_kib,
                   "batch": args.batch,
                   "clients": clients, "repeat": args.repeat,
                   "store_workers_per_client": DEFAULT_WORKERS,
                   "data": "7/8 random bytes + 1/8 repeated text per chunk, distinct chunks per client"},
        "results_mib_s": results,
        "ratio_to_local": ratios,
        "ratio_http_to_direct": via_http,
        "loopback_floor_cpu_ms_per_mib": {"median": floor, "runs": floors},
        "daemon_cold_read": daemon,
        "notes": [
            "local: PosixBackend on the machine's disk with fsync; gets are served from the page cache",
            "cephfs: PosixBackend on one ceph-fuse mount shared by all clients (one node)",
            "s3: S3Backend (boto3) against radosgw, path-style, If-None-Match create-once",
            "http, http-s3: HttpBackend (httpx) -> layerctl serve (2 uvicorn workers, a push:* token) -> "
            "PosixBackend on the local disk / S3Backend on radosgw; the service checks every chunk "
            "(decompress + blake3) before storing it; it runs on the same cores as the clients",
            "Ceph daemons, clients, zstd and blake3 all share the same cores",
            "daemon_cold_read: layerctl daemon, a fresh cache and mount per read, reading one layer's blob file "
            "sequentially in 1 MiB reads, straight on S3 and through the service (in front of the same bucket), "
            "alternating within each round",
        ],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


SERVICES: dict[str, tuple[Service, str, str]] = {}  # service URL -> (service, the store behind, its token)


def location(backend: str, n: int, work: Path, ceph: CephCluster | None) -> tuple[str, dict[str, str]]:
    tag = f"run-{n}-{os.getpid()}-{time.monotonic_ns() % 10**6}"
    if backend == "local":
        return str(work / "local" / tag), {}
    if backend == "http":
        return serve(str(work / "local" / tag), work, {})
    assert ceph is not None
    if backend == "cephfs":
        return str(ceph.mount_path / "bench" / tag), {}
    env = {**ceph.s3_env(), "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}
    os.environ.update(env)  # for the init done in this process
    url = f"s3://bench-{tag}/store?endpoint={ceph.endpoint}"
    if backend == "http-s3":
        return serve(url, work, env)
    return url, env


def daemon_cold_read(work: Path, ceph: CephCluster, mib: int, rounds: int) -> dict[str, Any]:
    """MiB/s of a cold sequential read of one layer's blob file through a node daemon on S3 and on
    the service in front of the same bucket (alternating, a fresh cache and mount each time)."""
    url, env = location("s3", 1, work, ceph)
    with Store.open(url) as s:
        s.init()
        src = make_tree(work / "daemon-src", small=4, big=(mib * MiB,))
        layer = build_and_push(s, src, work / "daemon-image.erofs")
    http_url, http_env = serve(url, work, env)
    kinds = {"s3": (url, env), "http-s3": (http_url, http_env)}
    runs: dict[str, list[float]] = {k: [] for k in kinds}
    try:
        for rnd in range(rounds):
            for kind, (store_url, kind_env) in kinds.items():
                place = work / f"daemon-{kind}-{rnd}"
                d = DaemonProcess(store_url, place / "cache", place / "mnt", env=kind_env,
                                  log=work / f"daemon-{kind}.log")
                try:
                    d.start()
                    t0 = time.perf_counter()
                    with open(d.blob(layer.blob), "rb", buffering=0) as f:
                        n = 0
                        while part := f.read(MiB):
                            n += len(part)
                    runs[kind].append(round(n / MiB / (time.perf_counter() - t0), 1))
                    d.stop()
                finally:
                    d.cleanup()
                    shutil.rmtree(place, ignore_errors=True)
                print(f"round {rnd + 1} daemon {kind:7s}: cold read {runs[kind][-1]:8.1f} MiB/s of {n / MiB:.0f} MiB "
                      f"(load {os.getloadavg()[0]:.1f})", file=sys.stderr)
    finally:
        cleanup("http-s3", http_url, work)
    med = {k: sorted(v)[len(v) // 2] for k, v in runs.items()}
    return {"blob_mib": round(layer.size / MiB, 1), "mib_s": med, "mib_s_runs": runs,
            "ratio_http_to_s3": round(med["http-s3"] / med["s3"], 3)}


def serve(inner: str, work: Path, env: dict[str, str]) -> tuple[str, dict[str, str]]:
    """The store service in front of `inner`; the clients get its URL and a push token."""
    with Store.open(inner) as s:
        s.init()
    tokens = make_tokens(work / "tokens.json", {"bench": ["push:*"]})
    svc = start_service(inner, work / "service", tokens=work / "tokens.json", workers=2, env=env)
    SERVICES[svc.url] = (svc, inner, tokens["bench"])
    os.environ["LAYERSTORE_TOKEN"] = tokens["bench"]
    return svc.url, {**env, "LAYERSTORE_TOKEN": tokens["bench"]}


def cleanup(backend: str, url: str, work: Path) -> None:
    """Free the space a run used (the memstore OSD keeps everything in RAM)."""
    if url in SERVICES:
        svc, url, _token = SERVICES.pop(url)
        svc.stop()
        backend = "local" if backend == "http" else "s3"
    if backend in ("local", "cephfs"):
        shutil.rmtree(url, ignore_errors=True)
        return
    with Store.open(url) as s:
        keys = list(s.backend.list())
        list(s.pool.map(s.backend.delete, keys))


if __name__ == "__main__":
    sys.exit(main())
