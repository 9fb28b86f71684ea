"""The whole run: the images built and pushed, the warm node cache filled, the rounds (contenders
interleaved, the order rotating each round), the hit-path cost, S3, then the report."""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from . import report
from .contenders import Images, run_one
from .hitpath import hit_path_handler, hit_path_kernel
from .inputs import make_big_tree, make_small_tree, tree_stats
from .mounts import daemon, unmount_all_under
from .project import Store, build_layer, dir_entries, push_layer, request_json
from .s3 import run_s3
from .spec import HOT_CONTENDERS, MiB


def run_in_workdir(args: argparse.Namespace) -> int:
    """`run` in a fresh temporary directory, unmounted and removed afterwards even on failure."""
    work = Path(tempfile.mkdtemp(prefix="read-bench-", dir=args.workdir or "/var/tmp"))
    try:
        return run(args, work)
    finally:
        unmount_all_under(work)
        shutil.rmtree(work, ignore_errors=True)


def build_images(work: Path, trees: dict[str, Path], store_url: str) -> dict[str, dict[str, Any]]:
    images: dict[str, dict[str, Any]] = {}
    with Store.open(store_url) as store:
        store.init()
        for name, src in trees.items():
            t0 = time.perf_counter()
            layer = build_layer(dir_entries(src, all_root=True), work / f"{name}.erofs", all_root=True)
            push_layer(store, layer)
            last_data = max(i for i, r in enumerate(layer.refs) if not r.metadata)
            images[name] = {"blob": layer.blob, "size": layer.size, "chunks": len(layer.refs),
                            "metadata_chunks": sum(r.metadata for r in layer.refs), **tree_stats(src),
                            "partial_chunks": [i for i in range(len(layer.refs)) if i != last_data],
                            "build_and_push_s": round(time.perf_counter() - t0, 2)}
            print(f"image {name}: {layer.size / MiB:.1f} MiB, {len(layer.refs)} chunks, {images[name]['files']} files",
                  flush=True)
    return images


def fill_warm_cache(im: Images) -> None:
    """The warm node cache: every chunk of both images fetched once, then the daemon stopped."""
    with daemon(im.store, im.warm_cache, im.work / "mnt-fuse", im.work / "daemon.log", im.daemon_env):
        for blob in im.blobs.values():
            request_json(im.warm_cache, "POST", "/prefetch", {"blob": blob, "all": True, "wait": True}, timeout=None)
        ls = request_json(im.warm_cache, "GET", "/cache", timeout=30)
        if any(b["cached_chunks"] != b["chunks"] for b in ls["blobs"]):
            raise RuntimeError(f"warm cache incomplete: {ls}")


def run_rounds(args: argparse.Namespace, im: Images, hot_contenders: list[str]) -> tuple[report.Raw, report.Raw]:
    raw: report.Raw = {w: {} for w in args.workloads}
    raw_hot: report.Raw = {w: {} for w in args.workloads}
    for rnd in range(args.reps):
        for workload in args.workloads:
            k = rnd % len(args.contenders)
            for c in args.contenders[k:] + args.contenders[:k]:
                r = run_one(im, c, workload)
                raw[workload].setdefault(c, []).append(r)
                report.print_round(rnd, workload, c, r)
            for c in hot_contenders:
                r = run_one(im, c, workload, hot=True)
                raw_hot[workload].setdefault(c, []).append(r)
                report.print_round(rnd, workload, c + " (hot)", r, requests=False)
    return raw, raw_hot


def run(args: argparse.Namespace, work: Path) -> int:
    print(f"workdir {work}", flush=True)
    load_start = os.getloadavg()
    t_start = time.perf_counter()
    trees = {"big": work / "src-big", "small": work / "src-small"}
    make_big_tree(trees["big"], args.big_mib)
    make_small_tree(trees["small"])
    store_url = str(work / "store")
    images = build_images(work, trees, store_url)
    env = dict(kv.split("=", 1) for kv in args.daemon_env)
    im = Images(store_url, work, trees, {n: work / f"{n}.erofs" for n in trees},
                {n: v["blob"] for n, v in images.items()}, work / "cache-warm", env,
                {v["blob"]: v.pop("partial_chunks") for v in images.values()})
    fill_warm_cache(im)

    hot_contenders = [c for c in HOT_CONTENDERS if c in args.contenders] if args.hot else []
    raw, raw_hot = run_rounds(args, im, hot_contenders)
    results, ratio = report.figures(raw)
    hot_results, hot_ratio = report.figures(raw_hot) if hot_contenders else ({}, {})

    # The cost per FUSE request on the cache-hit path.
    hit_kernel: list[dict[str, Any]] = []
    hit_handler: list[dict[str, Any]] = []
    if args.hit_path:
        big = images["big"]
        with daemon(store_url, im.warm_cache, work / "mnt-hit", work / "daemon.log", env) as d:
            hit_kernel = hit_path_kernel(d, big["blob"], big["size"])
        hit_handler = hit_path_handler(store_url, im.warm_cache, big["blob"], big["size"])
        report.print_hit_path(hit_kernel, hit_handler)

    s3 = run_s3(args, work) if args.s3 else None
    goals = report.goals(ratio, s3, args.s3_rates if args.s3 else [], results)
    doc = report.document(args, work, env=env, images=images, results=results, ratio=ratio,
                          hot_results=hot_results, hot_ratio=hot_ratio, hit_kernel=hit_kernel,
                          hit_handler=hit_handler, s3=s3, goal_met=goals, load_start=load_start,
                          duration_s=round(time.perf_counter() - t_start, 1))
    report.write(doc, args.out)
    return 0
