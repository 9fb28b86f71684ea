"""Our share of one fanotify pre-content event on a partly cached blob, with no kernel group
(docs/benchmarks-read.md, "The fanotify partly-cached path"): the front end's event thread handling
events whose chunks are all present (the fast path: answered in the event thread), a pipe standing
in for the group as in the unit tests. Measured per event, for reads of 1 and of 32 events:

- `process_batch`: parse, fstat of the event fd, presence lookup, answer (a write(2) to the pipe),
  close of the event fd, the journal's batch flag, the touch list;
- the same three system calls alone (fstat, write of one response, close): what any listener pays;
- `open_fds`: the listing of /proc/self/fd the event loop makes every 16 reads (the fd bound it
  promises a successor), per read at the daemon's usual number of open fds.

What the kernel adds per event (making the event, installing its fd, waking the listener and then
the reader) is not here: bench/read.py's `fanotify_partial` contender measures the whole, and
the difference per event is the kernel's and the scheduler's.

    python bench/fanotify_event_cost.py [--events N] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fuse_client.fanotify import abi, kernel  # noqa: E402
from fuse_client.fanotify.frontend import FanotifyFrontEnd  # noqa: E402
from fuse_client.nodecache.entry import BlobEntry  # noqa: E402
from layerstore.chunkmap import ChunkMap, ChunkRef  # noqa: E402

CHUNK = 1 << 20
NCHUNKS = 8


def timed_batches(fe: FanotifyFrontEnd, r: int, data_fd: int, per_read: int, n: int) -> float:
    """Seconds per event of `process_batch` over `n` events in reads of `per_read`."""
    total = 0.0
    done = 0
    while done < n:
        k = min(per_read, n - done)
        fds = [os.dup(data_fd) for _ in range(k)]
        buf = b"".join(abi.encode_event(abi.Event(abi.FAN_PRE_ACCESS, fd, 1, (j * 4096) % (NCHUNKS * CHUNK), 4096))
                       for j, fd in enumerate(fds))
        t0 = time.perf_counter()
        fe.journal.begin_batch(fe.fd_bound)
        slow = fe.process_batch(buf)
        total += time.perf_counter() - t0
        assert not slow, "an event left the fast path"
        while True:  # drain the answers
            try:
                os.read(r, 1 << 16)
            except BlockingIOError:
                break
        done += k
    return total / n


def syscalls(r: int, w: int, data_fd: int, n: int) -> dict[str, float]:
    """Each of the three per-event system calls alone, in blocks of 256 fds (the fd limit)."""
    fstat = write = close = 0.0
    resp = abi.response(data_fd, allow=True)
    for _ in range(0, n, 256):
        fds = [os.dup(data_fd) for _ in range(256)]
        t0 = time.perf_counter()
        for fd in fds:
            os.fstat(fd)
        t1 = time.perf_counter()
        for _fd in fds:
            os.write(w, resp)
        t2 = time.perf_counter()
        for fd in fds:
            os.close(fd)
        t3 = time.perf_counter()
        fstat, write, close = fstat + t1 - t0, write + t2 - t1, close + t3 - t2
        with contextlib.suppress(BlockingIOError):
            os.read(r, 1 << 16)
    m = (n + 255) // 256 * 256
    t0 = time.perf_counter()
    for _ in range(200):
        kernel.open_fds()
    listing = (time.perf_counter() - t0) / 200
    return {"fstat_us": round(fstat / m * 1e6, 2), "write_response_us": round(write / m * 1e6, 2),
            "close_us": round(close / m * 1e6, 2), "open_fds_listing_us_per_call": round(listing * 1e6, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=20000)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "fanotify-event-cost.json")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fan-cost-", dir="/var/tmp") as tmp:
        cache = Path(tmp)
        path = cache / "blob"
        data_fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(data_fd, NCHUNKS * CHUNK)
        refs = [ChunkRef(i * CHUNK, CHUNK, "b3:" + f"{i:064x}", 0) for i in range(NCHUNKS)]
        entry = BlobEntry(ChunkMap.build(refs), os.dup(data_fd))
        entry.present[:] = b"\x01" * NCHUNKS
        r, w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        fe = FanotifyFrontEnd(cache, data_file=lambda b: path, acquire=lambda: (w, "g", True))
        fe.open_group(w, "g", True)
        try:
            st = os.fstat(data_fd)
            key = (st.st_dev, st.st_ino)
            fe.attach_unmarked(entry, path, key)
            fe.promise_bound()
            timed_batches(fe, r, data_fd, 32, 2000)  # warm-up
            results = {f"process_batch_us_per_event_{k}_per_read": round(timed_batches(fe, r, data_fd, k,
                                                                                          args.events) * 1e6, 2)
                       for k in (1, 32)}
            results.update(syscalls(r, w, data_fd, args.events))
            results["open_fds_now"] = kernel.open_fds()
        finally:
            fe.group = None
            fe.close()
            os.close(r)
            os.close(w)
            entry.close()
            os.close(data_fd)
    doc = {"benchmark": "fanotify_event_cost", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "loadavg": os.getloadavg(), "events": args.events, "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    print(json.dumps(doc, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
