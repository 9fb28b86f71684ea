"""The FUSE hit path without a kernel: `BlobFS.read` of cached data after a daemon restart (a
clean close, then a fresh open of the same cache, as the read bench's warm runs and every
upgrade do) answers inline: one presence lookup and one pread, no await (no thread hop, no lock a
fetch can hold, no re-hash). The handler's time per 4 KiB and per 128 KiB hit is printed next to
a bare pread of the same range (a figure for the reader of the test log, never asserted: tests
do not time things); `make bench-ab` and bench/read.py measure it through the kernel."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import trio
from testkit.nodecache_formats import compressible

from layerstore.store import Store
from tests.fuse_client.test_fuse_handlers import put_blob, rig

MiB = 1 << 20
BLOCKS = ((4096, 4000), (128 * 1024, 800))  # (read size, reads)


def _inline(coro: object) -> bytes | memoryview:
    """Run a handler coroutine that must not await: its answer, or AssertionError if it awaited."""
    try:
        coro.send(None)  # type: ignore[attr-defined]
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coro.close()  # type: ignore[attr-defined]
    raise AssertionError("the cache-hit path awaited (a thread hop or a wait: not the inline hit path)")


def test_hit_path_handler_time_after_a_restart(store: Store, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    data = compressible(41, 4 * MiB)
    cmap = put_blob(store, data, chunk=MiB)
    cache_dir = tmp_path / "cache"

    async def fill() -> None:
        async with rig(store, cache_dir) as r:
            await r.read_all(await r.open_blob(cmap.blob), len(data))

    figures: list[str] = []

    async def restarted() -> None:
        async with rig(store, cache_dir) as r:
            fh = await r.open_blob(cmap.blob)
            entry = r.cache.get(cmap.blob)
            assert entry is not None
            for block, n in BLOCKS:
                span = len(data) // block * block
                for k in range(span // block):  # every block once, checked: all inline hits, right bytes
                    assert bytes(_inline(r.fs.read(fh, k * block, block))) == data[k * block:(k + 1) * block]
                t0 = time.perf_counter()
                for k in range(n):
                    _inline(r.fs.read(fh, (k * block) % span, block))
                handler = (time.perf_counter() - t0) / n
                t0 = time.perf_counter()
                for k in range(n):
                    os.pread(entry.fd, block, (k * block) % span)
                pread = (time.perf_counter() - t0) / n
                figures.append(f"{block // 1024} KiB hit: handler {handler * 1e6:.1f} us, "
                               f"pread of the same range {pread * 1e6:.1f} us")
            st = r.stats.blobs[cmap.blob]
            assert st.misses == 0 and st.fetched_bytes == 0 and r.cache.verifier.verified_chunks == 0

    trio.run(fill)
    trio.run(restarted)
    with capsys.disabled():
        print(f"\nFUSE hit path, no kernel (load {os.getloadavg()[0]:.1f}): " + "; ".join(figures))
