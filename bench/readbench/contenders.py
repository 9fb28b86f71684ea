"""One timed run of a workload on a contender, with the cache state the benchmark's doc describes:
a fresh EROFS mount, a fresh daemon for the FUSE contenders, then drop_caches (not when `hot`)."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .mounts import daemon, erofs_mount
from .probes import drop_caches, timed, tree_cached_bytes
from .project import linux, pin, request_json, unpin
from .spec import PIN_HOLDER
from .workloads import WORKLOADS


@dataclass
class Images:
    store: str
    work: Path
    trees: dict[str, Path]
    paths: dict[str, Path]
    blobs: dict[str, str]
    warm_cache: Path
    daemon_env: dict[str, str]
    partial: dict[str, list[int]] = field(default_factory=dict)  # blob -> the chunks a partly cached cache holds


def run_one(im: Images, contender: str, workload: str, *, hot: bool = False) -> dict[str, Any]:
    """One timed run of `workload` on `contender`, cache state as the module doc says."""
    tree, fn = WORKLOADS[workload]
    opts = "directio" if contender.endswith("_dio") else ""
    kind = contender.removesuffix("_dio")
    out: dict[str, Any] = {}
    # hot: an untimed pass first (through a mount of its own), so everything is in the page cache
    # except EROFS's own pages (each run mounts afresh).
    if kind == "source":
        if hot:
            fn(im.trees[tree])
        else:
            drop_caches()
        out["seconds"], out["bytes"] = timed(fn, im.trees[tree], out)
        return out
    if kind == "erofs_local":
        image = im.paths[tree]
        if hot:
            with erofs_mount(image, im.work, opts) as m:
                fn(m)
        with erofs_mount(image, im.work, opts) as m:
            if not hot:
                drop_caches()
            out["seconds"], out["bytes"] = timed(fn, m, out)
            out["memory"] = {"erofs": tree_cached_bytes(m), "backing": linux.cached_bytes(image)}
        return out
    blob = im.blobs[tree]
    if kind == "promoted":
        return run_promoted(im, blob, fn, hot, out)
    if kind.startswith("fanotify_"):
        return run_fanotify(im, blob, fn, hot, out, state=kind.removeprefix("fanotify_"))
    cold = kind == "fuse_cold"
    cache = im.work / "cache-cold" if cold else im.warm_cache
    if cold:
        shutil.rmtree(cache, ignore_errors=True)
    try:
        with daemon(im.store, cache, im.work / "mnt-fuse", im.work / "daemon.log", im.daemon_env) as d:
            if hot:
                with erofs_mount(d.blob(blob), im.work, opts) as m:
                    fn(m)
            t0 = time.perf_counter()
            with erofs_mount(d.blob(blob), im.work, opts) as m:
                out["mount_s"] = time.perf_counter() - t0
                if not hot:
                    drop_caches()
                with d.probed(out):
                    c0 = d.counters(blob)
                    out["seconds"], out["bytes"] = timed(fn, m, out)
                    c1 = d.counters(blob)
                out["memory"] = {"erofs": tree_cached_bytes(m), "backing": linux.cached_bytes(d.blob(blob)),
                                 "node_cache_file": linux.cached_bytes(d.data_file(blob))}
            out["fuse"] = {k: c1[k] - c0[k] for k in c0}
    finally:
        if cold:
            shutil.rmtree(cache, ignore_errors=True)
    return out


def run_promoted(im: Images, blob: str, fn: Callable[[Path], int], hot: bool, out: dict[str, Any]) -> dict[str, Any]:
    """EROFS on the pinned cache data file of a complete blob (buffered: it is a local file),
    the daemon running as on a node; pinned before the mount, unpinned after the unmount."""
    with daemon(im.store, im.warm_cache, im.work / "mnt-fuse", im.work / "daemon.log", im.daemon_env) as d:
        t0 = time.perf_counter()
        image = pin(im.warm_cache, blob, PIN_HOLDER)
        out["pin_s"] = time.perf_counter() - t0
        if image is None:
            raise RuntimeError(f"blob {blob} is not complete in the warm cache")
        try:
            c0, c1 = _measure_mounted(image, im, d, blob, fn, hot, out)
            out["daemon_requests"] = c1["requests"] - c0["requests"]  # 0: the daemon is not on the path
        finally:
            unpin(im.warm_cache, blob, PIN_HOLDER)
    return out


def _measure_mounted(image: Path, im: Images, d: Any, blob: str, fn: Callable[[Path], int], hot: bool,
                     out: dict[str, Any]) -> tuple[dict[str, int], dict[str, int]]:
    """EROFS on `image` (mounted once first to warm it when `hot`, else with caches dropped): `fn`
    timed into `out` with the page cache it left; the daemon's counters for `blob` before and after."""
    if hot:
        with erofs_mount(image, im.work) as m:
            fn(m)
    with erofs_mount(image, im.work) as m:
        if not hot:
            drop_caches()
        c0 = d.counters(blob)
        out["seconds"], out["bytes"] = timed(fn, m, out)
        c1 = d.counters(blob)
        out["memory"] = {"erofs": tree_cached_bytes(m), "backing": linux.cached_bytes(image)}
    return c0, c1


def run_fanotify(im: Images, blob: str, fn: Callable[[Path], int], hot: bool, out: dict[str, Any], *,
                 state: str) -> dict[str, Any]:
    """EROFS on the node cache's data file, attached (docs/fanotify.md: marked, metadata filled;
    the daemon fills the rest on pre-content events), buffered. `state`: warm (the warm node
    cache: the mark goes once the daemon sees the blob complete), partial (every chunk but the
    blob's last data chunk, fetched into a fresh cache before the mount: the mark stays, so every
    read raises an event answered from the cache, until the workload reaches that chunk), cold
    (an empty cache: every chunk fetched on events)."""
    from fuse_client.control import attach, detach

    cache = im.warm_cache if state == "warm" else im.work / f"cache-{state}-fan"
    if state != "warm":
        shutil.rmtree(cache, ignore_errors=True)
    env = {**im.daemon_env, "LAYERSTORE_DATA_PATH": "fanotify"}
    try:
        with daemon(im.store, cache, im.work / "mnt-fuse", im.work / "daemon.log", env) as d:
            if state == "partial":
                request_json(cache, "POST", "/prefetch", {"blob": blob, "chunks": im.partial[blob], "wait": True},
                             timeout=None)
            t0 = time.perf_counter()
            got = attach(cache, blob, PIN_HOLDER)
            if got is None:
                raise RuntimeError("the daemon does not serve the fanotify data path here")
            image = Path(got["path"])
            out["attach_s"] = time.perf_counter() - t0
            try:
                f0 = request_json(cache, "GET", "/stats")["fanotify"]
                c0, c1 = _measure_mounted(image, im, d, blob, fn, hot, out)
                f1 = request_json(cache, "GET", "/stats")["fanotify"]
                out["fanotify"] = {k: c1[k] - c0[k] for k in c0}
                out["fanotify"].update({k: f1[k] - f0[k] for k in ("events", "fast_allowed", "filled", "denied")})
                out["fanotify"]["marked_at_end"] = bool(f1["attached"].get(blob, {}).get("marked"))
            finally:
                detach(cache, blob, PIN_HOLDER)
    finally:
        if state != "warm":
            shutil.rmtree(cache, ignore_errors=True)
    return out
