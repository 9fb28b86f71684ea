"""The cost of one FUSE request on the cache-hit path: through the kernel (O_DIRECT reads, every read
one request), and the daemon's read handler alone, called without a kernel."""

from __future__ import annotations

import contextlib
import mmap
import os
import statistics
import time
from pathlib import Path
from typing import Any

import trio

from .mounts import DaemonRun
from .project import BLOBS_INODE, BlobFS, LazyCache, Stats, Store, open_cache
from .spec import HIT_PATH_HANDLER_BLOCKS, HIT_PATH_KERNEL_BLOCKS, HIT_PATH_SPAN


def hit_path_kernel(d: DaemonRun, blob: str, size: int) -> list[dict[str, Any]]:
    """O_DIRECT reads through FUSE (every read is one request), data in the page cache."""
    out = []
    path = d.blob(blob)
    for block, n in HIT_PATH_KERNEL_BLOCKS:
        span = min(size, HIT_PATH_SPAN) // block * block
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
                fs = BlobFS(LazyCache(cache, store, nursery=nursery, stats=stats))
                attr = await fs.lookup(BLOBS_INODE, blob.encode())
                fh = (await fs.open(attr.st_ino, os.O_RDONLY)).fh
                entry = cache.get(blob)
                assert entry is not None
                # a reopened cache serves its chunks once re-hashed (docs/fuse-client.md, "What is
                # verified when"): verify them first, so that every probed read is a hit
                await cache.verifier.verify_all_unverified(entry)
                for block, n in HIT_PATH_HANDLER_BLOCKS:
                    span = min(size, HIT_PATH_SPAN) // block * block
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
