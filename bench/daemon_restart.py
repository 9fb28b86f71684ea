"""16 sandboxes reading in a loop while the node daemon is killed with -9 and restarted N times
(issue 18; docs/fanotify.md): on the fanotify data path every read must complete with the right
bytes. Chunks are evicted before each kill, so the readers keep needing fills across the gap.

    sudo .venv/bin/python bench/daemon_restart.py [--restarts 100] [--readers 16] [--kill-all]

Writes bench/results/daemon_restart.json: restarts, reads, failed reads, wrong reads, the gaps
(kill to the next daemon answering), the load average, and what the successors answered.

`--kill-all` (bench/results/daemon_restart-kill-all.json): the daemon is started by the runtime
shim's supervisor (runtime_shim.daemon, with its watch process), and each cycle kills the daemon
*and* the fanotify holder with -9 at once: the group dies with them. Measured per cycle: how long
until the watch has made a new group with the attached file marked (`marks_back`: from the kill
until the watch's new group, or the new holder's, shows the mark; holes read as zeros before it:
the window), until a
daemon answers again (`daemon_back`), and the reads that returned wrong bytes (zeros read in the
window) or failed.
"""

from __future__ import annotations

import argparse
import contextlib
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

from fuse_client import linux  # noqa: E402
from fuse_client.control import request_json  # noqa: E402
from layerstore.backends.posix import PosixBackend  # noqa: E402
from layerstore.store import Store  # noqa: E402


def fanotify_marks(pid: int | None) -> int:
    """The marks of a fanotify group process `pid` holds (the watch, between its regroup and the new
    holder's start: the old group died with every holder, so any group it holds is the new one)."""
    from fuse_client.fanotify import abi

    if pid is None:
        return -1
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:[fanotify]":
                    with open(f"/proc/{pid}/fdinfo/{fd}", "rb") as f:
                        return abi.count_marks(f.read())
    return -1


