"""CPU per GB of the S3 backend's reads (docs/s3-backend.md, "CPU per GB read").

A real single-node Ceph RGW on loopback (testkit.ceph_cluster, no CephFS) holds `objects`
objects of 1 MiB (random bytes). Each measurement is a child process (fresh interpreter, fresh
`S3Backend`) that loads every object once with `S3Backend.load(key, max_size=...)`, as the
node daemon's fetcher does (a chunk object's size limit), over 1 thread and over 16 threads,
and reports its own CPU (`resource.getrusage(RUSAGE_SELF)`, user + system) per GB read, after
a warm-up that builds the client and opens connections. RGW's and the OSD's CPU are not counted.

Without `--peer` the two contenders are this checkout's two read paths, interleaved round by
round: the direct signed GET (`s3_get.DirectGet`, the default where it applies) against
botocore's own `get_object` pipeline (`S3Backend(direct_get=False)`), with each round's ratio.
`--peer DIR` instead runs this checkout against the code of another checkout (e.g.
`git worktree add /tmp/base <commit>`, through PYTHONPATH), each with its default read path,
interleaved the same way: the A/B of a change (the machine is shared: the load averages are
recorded). `--profile N` instead prints a cProfile of N
sequential GETs in this checkout (no results file).

    python bench/s3_get_cpu.py [--size quick|full] [--rounds N] [--peer DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from abkit import commit_of, write_results

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
MiB = 1 << 20
SIZES = {"quick": {"objects": 128, "rounds": 2}, "full": {"objects": 512, "rounds": 5}}
THREADS = (1, 16)
BUCKET = "s3-get-cpu"


def child(endpoint: str, bucket: str, objects: int, threads: int, profile: bool,
          direct: bool | None = None) -> dict[str, Any]:
    """Load every object once over `threads` threads, in this process (run through `--child`)."""
    import resource
    from concurrent.futures import ThreadPoolExecutor

    from layerstore.backends.s3 import S3Backend
    from layerstore.store import MAX_OBJECT_SIZE

    limit = MAX_OBJECT_SIZE["chunks"]
    backend = (S3Backend(bucket, "bench", endpoint=endpoint) if direct is None
               else S3Backend(bucket, "bench", endpoint=endpoint, direct_get=direct))
    keys = [f"obj/{i:06d}" for i in range(objects)]
    # Warm-up: the client, its endpoint resolution and a connection per thread.
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda k: backend.load(k, max_size=limit), keys[:threads]))

    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    if profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for k in keys:
            backend.load(k, max_size=limit)
        prof.disable()
        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(45)
        pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(60)
        return {}
    total = 0
    c0, t0 = cpu(), time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        for data in pool.map(lambda k: backend.load(k, max_size=limit), keys):
            total += len(data)
    c1, t1 = cpu(), time.perf_counter()
    backend.close()
    return {"cpu_s": c1 - c0, "seconds": t1 - t0, "bytes": total, "gets": len(keys)}


def measure(code: Path, endpoint: str, objects: int, threads: int, env: dict[str, str],
            profile: bool = False, direct: bool | None = None) -> dict[str, Any]:
    full_env = {**os.environ, **env, "PYTHONPATH": str(code)}
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", endpoint, BUCKET, str(objects), str(threads),
            {None: "default", True: "direct", False: "botocore"}[direct]]
    if profile:
        argv.append("--child-profile")
    r = subprocess.run(argv, env=full_env, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise SystemExit(f"child failed ({code}):\n{r.stderr[-3000:]}")
    if profile:
        print(r.stderr)
        return {}
    return json.loads(r.stdout.strip().splitlines()[-1])



def per_gb(r: dict[str, Any]) -> float:
    return r["cpu_s"] / r["bytes"] * 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default=os.environ.get("BENCH_SIZE") or "quick")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--peer", type=Path, default=None, help="another checkout to compare against (A/B)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="print a cProfile of N sequential GETs (this checkout) and exit")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", nargs=5, metavar=("ENDPOINT", "BUCKET", "OBJECTS", "THREADS", "PATH"),
                    help=argparse.SUPPRESS)
    ap.add_argument("--child-profile", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        e, b, n, t, how = args.child
        print(json.dumps(child(e, b, int(n), int(t), args.child_profile,
                               {"default": None, "direct": True, "botocore": False}[how])))
        return 0
    size = SIZES[args.size]
    rounds = args.rounds or size["rounds"]
    if rounds < 1 or (args.profile and args.profile < 1):
        ap.error("--rounds and --profile must be positive")
    if args.peer is not None and not (args.peer / "layerstore" / "backends" / "s3.py").is_file():
        ap.error(f"--peer {args.peer}: not a checkout of this project")
    objects = max(size["objects"], args.profile)
    out_path = args.out or RESULTS / ("s3-get-cpu.json" if args.size == "quick" else f"s3-get-cpu-{args.size}.json")
    # contender -> (checkout, read path: None = the backend's default); the first over the second is the ratio
    codes: dict[str, tuple[Path, bool | None]] = (
        {"this": (ROOT, None), "peer": (args.peer.resolve(), None)} if args.peer
        else {"direct": (ROOT, True), "botocore": (ROOT, False)})
    first, second = codes
    sys.path.insert(0, str(ROOT / "tests" / "support"))
    from testkit.ceph_cluster import CephCluster

    load0 = os.getloadavg()
    t0 = time.monotonic()
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {c: {t: [] for t in THREADS} for c in codes}
    with tempfile.TemporaryDirectory(prefix="s3-get-cpu-", dir="/var/tmp") as tmp:
        cluster = CephCluster(Path(tmp) / "ceph", memstore_mib=max(1024, objects * 3))
        with cluster:
            cluster.start(cephfs=False)
            env = {**cluster.s3_env(), "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}
            os.environ.update(env)
            from layerstore.backends.s3 import S3Backend

            with S3Backend(BUCKET, "bench", endpoint=cluster.endpoint) as backend:
                backend.create()
                for i in range(objects):
                    backend.store_once(f"obj/{i:06d}", os.urandom(MiB))
            if args.profile:
                measure(ROOT, cluster.endpoint, args.profile, 1, env, profile=True)
                return 0
            for rnd in range(rounds):
                order = list(codes) if rnd % 2 == 0 else list(reversed(codes))
                for threads in THREADS:
                    for code in order:
                        r = measure(codes[code][0], cluster.endpoint, objects, threads, env, direct=codes[code][1])
                        runs[code][threads].append(r)
                        print(f"round {rnd} threads {threads:2d} {code:8s} cpu {r['cpu_s']:.3f} s for "
                              f"{r['bytes'] / MiB:.0f} MiB: {per_gb(r):.2f} s/GB, "
                              f"{r['cpu_s'] / r['gets'] * 1e3:.2f} ms/GET, {r['bytes'] / r['seconds'] / MiB:.0f} MiB/s",
                              flush=True)
    results: dict[str, Any] = {}
    for code, per in runs.items():
        results[code] = {f"threads_{t}": {"cpu_s_per_GB_median": round(statistics.median(map(per_gb, rs)), 3),
                                          "cpu_s_per_GB": [round(per_gb(r), 3) for r in rs],
                                          "cpu_ms_per_GET_median": round(statistics.median(
                                              r["cpu_s"] / r["gets"] * 1e3 for r in rs), 3),
                                          "MiB_per_s_median": round(statistics.median(
                                              r["bytes"] / r["seconds"] / MiB for r in rs), 1)}
                         for t, rs in per.items()}
    results[f"{first}_over_{second}_paired"] = {
        f"threads_{t}": [round(per_gb(a) / per_gb(b), 3) for a, b in zip(runs[first][t], runs[second][t], strict=True)]
        for t in THREADS}
    params = {**size, "rounds": rounds, "object_size": MiB, "threads": list(THREADS),
              "commit": commit_of(ROOT), "peer_commit": commit_of(args.peer) if args.peer else None}
    write_results(out_path, "s3_get_cpu", params, results, started=t0, load_at_start=load0)
    return 0


if __name__ == "__main__":
    if str(ROOT) not in sys.path and "--child" not in sys.argv:
        sys.path.insert(0, str(ROOT))
    sys.exit(main())
