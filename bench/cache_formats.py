"""Node cache formats (docs/node-cache.md, "Cache formats"): plain against zstd in the same run.

- disk: a blob of Python sources (compressible like a layer of code) fetched whole from a local
  store into an empty cache of each format: bytes allocated by the data file, bytes the process
  wrote while filling (/proc/self/io: chunk data + index), per MB fetched;
- the cache hit: `Reader.read_cached` called in-process (the read handler's library part, no
  kernel) over the whole blob, sequentially, in requests of 4 KiB, 128 KiB and 1 MiB, after
  every chunk was verified; zstd with its LRU of decompressed chunks (default size) and without
  one (`lru_bytes=0`: every request decompresses and re-hashes its chunks, what a reader gets
  whose chunks fell out of the LRU). The data file's pages are in the page cache for both
  formats (this measures the daemon's CPU per request, not the disk). Each answer is copied once
  (`bytes(...)`), as the reply's `writev` copies it (a plain cache answers long streams with a
  slice of its mapping, which costs nothing until copied).

Rounds interleave the formats (order rotated); figures are medians of the rounds.

    python bench/cache_formats.py [--size quick|full] [--mib N] [--rounds N] [--out FILE]

`--size` defaults to $BENCH_SIZE (as `make bench` sets it), else full: a 32 MiB blob, 5 rounds
(bench/results/cache_formats.json); quick: 16 MiB, 3 rounds (bench/results/cache_formats-quick.json).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import trio  # noqa: E402

from fuse_client.nodecache import LazyCache, open_cache  # noqa: E402
from layerstore.backends.posix import PosixBackend  # noqa: E402
from layerstore.store import Store  # noqa: E402

BLOCKS = (4096, 128 << 10, 1 << 20)
VARIANTS = (("plain", None), ("zstd", None), ("zstd_no_lru", 0))
SIZES = {"quick": {"mib": 16, "rounds": 3}, "full": {"mib": 32, "rounds": 5}}


def source_bytes(mib: int) -> bytes:
    out = bytearray()
    for f in sorted(glob.glob("/usr/lib/python3*/**/*.py", recursive=True)):
        with contextlib.suppress(OSError):
            out += Path(f).read_bytes()
        if len(out) >= mib << 20:
            break
    return bytes(out[:mib << 20])


def write_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    return 0


def fill(store: Store, blob: str, cache_dir: Path, fmt: str) -> dict[str, Any]:
    async def go() -> dict[str, Any]:
        with contextlib.ExitStack() as stack:
            cache = open_cache(cache_dir, None, stack, cache_format=fmt)
            async with trio.open_nursery() as nursery:
                await nursery.start(cache.run)
                lazy = LazyCache(cache, store, nursery=nursery)
                w0 = write_bytes()
                entry = await lazy.entry(blob)
                await lazy.ensure(entry, list(range(len(entry.cmap.chunks))))
                await cache.shutdown_flush()
                os.sync()
                written = write_bytes() - w0
                alloc = cache.files.allocated_bytes(blob)
                nursery.cancel_scope.cancel()
            return {"written_bytes": written, "data_file_bytes": alloc,
                    "index_bytes": sum(p.stat().st_size for p in (cache_dir / "index").iterdir())}

    return trio.run(go)


def hits(store: Store, blob: str, cache_dir: Path, lru: int | None) -> dict[str, float]:
    """Microseconds per `read_cached` call, sequential over the blob, per request size."""
    async def go() -> dict[str, float]:
        out: dict[str, float] = {}
        with contextlib.ExitStack() as stack:
            cache = open_cache(cache_dir, None, stack, lru_bytes=lru)
            async with trio.open_nursery() as nursery:
                await nursery.start(cache.run)
                lazy = LazyCache(cache, store, nursery=nursery, readahead=0)
                entry = await lazy.entry(blob)
                await cache.verifier.verify_all_unverified(entry)
                assert entry.complete()
                for block in BLOCKS:
                    if cache.lru is not None:
                        cache.lru = type(cache.lru)(cache.lru.limit)  # an empty LRU for each size
                    reader = lazy.open_reader(entry)
                    n = 0
                    t0 = time.perf_counter()
                    for off in range(0, entry.size, block):
                        data = reader.read_cached(off, block)
                        assert data is not None
                        bytes(data)  # the reply's copy (the kernel copies a mapping slice in writev)
                        n += 1
                    out[str(block)] = round((time.perf_counter() - t0) / n * 1e6, 2)
                    reader.close()
                await cache.shutdown_flush()
                nursery.cancel_scope.cancel()
        return out

    return trio.run(go)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default=os.environ.get("BENCH_SIZE") or "full")
    ap.add_argument("--mib", type=int, default=None, help="blob size (default: the size's)")
    ap.add_argument("--rounds", type=int, default=None, help="(default: the size's)")
    ap.add_argument("--out", type=Path, default=None,
                    help="default: bench/results/cache_formats.json (full) or cache_formats-<size>.json")
    args = ap.parse_args()
    args.mib = SIZES[args.size]["mib"] if args.mib is None else args.mib
    args.rounds = SIZES[args.size]["rounds"] if args.rounds is None else args.rounds
    if args.mib < 1 or args.rounds < 1:
        ap.error("--mib and --rounds must be at least 1")
    args.out = args.out or REPO / "bench" / "results" / (
        "cache_formats.json" if args.size == "full" else f"cache_formats-{args.size}.json")
    with tempfile.TemporaryDirectory(prefix="cache-formats-") as tmp:
        work = Path(tmp)
        backend = PosixBackend(work / "store", fsync=False)
        backend.create()
        store = Store(backend)
        store.init()
        src = work / "blob.bin"
        src.write_bytes(source_bytes(args.mib))
        res = store.put_blob(src)
        size = src.stat().st_size
        fetched = sum(os.path.getsize(p) for p in (work / "store").rglob("*") if p.is_file() and "chunks" in p.parts)
        disk = {fmt: fill(store, res.blob, work / fmt, fmt) for fmt in ("plain", "zstd")}
        rounds: dict[str, list[dict[str, float]]] = {name: [] for name, _ in VARIANTS}
        loads = []
        for r in range(args.rounds):
            loads.append(os.getloadavg()[0])
            order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
            for name, lru in order:
                rounds[name].append(hits(store, res.blob, work / name.split("_")[0], lru))
                print(f"round {r} {name:12s} " + "  ".join(f"{b >> 10} KiB {rounds[name][-1][str(b)]:8.1f} us"
                                                           for b in BLOCKS), flush=True)
    med = {name: {str(b): statistics.median(x[str(b)] for x in rs) for b in BLOCKS} for name, rs in rounds.items()}
    result = {
        "benchmark": "cache_formats", "size": args.size, "blob_bytes": size, "chunks": res.chunks,
        "stored_object_bytes": fetched,
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release(), "loadavg_1min": loads},
        "disk": {fmt: {**d, "data_per_mb_fetched": round(d["data_file_bytes"] / fetched, 3),
                       "written_per_mb_fetched": round(d["written_bytes"] / fetched, 3)} for fmt, d in disk.items()},
        "hit_us_per_request": med, "rounds": rounds,
        "hit_ratio_zstd_to_plain": {name: {b: round(v / med["plain"][b], 2) for b, v in m.items()}
                                    for name, m in med.items() if name != "plain"},
        "mb_per_s": {name: {b: round(int(b) / v, 1) for b, v in m.items()} for name, m in med.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("disk", "hit_us_per_request", "hit_ratio_zstd_to_plain", "mb_per_s")},
                     indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