def kill_all(args: argparse.Namespace) -> int:
    """The `--kill-all` run (module doc)."""
    from testkit.fanotify_helpers import holder_marks, stop_holder

    from fuse_client.control import attach, detach
    from fuse_client.fanotify import handover
    from fuse_client.linux import mount_erofs, umount
    from runtime_shim.daemon import DaemonSupervisor, is_alive
    from runtime_shim.paths import NodePaths
    from runtime_shim.state import NodeState

    os.environ["LAYERSTORE_DATA_PATH"] = "fanotify"
    os.environ.pop("LAYERSTORE_DAEMON_WATCH", None)
    with tempfile.TemporaryDirectory(prefix="daemon-kill-all-", dir="/var/tmp") as tmpd:
        tmp = Path(tmpd)
        backend = PosixBackend(tmp / "store", fsync=False)
        backend.create()
        store = Store(backend)
        store.init()
        src = make_tree(tmp / "src", small=200, big=(8 << 20, 2 << 20))
        layer = build_and_push(store, src, tmp / "image.erofs")
        files = sorted(p.relative_to(src) for p in src.rglob("*") if p.is_file() and not p.is_symlink())
        want = {rel: (src / rel).read_bytes() for rel in files}
        paths = NodePaths(tmp / "node")
        paths.root.mkdir()
        sup = DaemonSupervisor(paths)
        state = NodeState(paths.state)
        target = tmp / "layer"
        target.mkdir()
        stop = threading.Event()
        reads = [0] * args.readers
        failed: list[str] = []
        wrong: list[str] = []
        cycles: list[dict[str, float]] = []

        def reader(k: int) -> None:
            rng = random.Random(k)
            while not stop.is_set():
                rel = rng.choice(files)
                try:
                    got = read_uncached(target / rel)
                except OSError as e:
                    failed.append(f"{rel}: {e}")
                    continue
                if got != want[rel]:
                    wrong.append(str(rel))
                reads[k] += 1

        rec = sup.start(backend.url)
        with state.write() as t:
            t.put_daemon(rec)
        threads = []
        try:
            got = attach(paths.cache, layer.blob, "bench")
            assert got is not None
            mount_erofs(Path(got["path"]), target)
            threads = [threading.Thread(target=reader, args=(k,), daemon=True) for k in range(args.readers)]
            for t in threads:
                t.start()
            for i in range(args.restarts):
                while True:  # (the watch records the new daemon once its mount answers)
                    with state.read() as t:
                        rec = t.daemon()
                    if rec is not None and is_alive(rec):
                        break
                    time.sleep(0.01)
                request_json(paths.cache, "POST", "/cache/evict", {"all": True})
                time.sleep(random.uniform(0.05, 0.3))
                ident = handover.read_identity(paths.cache)
                assert ident is not None
                w0 = len(wrong)
                k0 = time.monotonic()
                os.kill(rec.pid, 9)
                os.kill(ident[0], 9)
                marks = daemon = None
                while marks is None:  # (first: a daemon being asked could hold this loop up)
                    if time.monotonic() - k0 > 120:
                        raise RuntimeError("no new group within 120 s")
                    if fanotify_marks(sup.watch_pid()) >= 1 or (
                            (cur := handover.read_identity(paths.cache)) is not None and cur[1] != ident[1]
                            and holder_marks(paths.cache) >= 1):
                        marks = time.monotonic() - k0
                    time.sleep(0.0005)
                while daemon is None:
                    if time.monotonic() - k0 > 120:
                        raise RuntimeError("no daemon within 120 s")
                    try:
                        if request_json(paths.cache, "GET", "/stats", timeout=2)["pid"] != rec.pid:
                            daemon = time.monotonic() - k0
                    except Exception:  # (not up yet)
                        time.sleep(0.005)
                cycles.append({"marks_back_s": round(marks, 4), "daemon_back_s": round(daemon, 3),
                               "wrong_reads": len(wrong) - w0})
                print(f"cycle {i + 1}/{args.restarts}: marks back after {marks:.3f} s, daemon after {daemon:.2f} s, "
                      f"reads {sum(reads)}, failed {len(failed)}, wrong {len(wrong)}", flush=True)
            before = sum(reads)
            while sum(reads) < before + 64:
                time.sleep(0.01)
        finally:
            stop.set()
            for t in threads:
                t.join(120)
            with contextlib.suppress(OSError):
                umount(target, lazy=True)
            with contextlib.suppress(Exception):
                detach(paths.cache, layer.blob, "bench")
            with state.read() as t:
                rec = t.daemon()
            sup.stop(rec)
            stop_holder(paths.cache)
            state.close()
            if linux.is_mount(paths.fuse):
                linux.umount(paths.fuse, lazy=True)
        watch_lines = [ln for ln in paths.daemon_log.read_text(errors="replace").splitlines() if " watch " in ln]
        med = sorted(c["marks_back_s"] for c in cycles)
        result = {
            "mode": "kill-all (daemon and holder, -9, at once; the shim's watch regroups and restarts)",
            "cycles": len(cycles), "readers": args.readers, "reads": sum(reads), "failed_reads": len(failed),
            "wrong_reads": len(wrong), "failed_examples": failed[:5], "wrong_examples": wrong[:5],
            "marks_back_seconds": {"min": med[0], "median": med[len(med) // 2], "max": med[-1]} if med else None,
            "daemon_back_seconds_median": sorted(c["daemon_back_s"] for c in cycles)[len(cycles) // 2] if cycles
            else None,
            "per_cycle": cycles, "watch_log": watch_lines[-2 * len(cycles):], "loadavg": os.getloadavg(),
            "blob_bytes": layer.size,
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "per_cycle"}, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--restarts", type=int, default=100)
    ap.add_argument("--readers", type=int, default=16)
    ap.add_argument("--kill-all", action="store_true", help="kill the holder too: the watch's regroup window")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.out is None:
        args.out = ROOT / "bench" / "results" / ("daemon_restart-kill-all.json" if args.kill_all
                                                 else "daemon_restart.json")
    if args.kill_all:
        return kill_all(args)
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
