"""The timed operations: the backend's bare list and batch delete, and one collection; and the
check that the collection left exactly the live set, readable and verified."""

from __future__ import annotations

import cProfile
import io
import pstats
import random
import time
from typing import Any

import layergc

from layerstore import keys
from layerstore.backends import Backend
from layerstore.errors import LayerstoreError
from layerstore.store import Store
from manifest.schema import Manifest

from .fill import Plan

CONTENT = ("manifests/", "blobs/", "chunks/")
SAMPLE_CHUNKS = 2000


def bare_list(backend: Backend) -> dict[str, Any]:
    """One `list_info` of every object in the store, every entry consumed."""
    t0 = time.monotonic()
    n = 0
    for _info in backend.list_info(""):
        n += 1
    secs = time.monotonic() - t0
    return {"objects": n, "seconds": round(secs, 4), "objects_per_s": round(n / secs)}


def bare_delete(backend: Backend, keys_: list[str]) -> dict[str, Any]:
    """One `delete_many` of `keys_` (the backend batches as it can)."""
    t0 = time.monotonic()
    removed = backend.delete_many(keys_)
    secs = time.monotonic() - t0
    if removed != len(keys_):
        raise SystemExit(f"bare delete removed {removed} of {len(keys_)} objects: the copy was not identical")
    return {"objects": removed, "seconds": round(secs, 4), "objects_per_s": round(removed / secs)}


def collect(store: Store, profile: bool = False) -> tuple[dict[str, Any], str | None]:
    """One collection with grace 0 (everything in the store is older than the run); with
    `profile`, under cProfile (main thread only: the mark's loads run in the store's pool)."""
    prof = cProfile.Profile() if profile else None
    t0 = time.monotonic()
    if prof is not None:
        prof.enable()
    report = layergc.collect(store, grace=0.0)
    if prof is not None:
        prof.disable()
    secs = time.monotonic() - t0
    phases = dict(report.phases)
    out = {
        "seconds": round(secs, 4),
        "phases": {k: round(v, 4) for k, v in phases.items()},
        "listed": report.listed.objects, "marked": report.marked.objects, "deleted": report.deleted.objects,
        "deleted_bytes": report.deleted.bytes, "missing": report.missing_count, "unreadable": len(report.unreadable),
        "kept_grace": report.kept_grace.objects, "kept_lease": report.kept_lease.objects,
        "rescued": report.rescued.objects, "housekeeping": report.housekeeping,
        "rates": {
            "list_objects_per_s": _rate(report.listed.objects, phases.get("list")),
            "mark_objects_per_s": _rate(report.marked.objects, phases.get("mark")),
            "sweep_objects_per_s": _rate(report.deleted.objects, phases.get("sweep")),
        },
    }
    text = None
    if prof is not None:
        buf = io.StringIO()
        stats = pstats.Stats(prof, stream=buf)
        stats.sort_stats("tottime").print_stats(20)
        stats.sort_stats("cumulative").print_stats(30)
        text = buf.getvalue()
    return out, text


def _rate(n: int, secs: float | None) -> int | None:
    return round(n / secs) if secs else None


def check(store: Store, plan: Plan, gc: dict[str, Any]) -> dict[str, Any]:
    """The collection deleted exactly the garbage and nothing it needs: the content left is the
    live set, every live chunk map and manifest decodes, a sample of live chunks verifies."""
    garbage = len(plan.garbage_keys())
    problems = []
    if gc["deleted"] != garbage:
        problems.append(f"deleted {gc['deleted']} objects, the garbage is {garbage}")
    if gc["missing"] or gc["unreadable"]:
        problems.append(f"{gc['missing']} missing, {gc['unreadable']} unreadable")
    left = {i.key for p in CONTENT for i in store.backend.list_info(p)}
    if left != plan.live_keys:
        problems.append(f"{len(left - plan.live_keys)} objects left that are not live, "
                        f"{len(plan.live_keys - left)} live objects gone")
    if problems:  # something is gone: reading it would only fail on the first such object
        raise SystemExit("gc benchmark: the collection was wrong: " + "; ".join(problems))
    manifests = [k for k in plan.live_keys if k.startswith("manifests/")]
    maps = [k for k in plan.live_keys if k.startswith("blobs/")]
    sample = random.Random(plan.seed).sample(list(plan.live_chunks), min(SAMPLE_CHUNKS, len(plan.live_chunks)))
    try:
        named: set[str] = set()
        for key in manifests:
            named.update(Manifest.from_bytes(store.get_manifest(keys.digest_of_key(key)[1])).blobs)
        for key in maps:
            store.get_chunk_map(keys.digest_of_key(key)[1])
        if {keys.object_key("blobs", b) for b in named} != set(maps):
            problems.append("the live manifests do not name exactly the live chunk maps")
        datas = store.pool.map(store.get_chunk, [plan.digests[i] for i in sample])
        for i, data in zip(sample, datas, strict=True):
            if len(data) != plan.lengths[i]:
                problems.append(f"chunk {i}: {len(data)} bytes, want {plan.lengths[i]}")
    except LayerstoreError as e:
        problems.append(f"a live object does not read back: {e}")
    if problems:
        raise SystemExit("gc benchmark: the collection was wrong: " + "; ".join(problems))
    return {"left": len(left), "manifests_read": len(manifests), "chunk_maps_read": len(maps),
            "chunks_verified": len(sample)}
