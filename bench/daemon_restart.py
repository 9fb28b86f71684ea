"""16 sandboxes reading in a loop while the node daemon is killed with -9 and restarted N times
(issue 18; docs/fanotify.md): on the fanotify data path every read must complete with the right
bytes. Chunks are evicted before each kill, so the readers keep needing fills across the gap.

    sudo .venv/bin/python bench/daemon_restart.py [--restarts 100] [--readers 16]

Writes bench/results/daemon_restart.json: restarts, reads, failed reads, wrong reads, the gaps
(kill to the next daemon answering), the load average, and what the successors answered.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "tests" / "support"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from testkit.fanotify_helpers import mounted_layer, node_daemon, read_uncached, start_daemon  # noqa: E402
from testkit.fuse_helpers import build_and_push, make_tree  # noqa: E402

from fuse_client.control import request_json  # noqa: E402
from layerstore.backends.posix import PosixBackend  # noqa: E402
from layerstore.store import Store  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--restarts", type=int, default=100)
    ap.add_argument("--readers", type=int, default=16)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "daemon_restart.json")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="daemon-restart-", dir="/var/tmp") as tmpd:
        tmp = Path(tmpd)
        backend = PosixBackend(tmp / "store", fsync=False)
        backend.create()
        store = Store(backend)
        store.init()
        src = make_tree(tmp / "src", small=200, big=(8 << 20, 2 << 20))
        layer = build_and_push(store, src, tmp / "image.erofs")
        files = sorted(p.relative_to(src) for p in src.rglob("*") if p.is_file() and not p.is_symlink())
        want = {rel: (src / rel).read_bytes() for rel in files}
        stop = threading.Event()
        reads = [0] * args.readers
        failed: list[str] = []
        wrong: list[str] = []
        gaps: list[float] = []
        answered = {"leftovers": 0, "unknown": 0}

        def reader(k: int, mnt: Path) -> None:
            rng = random.Random(k)
            while not stop.is_set():
                rel = rng.choice(files)
                try:
                    got = read_uncached(mnt / rel)
                except OSError as e:
                    failed.append(f"{rel}: {e}")
                    continue
                if got != want[rel]:
                    wrong.append(str(rel))
                reads[k] += 1

        t0 = time.monotonic()
        with node_daemon(backend.url, tmp, "fanotify") as ds, mounted_layer(ds[-1], layer.blob, "fanotify",
                                                                            tmp) as mnt:
            threads = [threading.Thread(target=reader, args=(k, mnt), daemon=True) for k in range(args.readers)]
            for t in threads:
                t.start()
            try:
                for i in range(args.restarts):
                    request_json(ds[-1].cache_dir, "POST", "/cache/evict", {"all": True})
                    time.sleep(random.uniform(0.05, 0.3))
                    fan = ds[-1].stats()["fanotify"]
                    answered["leftovers"] += fan["leftovers_answered"]
                    answered["unknown"] += fan["unknown_answered"]
                    k0 = time.monotonic()
                    ds[-1].kill9()
                    ds.append(start_daemon(backend.url, tmp / "cache", tmp / "mnt", "fanotify"))
                    gaps.append(time.monotonic() - k0)
                    print(f"restart {i + 1}/{args.restarts}: gap {gaps[-1]:.2f} s, reads {sum(reads)}, "
                          f"failed {len(failed)}, wrong {len(wrong)}", flush=True)
                before = sum(reads)
                while sum(reads) < before + 64:
                    time.sleep(0.01)
            finally:
                stop.set()
                for t in threads:
                    t.join(120)
            fan = ds[-1].stats()["fanotify"]
            answered["leftovers"] += fan["leftovers_answered"]
            answered["unknown"] += fan["unknown_answered"]
        result = {
            "restarts": args.restarts, "readers": args.readers, "reads": sum(reads), "failed_reads": len(failed),
            "wrong_reads": len(wrong), "failed_examples": failed[:5], "wrong_examples": wrong[:5],
            "gap_seconds": {"min": round(min(gaps), 3), "median": round(sorted(gaps)[len(gaps) // 2], 3),
                            "max": round(max(gaps), 3)} if gaps else None,
            "answered_by_successors": answered, "seconds": round(time.monotonic() - t0, 1),
            "loadavg": os.getloadavg(), "blob_bytes": layer.size,
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0 if not failed and not wrong else 1


if __name__ == "__main__":
    sys.exit(main())
