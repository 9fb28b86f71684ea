"""CPU of the node cache's shared fetch path (docs/benchmarks-fetch.md, "CPU of the fetch path"), in
process, no kernel front end: a fresh node cache filled cold from a local-directory store by
`Reader.fill` over a whole blob, as a front end's reads would (readahead on).

- `big`: a blob of 1 MiB chunks, half random (stored raw), half text (stored zstd): CPU
  seconds per GB fetched, the whole process and the trio thread apart;
- `small`: a blob of 4 KiB chunks (their C work is negligible): CPU microseconds per chunk, the
  whole process and the trio thread: the Python cost of one chunk's flight.

Each measurement is a child process (fresh interpreter, fresh cache). `--peer DIR` runs the same
measurements against the code of another checkout (e.g. `git worktree add /tmp/base HEAD~3`,
through PYTHONPATH), interleaved with this one round by round: the A/B of a change, with the
ratios of each round's pair (the machine is shared: see the load averages recorded).

    python bench/fetch_cpu.py [--size quick|full] [--rounds N] [--peer DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import random
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
SIZES = {"quick": {"big_mib": 128, "small_chunks": 2000, "rounds": 3},
         "full": {"big_mib": 320, "small_chunks": 8000, "rounds": 5}}
SMALL_CHUNK = 4096


def build_store(work: Path, big_mib: int, small_chunks: int) -> dict[str, str]:
    """A local store with the two blobs; returns {"big": blob id, "small": blob id}."""
    from layerstore.chunkmap import ChunkMap, ChunkRef
    from layerstore.store import Store

    rng = random.Random(18)
    words = [rng.randbytes(rng.randint(3, 9)).hex().encode() for _ in range(4000)]
    half = big_mib // 2
    big = rng.randbytes(half * MiB) + b" ".join(rng.choice(words) for _ in range((big_mib - half) * MiB // 10))
    big = big[:big_mib * MiB]
    small = rng.randbytes(small_chunks * SMALL_CHUNK)
    out = {}
    with Store.open(str(work / "store")) as store:
        store.init()
        for name, data, chunk in (("big", big, MiB), ("small", small, SMALL_CHUNK)):
            refs = []
            for off in range(0, len(data), chunk):
                digest, _ = store.put_chunk(data[off:off + chunk])
                refs.append(ChunkRef(off, min(chunk, len(data) - off), digest, 0))
            cmap = ChunkMap.build(refs)
            store.put_chunk_map(cmap)
            out[name] = cmap.blob
    return out


def child(store_dir: str, blob: str, request: int) -> dict[str, float]:
    """One cold fill of `blob` in `request`-byte fills, in this process (run through `--child`)."""
    import contextlib
    import resource
    import shutil

    import trio

    from fuse_client.nodecache import LazyCache, open_cache
    from layerstore.store import Store

    tick = os.sysconf("SC_CLK_TCK")

    def main_thread_s() -> float:
        f = Path(f"/proc/self/task/{os.getpid()}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / tick

    def process_s() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    result: dict[str, float] = {}

    async def run(cache_dir: Path) -> None:
        with Store.open(store_dir) as store, contextlib.ExitStack() as stack:
            cache = open_cache(cache_dir, None, stack)
            async with trio.open_nursery() as nursery:
                await nursery.start(cache.run)
                lazy = LazyCache(cache, store, nursery=nursery)
                entry = await lazy.entry(blob)
                reader = lazy.open_reader(entry)
                c0, m0, t0 = process_s(), main_thread_s(), time.perf_counter()
                for off in range(0, entry.size, request):
                    await reader.fill(off, request)
                c1, m1, t1 = process_s(), main_thread_s(), time.perf_counter()
                st = lazy.stats.blob(entry.blob, entry.size)
                result.update(cpu_s=c1 - c0, main_cpu_s=m1 - m0, seconds=t1 - t0, chunks=st.fetches,
                              bytes=st.fetched_bytes)
                reader.close()
                await cache.shutdown_flush()
                nursery.cancel_scope.cancel()

    cache_dir = Path(tempfile.mkdtemp(prefix="fetch-cpu-cache-", dir=Path(store_dir).parent))
    try:
        trio.run(run, cache_dir)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    return result


def measure(code: Path, store_dir: Path, blob: str, request: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(code)}
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", str(store_dir), blob, str(request)],
                         env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])



def summarise(runs: list[dict[str, float]], kind: str) -> dict[str, float]:
    if kind == "big":
        per = [r["cpu_s"] / r["bytes"] * 1e9 for r in runs]
        main = [r["main_cpu_s"] / r["bytes"] * 1e9 for r in runs]
        return {"cpu_s_per_GB_median": round(statistics.median(per), 3), "cpu_s_per_GB": [round(x, 3) for x in per],
                "main_thread_s_per_GB_median": round(statistics.median(main), 3)}
    per = [r["cpu_s"] / r["chunks"] * 1e6 for r in runs]
    main = [r["main_cpu_s"] / r["chunks"] * 1e6 for r in runs]
    return {"cpu_us_per_chunk_median": round(statistics.median(per), 1), "cpu_us_per_chunk": [round(x, 1) for x in per],
            "main_thread_us_per_chunk_median": round(statistics.median(main), 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default=os.environ.get("BENCH_SIZE") or "full")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--peer", type=Path, default=None, help="another checkout to compare against (A/B)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", nargs=3, metavar=("STORE", "BLOB", "REQUEST"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], int(args.child[2]))))
        return 0
    size = SIZES[args.size]
    rounds = args.rounds or size["rounds"]
    out_path = args.out or RESULTS / ("fetch-cpu.json" if args.size == "full" else f"fetch-cpu-{args.size}.json")
    codes = {"this": ROOT} | ({"peer": args.peer.resolve()} if args.peer else {})
    load0 = os.getloadavg()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fetch-cpu-", dir="/var/tmp") as tmp:
        work = Path(tmp)
        blobs = build_store(work, size["big_mib"], size["small_chunks"])
        requests = {"big": MiB, "small": 16 * SMALL_CHUNK}
        runs: dict[str, dict[str, list[dict[str, float]]]] = {c: {k: [] for k in blobs} for c in codes}
        for rnd in range(rounds):
            order = list(codes) if rnd % 2 == 0 else list(reversed(codes))
            for kind in blobs:
                for code in order:
                    r = measure(codes[code], work / "store", blobs[kind], requests[kind])
                    runs[code][kind].append(r)
                    print(f"round {rnd} {kind:5s} {code:4s} cpu {r['cpu_s']:.3f} s "
                          f"(trio thread {r['main_cpu_s']:.3f} s) for {r['chunks']:.0f} chunks, "
                          f"{r['bytes'] / MiB:.0f} MiB", flush=True)
    results: dict[str, Any] = {c: {k: summarise(v, k) for k, v in per.items()} for c, per in runs.items()}
    if "peer" in codes:
        results["this_over_peer_paired_median"] = {
            kind: round(statistics.median(a["cpu_s"] / a[unit] / (b["cpu_s"] / b[unit])
                                          for a, b in zip(runs["this"][kind], runs["peer"][kind], strict=True)), 3)
            for kind, unit in (("big", "bytes"), ("small", "chunks"))}
    params = {**size, "rounds": rounds, "peer_commit": commit_of(args.peer) if args.peer else None,
              "commit": commit_of(ROOT), "big_request": MiB, "small_request": 16 * SMALL_CHUNK}
    write_results(out_path, "fetch_cpu", params, results, started=t0, load_at_start=load0)
    return 0


if __name__ == "__main__":
    if str(ROOT) not in sys.path and "--child" not in sys.argv:
        sys.path.insert(0, str(ROOT))
    sys.exit(main())
