"""Benchmark the EROFS builder against mkfs.erofs, and dedup across successive releases.

1. Throughput and size on a real Debian userland (`mmdebstrap --variant=minbase bookworm`,
   extracted under bench/.cache/erofs-build/rootfs): our build_layer (build + chunk + hash)
   vs mkfs.erofs (erofs-utils, uncompressed and -zlz4hc), MB/s of file content and image size.
   All runs read a warm page cache (the tree is read once before timing); best of N runs.
2. Dedup: ten successive releases of one project's source tree (sdists from PyPI, downloaded
   with pip), each built as a layer and pushed to one fresh local store: stored bytes / the
   largest release's image. A fixed 1 MiB cut of the same images is the baseline.

Writes bench/results/build.json. Usage: python bench/build.py [--runs N] [--package django --versions ...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import blake3

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from erofs_builder.build import build_layer, push_layer  # noqa: E402
from erofs_builder.chunking import ChunkPolicy  # noqa: E402
from erofs_builder.source_dir import dir_entries  # noqa: E402
from layerstore.chunker import fixed_boundaries  # noqa: E402
from layerstore.store import Store  # noqa: E402

CACHE = ROOT / "bench" / ".cache" / "erofs-build"
RESULTS = ROOT / "bench" / "results" / "build.json"
MB = 1e6
SOURCE_DATE_EPOCH = 1_600_000_000


def sh(*args: str, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, check=True, capture_output=True, text=True, **kw)  # type: ignore[call-overload]


def debian_rootfs() -> Path:
    rootfs = CACHE / "rootfs"
    if (rootfs / "usr").is_dir():
        return rootfs
    CACHE.mkdir(parents=True, exist_ok=True)
    tar = CACHE / "debian.tar"
    if not tar.exists():
        # no mirror argument: mmdebstrap uses the machine's apt sources
        sh("mmdebstrap", "--variant=minbase", "bookworm", str(tar))
    tmp = CACHE / "rootfs.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    sh("tar", "-xf", str(tar), "--numeric-owner", "--xattrs", "--xattrs-include=*", "-C", str(tmp))
    tmp.rename(rootfs)
    return rootfs


def tree_stats(root: Path) -> dict[str, int]:
    files = entries = size = 0
    for dirpath, dirnames, filenames in os.walk(root):
        entries += len(dirnames) + len(filenames)
        for n in filenames:
            st = os.lstat(os.path.join(dirpath, n))
            if os.path.isfile(os.path.join(dirpath, n)) and not os.path.islink(os.path.join(dirpath, n)):
                files += 1
                size += st.st_size
    return {"entries": entries + 1, "regular_files": files, "content_bytes": size}


def best_of(runs: int, fn) -> tuple[float, object]:  # type: ignore[no-untyped-def]
    best, result = float("inf"), None
    for _ in range(runs):
        t = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t)
    return best, result


def bench_throughput(rootfs: Path, runs: int, work: Path) -> dict[str, object]:
    stats = tree_stats(rootfs)
    for _ in dir_entries(rootfs):  # warm the page cache (reads metadata; contents below)
        pass
    sh("tar", "-cf", "/dev/null", "-C", str(rootfs), ".")
    out: dict[str, object] = {"tree": str(rootfs.relative_to(ROOT)), **stats}
    ours = work / "ours.img"

    def run_ours():  # type: ignore[no-untyped-def]
        return build_layer(dir_entries(rootfs), ours)

    secs, layer = best_of(runs, run_ours)
    out["layerstore"] = {"seconds": round(secs, 3), "MBps": round(stats["content_bytes"] / MB / secs, 1),
                         "image_bytes": layer.size, "chunks": len(layer.refs),  # type: ignore[union-attr]
                         "what": "build + chunk + hash (build_layer)"}
    packed = build_layer(dir_entries(rootfs), work / "packed.img", pack_tails=True)
    out["layerstore_pack_tails"] = {"image_bytes": packed.size, "chunks": len(packed.refs)}
    dpkg = subprocess.run(["dpkg-query", "-W", "-f=${Version}", "erofs-utils"], capture_output=True, text=True)
    out["mkfs_version"] = f"erofs-utils {dpkg.stdout.strip() or 'unknown'}"
    for name, extra in (("mkfs_erofs", []), ("mkfs_erofs_lz4hc", ["-zlz4hc"])):
        img = work / f"{name}.img"

        def run_mkfs(img: Path = img, extra: list[str] = extra) -> None:  # type: ignore[misc]
            if img.exists():
                img.unlink()
            sh("mkfs.erofs", "--quiet", "-U", "00000000-0000-0000-0000-000000000001", *extra, str(img), str(rootfs))
            fd = os.open(img, os.O_RDONLY)  # durable, like build_layer's output
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

        secs, _ = best_of(runs, run_mkfs)
        out[name] = {"seconds": round(secs, 3), "MBps": round(stats["content_bytes"] / MB / secs, 1),
                     "image_bytes": img.stat().st_size, "args": " ".join(extra) or "(defaults)",
                     "what": "mkfs.erofs + fsync of the image"}
    return out


def fetch_releases(package: str, versions: list[str]) -> list[Path]:
    dest = CACHE / "sdists" / package
    dest.mkdir(parents=True, exist_ok=True)
    trees = []
    for v in versions:
        have = [p for p in dest.iterdir() if p.name.lower().startswith(f"{package}-{v}.".lower())
                and p.name.endswith((".tar.gz", ".zip"))]
        if not have:
            sh(sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
               f"{package}=={v}", "-d", str(dest))
            have = [p for p in dest.iterdir() if p.name.lower().startswith(f"{package}-{v}.".lower())
                    and p.name.endswith(".tar.gz")]
        tree = dest / f"tree-{v}"
        if not tree.is_dir():
            tmp = dest / f"tree-{v}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            with tarfile.open(have[0]) as tf:
                tf.extractall(tmp, filter="tar")
            (inner,) = list(tmp.iterdir())  # the sdist's single top folder, named with the version
            inner.rename(tree)
            tmp.rmdir()
        trees.append(tree)
    return trees


def bench_dedup(package: str, versions: list[str], work: Path) -> dict[str, object]:
    trees = fetch_releases(package, versions)
    out: dict[str, object] = {"package": package, "versions": versions}
    norm = {"all_root": True, "mtime_clamp": SOURCE_DATE_EPOCH}
    small = ChunkPolicy(min_group=32 << 10, target_group=128 << 10, max_group=256 << 10, big=64 << 10)
    variants: tuple[tuple[str, dict[str, object]], ...] = (
        ("as_extracted", {}),  # owners and mtimes exactly as in each sdist (they differ per release)
        ("normalized", norm),  # all_root + SOURCE_DATE_EPOCH-style clamp, default chunk policy
        ("normalized_pack_tails", {**norm, "pack_tails": True}),
        ("normalized_128KiB_groups", {**norm, "policy": small}),
    )
    for variant, kw in variants:
        store_dir = work / f"store-{variant}"
        releases = []
        fixed_seen: set[str] = set()
        fixed_new = 0
        with Store.open(str(store_dir)) as store:
            store.init()
            for v, tree in zip(versions, trees, strict=True):
                layer = build_layer(dir_entries(tree), work / f"{package}-{v}.img", **kw)  # type: ignore[arg-type]
                st = push_layer(store, layer)
                meta_new = sum(r.length for r in layer.refs if r.metadata)
                fd = os.open(layer.path, os.O_RDONLY)
                try:
                    for off, length in fixed_boundaries(layer.size, 1 << 20):
                        d = blake3.blake3(os.pread(fd, length, off)).hexdigest()
                        if d not in fixed_seen:
                            fixed_seen.add(d)
                            fixed_new += length
                finally:
                    os.close(fd)
                layer.path.unlink()
                releases.append({"version": v, "image_bytes": layer.size, "chunks": len(layer.refs),
                                 "new_bytes": st.new_bytes, "new_chunks": st.new_chunks,
                                 "stored_compressed_bytes": st.stored_bytes, "metadata_bytes": meta_new})
        largest = max(r["image_bytes"] for r in releases)  # type: ignore[type-var]
        new_total = sum(r["new_bytes"] for r in releases)  # type: ignore[misc]
        on_disk = sum(p.stat().st_size for p in store_dir.rglob("*") if p.is_file())
        out[variant] = {
            "releases": releases,
            "largest_image_bytes": largest,
            "stored_uncompressed_bytes": new_total,
            "ratio_stored_over_largest": round(new_total / largest, 3),
            "store_on_disk_bytes": on_disk,
            "ratio_store_on_disk_over_largest": round(on_disk / largest, 3),
            "baseline_fixed_1MiB_ratio": round(fixed_new / largest, 3),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--package", default="Django")
    ap.add_argument("--versions", nargs="*", default=[f"4.2.{i}" for i in range(1, 11)])
    ap.add_argument("--skip-rootfs", action="store_true")
    args = ap.parse_args()
    result: dict[str, object] = {
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()},
        "goals": {"throughput": "layerstore MBps >= mkfs_erofs MBps",
                  "size": "layerstore image_bytes <= mkfs_erofs image_bytes",
                  "dedup": "ratio_stored_over_largest <= 1.3 over ten releases"},
    }
    with tempfile.TemporaryDirectory(prefix="bench-build-", dir=CACHE.parent if CACHE.parent.exists() else None) as t:
        work = Path(t)
        if not args.skip_rootfs:
            result["rootfs"] = bench_throughput(debian_rootfs(), args.runs, work)
            for p in work.iterdir():
                p.unlink()
        result["dedup"] = bench_dedup(args.package, args.versions, work)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
