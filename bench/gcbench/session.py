"""The whole run: per backend, fill, then rounds of bare list, collection, write-back, bare
delete; the Ceph cluster's lifecycle; the figures and the JSON."""

from __future__ import annotations

import datetime
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from testkit.ceph_cluster import CephCluster

from bench.store_throughput import git_commit, machine_info
from layerstore.backends.posix import PosixBackend
from layerstore.store import Store

from . import fill, measure

GOAL = 1.5  # the whole collection within this factor of bare list + bare delete (issue 13)
SETTLE = 1.1  # seconds between writing and collecting: grace 0 keeps what is not older than the run


def log(msg: str) -> None:
    print(f"[gc bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(args: Any) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="gc-bench-", dir=args.workdir))
    ceph: CephCluster | None = None
    owned = False
    machine = machine_info(None)
    commit = git_commit()  # what is measured is what was imported at the start
    results: dict[str, Any] = {}
    try:
        for backend in args.backends:
            if backend == "s3" and ceph is None:
                if args.ceph_dir:
                    ceph = CephCluster.adopt(args.ceph_dir)
                else:
                    ceph, owned = CephCluster(work / "ceph"), True
                    ceph.start(cephfs=False)
                    log(f"ceph: S3 ready in {ceph.timings.get('s3_ready', 0):.1f} s")
                machine.update(machine_info(ceph))
            url = location(backend, work, ceph)
            results[backend] = one_backend(backend, url, args)
    finally:
        if ceph is not None and owned:
            ceph.stop()
        shutil.rmtree(work, ignore_errors=True)
    return document(args, commit, machine, results)


def location(backend: str, work: Path, ceph: CephCluster | None) -> str:
    if backend == "local":
        return str(work / "local" / "store")
    assert ceph is not None
    os.environ.update({**ceph.s3_env(), "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull})
    return f"s3://bench-gc-{os.getpid()}/store?endpoint={ceph.endpoint}"


def fill_store(backend: str, url: str) -> Store:
    """The local fill writes without fsync (the fill is not what is measured)."""
    if backend == "local":
        return Store(PosixBackend(url, fsync=False))
    return Store.open(url)


def one_backend(backend: str, url: str, args: Any) -> dict[str, Any]:
    plan = fill.Plan(chunks=args.chunks, per_blob=args.per_blob, shared=args.shared)
    workers = args.workers or (8 if backend == "local" else 16)
    log(f"{backend}: filling {url}")
    with fill_store(backend, url) as s:
        fill_steps = fill.fill(s, plan, workers, log)
    os.sync()  # a real store's garbage is old: on disk, not in dirty pages (untimed)
    garbage = plan.garbage_keys()
    rounds: list[dict[str, Any]] = []
    out: dict[str, Any] = {"url_kind": backend, "fill_seconds": fill_steps, "live_objects": len(plan.live_keys),
                           "garbage_objects": len(garbage)}
    with Store.open(url) as store:
        time.sleep(SETTLE)
        for rnd in range(args.rounds):
            # Odd rounds delete bare first: the garbage then written back is what the collection
            # deletes, so neither side always deletes the objects written last.
            gc_first = rnd % 2 == 0
            r: dict[str, Any] = {"order": "gc first" if gc_first else "bare delete first",
                                 "bare_list": measure.bare_list(store.backend)}
            if gc_first:
                r["gc"], _ = measure.collect(store)
                r["check"] = measure.check(store, plan, r["gc"])
                _write_back(store, plan, workers, settle=False)
                r["bare_delete"] = measure.bare_delete(store.backend, garbage)
            else:
                r["bare_delete"] = measure.bare_delete(store.backend, garbage)
                _write_back(store, plan, workers, settle=True)
                r["gc"], _ = measure.collect(store)
                r["check"] = measure.check(store, plan, r["gc"])
            r.update(ratios(r))
            rounds.append(r)
            log(f"{backend} round {rnd + 1} ({r['order']}): gc {r['gc']['seconds']:.2f} s {r['gc']['phases']} | "
                f"bare list {r['bare_list']['seconds']:.2f} s + delete {r['bare_delete']['seconds']:.2f} s | ratio "
                f"{r['ratio']:.2f} (load {os.getloadavg()[0]:.1f})")
            if rnd + 1 < args.rounds or args.profile:
                _write_back(store, plan, workers, settle=True)
        if args.profile:
            gc, text = measure.collect(store, profile=True)
            out["profiled_gc"] = {"seconds": gc["seconds"], "phases": gc["phases"],
                                  "top": (text or "").splitlines()[:120]}
            log(f"{backend}: profiled collection ({gc['seconds']:.2f} s under cProfile):\n{text}")
    out["rounds"] = rounds
    out["median"] = summary(rounds)
    return out


def _write_back(store: Store, plan: fill.Plan, workers: int, *, settle: bool) -> None:
    """The garbage written back (untimed), on disk like the rest; `settle` before a collection."""
    fill.refill_garbage(store.backend, plan, workers)
    os.sync()
    if settle:
        time.sleep(SETTLE)


def ratios(r: dict[str, Any]) -> dict[str, float]:
    bare = r["bare_list"]["seconds"] + r["bare_delete"]["seconds"]
    phases = r["gc"]["phases"]
    return {
        "bare_seconds": round(bare, 4),
        "ratio": round(r["gc"]["seconds"] / bare, 3),
        # the collection without retention and housekeeping: list, mark, recheck, sweep
        "ratio_core": round(sum(v for p, v in phases.items() if p not in ("retention", "housekeeping")) / bare, 3),
        "list_to_bare_list": round(phases.get("list", 0.0) / r["bare_list"]["seconds"], 3),
        "sweep_to_bare_delete": round(phases.get("sweep", 0.0) / r["bare_delete"]["seconds"], 3),
    }


def summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    def med(get: Any) -> float:
        return round(statistics.median(get(r) for r in rounds), 4)

    phases = sorted({p for r in rounds for p in r["gc"]["phases"]})
    return {
        "gc_seconds": med(lambda r: r["gc"]["seconds"]),
        "gc_phases": {p: med(lambda r, p=p: r["gc"]["phases"].get(p, 0.0)) for p in phases},
        "bare_list_seconds": med(lambda r: r["bare_list"]["seconds"]),
        "bare_delete_seconds": med(lambda r: r["bare_delete"]["seconds"]),
        "bare_list_objects_per_s": med(lambda r: r["bare_list"]["objects_per_s"]),
        "bare_delete_objects_per_s": med(lambda r: r["bare_delete"]["objects_per_s"]),
        "gc_list_objects_per_s": med(lambda r: r["gc"]["rates"]["list_objects_per_s"] or 0),
        "gc_mark_objects_per_s": med(lambda r: r["gc"]["rates"]["mark_objects_per_s"] or 0),
        "gc_sweep_objects_per_s": med(lambda r: r["gc"]["rates"]["sweep_objects_per_s"] or 0),
        "ratio": med(lambda r: r["ratio"]),
        "ratio_core": med(lambda r: r["ratio_core"]),
        "goal_met": med(lambda r: r["ratio"]) <= GOAL,
    }


def document(args: Any, commit: str | None, machine: dict[str, Any], results: dict[str, Any]) -> dict[str, Any]:
    return {
        "benchmark": "gc",
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "git": commit,
        "machine": {**machine, "loadavg_at_end": os.getloadavg()[0]},
        "params": {"size": args.size, "chunks": args.chunks, "chunks_per_blob": args.per_blob,
                   "shared_chunks_per_garbage_blob": args.shared, "rounds": args.rounds,
                   "payload_bytes": [fill.MIN_PAYLOAD, fill.MAX_PAYLOAD], "grace": 0,
                   "data": "half the blobs tagged through environments, half garbage (every other one an "
                           "environment whose tag was removed, the rest bare layers)"},
        "goal": {"ratio_max": GOAL, "met": {b: r["median"]["goal_met"] for b, r in results.items()}},
        "results": results,
        "notes": [
            "ratio = wall time of layergc.collect / (bare list_info of the whole store + bare delete_many of "
            "exactly the keys the collector deleted, on the same objects written back)",
            "ratio_core: the phases but retention and housekeeping (list, mark, recheck, sweep)",
            "one store handle for every timed operation (the S3 client is warm for all of them)",
            "local: PosixBackend on the machine's disk; s3: S3Backend against radosgw of a single-node Ceph "
            "(one memstore OSD) on the same 2 cores",
        ],
    }
