"""Benchmark the EROFS builder against mkfs.erofs, and dedup across successive releases.

1. Throughput and size on a real Debian userland (`mmdebstrap --variant=minbase bookworm`,
   extracted under bench/.cache/erofs-build/rootfs): our build_layer (build + chunk + hash),
   and build_layer with a sink (`build_layer(..., sink=MemorySink())`): every distinct chunk
   compressed with zstd into the chunk object a push stores, in worker threads while the image
   is built (the objects are counted and dropped: the memory a store write would not need), at
   the store's default level and at levels 1 and 2 for the size / speed trade-off, vs
   mkfs.erofs (erofs-utils, uncompressed and -zlz4hc),
   MB/s of file content and image size. mkfs.erofs computes no chunk digests and no image
   digest; we do not skip ours. Every run reads a warm page cache (the tree is read right
   before it); rounds of the tools alternate, so that load from other work on the machine
   spreads over all of them; best and median of N, the load average at every round. After
   the rounds, one build pushed end to end into a fresh local store (`StoreSink`, then
   `push_layer`; the store fsyncs every object).
2. Dedup: ten successive releases of one project's source tree (sdists from PyPI, downloaded
   with pip), each built as a layer and pushed to one fresh local store, in several variants:
   as extracted or normalised (all_root + mtime clamp), each release built afresh or on the
   previous release's image (`parent=`), and chunk policies around the default. For each:
   new uncompressed bytes / the largest release's image, and stored (zstd-compressed) bytes /
   the largest release's image pushed alone. "The largest release" is always a fresh build
   with the variant's image options (a parent-built image also holds bytes nothing uses any
   more, so it would flatter the ratio). A fixed 1 MiB cut of the same images is a baseline.

Writes bench/results/build.json (full) or build-quick.json. Usage: python bench/build.py [--size
quick|full] [--runs N] [--package django --versions ...] [--throughput-only (appends the throughput
rounds to the results)]; --size defaults to $BENCH_SIZE (as `make bench` sets it), else quick: 3
throughput rounds, and the dedup of the two variants the goal names (normalized, and normalized on
the parent; ten releases each, each beside a fixed 1 MiB cut of the same images); full: 5 rounds and
every dedup variant, with the chunk-policy trade-offs. The dedup stores count bytes, so they do not
fsync (the end-to-end push of the throughput part does). The Debian tree comes from the minbase tar
the tests cache (built once per machine), extracted once under bench/.cache/erofs-build/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import blake3

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.burst import inputs  # noqa: E402
from erofs_builder.build import BuiltLayer, build_layer, hash_image, push_layer  # noqa: E402
from erofs_builder.chunking import ChunkPolicy  # noqa: E402
from erofs_builder.compress import COMPRESS_THREADS, MemorySink, StoreSink  # noqa: E402
from erofs_builder.sources.source_dir import dir_entries  # noqa: E402
from layerstore import chunkobj  # noqa: E402
from layerstore.backends.posix import PosixBackend  # noqa: E402
from layerstore.chunker import fixed_boundaries  # noqa: E402
from layerstore.store import Store  # noqa: E402

CACHE = ROOT / "bench" / ".cache" / "erofs-build"
RESULTS = ROOT / "bench" / "results" / "build.json"
MB = 1e6
SOURCE_DATE_EPOCH = 1_600_000_000


def sh(*args: str, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, check=True, capture_output=True, text=True, **kw)  # type: ignore[call-overload]


def debian_rootfs() -> Path:
    """The minbase tree, extracted once from the Debian minbase tar the tests and the VM benchmark
    cache too (bench/burst/inputs.py `minbase_tar`: one mmdebstrap per machine for all of them)."""
    rootfs = CACHE / "rootfs"
    if (rootfs / "usr").is_dir():
        return rootfs
    CACHE.mkdir(parents=True, exist_ok=True)
    tar = inputs.minbase_tar()
    tmp = CACHE / "rootfs.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    sh("tar", "-xf", str(tar), "--numeric-owner", "--xattrs", "--xattrs-include=*", "-C", str(tmp))
    tmp.rename(rootfs)
    return rootfs


def warm(root: Path) -> None:
    """Read the whole tree (metadata and contents) into the page cache. This VM reclaims idle
    page cache within seconds (DAMON pageout), so every timed run is preceded by this.
    (`tar -cf /dev/null` would not do: GNU tar skips reading contents when writing to /dev/null.)"""
    buf = bytearray(1 << 20)
    for dirpath, _dirnames, filenames in os.walk(root):
        for n in filenames:
            p = os.path.join(dirpath, n)
            if os.path.isfile(p) and not os.path.islink(p):
                with open(p, "rb", buffering=0) as f:
                    while f.readinto(buf):
                        pass


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


def bench_throughput(rootfs: Path, runs: int, work: Path) -> dict[str, object]:
    stats = tree_stats(rootfs)
    out: dict[str, object] = {"tree": str(rootfs.relative_to(ROOT)), **stats, "loadavg_at_start": os.getloadavg()}
    dpkg = subprocess.run(["dpkg-query", "-W", "-f=${Version}", "erofs-utils"], capture_output=True, text=True)
    out["mkfs_version"] = f"erofs-utils {dpkg.stdout.strip() or 'unknown'}"
    ours = work / "ours.img"
    layers: list[BuiltLayer] = []
    compressed: dict[int, list[int]] = {}

    def run_ours() -> None:
        layers.append(build_layer(dir_entries(rootfs), ours))

    def run_ours_compressed(level: int) -> None:
        sink = MemorySink(level=level, keep=False)
        build_layer(dir_entries(rootfs), work / "ours_compressed.img", sink=sink)
        compressed.setdefault(level, []).append(sink.stats.stored_bytes)

    def run_mkfs(img: Path, extra: list[str]) -> None:
        if img.exists():
            img.unlink()
        sh("mkfs.erofs", "--quiet", "-U", "00000000-0000-0000-0000-000000000001", *extra, str(img), str(rootfs))
        fd = os.open(img, os.O_RDONLY)  # durable, like build_layer's output
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    level = chunkobj.DEFAULT_LEVEL
    contenders: dict[str, Callable[[], None]] = {
        "layerstore": run_ours,
        "mkfs_erofs": lambda: run_mkfs(work / "mkfs_erofs.img", []),
        "layerstore_compressed": lambda: run_ours_compressed(level),
        "mkfs_erofs_lz4hc": lambda: run_mkfs(work / "mkfs_erofs_lz4hc.img", ["-zlz4hc"]),
    }
    for other in OTHER_LEVELS:
        contenders[f"layerstore_compressed_level{other}"] = lambda other=other: run_ours_compressed(other)
    times: dict[str, list[float]] = {name: [] for name in contenders}
    cpu_times: dict[str, list[float]] = {name: [] for name in contenders}
    loads: list[float] = []
    for _ in range(runs):  # alternate, so that outside load hits every contender alike
        loads.append(round(os.getloadavg()[0], 2))
        for name, fn in contenders.items():
            warm(rootfs)
            cpu = _cpu_seconds()
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
            cpu_times[name].append(_cpu_seconds() - cpu)
    out["loadavg_1min_at_each_round"] = loads
    layer = layers[-1]
    for name in contenders:
        secs = min(times[name])
        median = statistics.median(times[name])
        entry: dict[str, object] = {"seconds": round(secs, 3), "MBps": round(stats["content_bytes"] / MB / secs, 1),
                                    "median_MBps": round(stats["content_bytes"] / MB / median, 1),
                                    "all_seconds": [round(x, 3) for x in times[name]],
                                    # CPU time (user + system, all threads; for mkfs.erofs its
                                    # process): what the work costs, whatever the load
                                    "cpu_seconds_min": round(min(cpu_times[name]), 3),
                                    "cpu_seconds_median": round(statistics.median(cpu_times[name]), 3)}
        if name == "layerstore":
            meta = sum(r.length for r in layer.refs if r.metadata)
            entry.update(image_bytes=layer.size, chunks=len(layer.refs), metadata_bytes=meta,
                         metadata_chunks=sum(1 for r in layer.refs if r.metadata),
                         what="build + chunk + hash (build_layer), tails up to half a block packed")
            old = old_policy_refs(layer)
            entry.update(chunks_old_policy=len(old), metadata_chunks_old_policy=sum(1 for r in old if r.metadata))
        elif name.startswith("layerstore_compressed"):
            lvl = int(name.removeprefix("layerstore_compressed_level") or level) if "level" in name else level
            entry.update(image_bytes=layer.size, compressed_chunk_bytes=compressed[lvl][-1], zstd_level=lvl,
                         what=f"build_layer(sink=MemorySink(level={lvl})): the image and the chunk object "
                              f"(zstd level {lvl}) of every distinct chunk, compressed in {COMPRESS_THREADS} "
                              "worker threads while the image is built")
        else:
            img = work / f"{name}.img"
            entry.update(image_bytes=img.stat().st_size, args="-zlz4hc" if "lz4" in name else "(defaults)",
                         what="mkfs.erofs + fsync of the image")
        out[name] = entry
    warm(rootfs)  # once, end to end into a local store (it fsyncs every chunk object)
    store_dir = work / "push-store"
    with Store.open(str(store_dir)) as store:
        store.init()
        cpu = _cpu_seconds()
        t = time.perf_counter()
        pushed = build_layer(dir_entries(rootfs), work / "pushed.img", sink=StoreSink(store))
        st = push_layer(store, pushed)
        secs = time.perf_counter() - t
        out["layerstore_push_local_store"] = {
            "seconds": round(secs, 3), "MBps": round(stats["content_bytes"] / MB / secs, 1),
            "cpu_seconds": round(_cpu_seconds() - cpu, 3), "new_chunks": st.new_chunks,
            "stored_bytes": st.stored_bytes, "loadavg_1min": round(os.getloadavg()[0], 2),
            "what": "build_layer(sink=StoreSink(store)) + push_layer into a fresh local store (fsync per object), once"}
    shutil.rmtree(store_dir)
    for variant, pack in (("layerstore_no_pack_tails", False), ("layerstore_pack_all_tails", True)):
        other = build_layer(dir_entries(rootfs), work / f"{variant}.img", pack_tails=pack)
        out[variant] = {"image_bytes": other.size, "chunks": len(other.refs)}
    out["loadavg_at_end"] = os.getloadavg()
    return out


OTHER_LEVELS = (1, 2)  # zstd levels measured besides the store's default


def _cpu_seconds() -> float:
    """CPU seconds used so far by this process (all threads) and its waited-for children."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime
# the chunk policy before metadata was cut into large chunks: for the before/after chunk counts
OLD_POLICY = ChunkPolicy(meta_chunk=64 << 10, dir_chunk=64 << 10, meta_target=0)


def old_policy_refs(layer: BuiltLayer) -> list[object]:
    assert layer.layout is not None
    fd = os.open(layer.path, os.O_RDONLY)
    try:
        return hash_image(fd, layer.layout, OLD_POLICY)[1]  # type: ignore[return-value]
    finally:
        os.close(fd)


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


def dedup_variants(full: bool) -> list[tuple[str, dict[str, object], bool]]:
    """(name, build_layer options, built on the previous release?)"""
    norm: dict[str, object] = {"all_root": True, "mtime_clamp": SOURCE_DATE_EPOCH}
    out: list[tuple[str, dict[str, object], bool]] = [
        ("normalized", norm, False),  # all_root + SOURCE_DATE_EPOCH-style clamp, defaults
        ("normalized_parent", norm, True),  # each release built on the previous release's image
    ]
    if full:  # quick: the two variants the goal names (each beside its fixed 1 MiB cut baseline)
        out += [
            ("as_extracted", {}, False),  # owners and mtimes exactly as in each sdist (they differ per release)
            ("normalized_parent_no_pack_tails", {**norm, "pack_tails": False}, True),
            ("as_extracted_parent", {}, True),
            # metadata cut as before this change (volatile records every 64 KiB, stable groups alone)
            ("normalized_small_meta_chunks", {**norm, "policy": OLD_POLICY}, False),
            ("normalized_parent_small_meta_chunks", {**norm, "policy": OLD_POLICY}, True),
        ]
        # the chunk-count / dedup trade-off around the defaults (see docs/benchmarks-build.md)
        groups = {"512KiB_groups": ChunkPolicy(min_group=128 << 10, target_group=512 << 10, max_group=1 << 20,
                                               big=256 << 10),
                  "64KiB_groups": ChunkPolicy(min_group=16 << 10, target_group=64 << 10, max_group=128 << 10)}
        for name, policy in groups.items():
            out.append((f"normalized_{name}", {**norm, "policy": policy}, False))
        out.append(("normalized_no_pack_tails", {**norm, "pack_tails": False}, False))
        for kib in (1024, 16):  # the directories' chunks, which a parent build rewrites in place
            policy = ChunkPolicy(dir_chunk=kib << 10)
            out.append((f"normalized_parent_{kib}KiB_dir_chunks", {**norm, "policy": policy}, True))
        for kib in (128, 512, 1024):  # stable groups merged into chunks of about this size
            policy = ChunkPolicy(meta_target=kib << 10)
            out.append((f"normalized_{kib}KiB_stable_meta_chunks", {**norm, "policy": policy}, False))
    return out


def _bytes_store(store_dir: Path) -> Store:
    """A local store for the dedup figures, which count bytes, not time: no fsync per object."""
    return Store(PosixBackend(str(store_dir), fsync=False))


def _push_alone(layer: BuiltLayer, store_dir: Path) -> int:
    """Compressed bytes of one image pushed to an empty store."""
    with _bytes_store(store_dir) as store:
        store.init()
        stored = push_layer(store, layer).stored_bytes
    shutil.rmtree(store_dir)
    return stored


def bench_dedup(package: str, versions: list[str], work: Path, full: bool) -> dict[str, object]:
    trees = fetch_releases(package, versions)
    out: dict[str, object] = {"package": package, "versions": versions}
    largest_of: dict[str, tuple[int, Path]] = {}
    for variant, kw, on_parent in dedup_variants(full):
        image_kw = {k: v for k, v in kw.items() if k != "policy"}
        key = repr(sorted(image_kw.items()))
        if key not in largest_of:  # the largest release, built afresh with these image options
            sizes = [(build_layer(dir_entries(t), work / "probe.img", **image_kw).size, t)  # type: ignore[arg-type]
                     for t in trees]
            largest_of[key] = max(sizes, key=lambda st: st[0])
            (work / "probe.img").unlink()
        largest, tree = largest_of[key]
        layer = build_layer(dir_entries(tree), work / "largest.img", **kw)  # type: ignore[arg-type]
        largest_stored = _push_alone(layer, work / "store-alone")
        layer.path.unlink()
        store_dir = work / f"store-{variant}"
        releases = []
        fixed_seen: set[str] = set()
        fixed_new = 0
        parent: BuiltLayer | None = None
        with _bytes_store(store_dir) as store:
            store.init()
            for v, tree in zip(versions, trees, strict=True):
                extra = {"parent": parent} if on_parent and parent is not None else {}
                layer = build_layer(dir_entries(tree), work / f"{package}-{v}.img", **kw, **extra)  # type: ignore[arg-type]
                st = push_layer(store, layer)
                fd = os.open(layer.path, os.O_RDONLY)
                try:
                    for off, length in fixed_boundaries(layer.size, 1 << 20):
                        d = blake3.blake3(os.pread(fd, length, off)).hexdigest()
                        if d not in fixed_seen:
                            fixed_seen.add(d)
                            fixed_new += length
                finally:
                    os.close(fd)
                new_meta = sum(r.length for r in {r.digest: r for r in layer.refs}.values() if r.metadata)
                releases.append({"version": v, "image_bytes": layer.size, "chunks": len(layer.refs),
                                 "new_bytes": st.new_bytes, "new_chunks": st.new_chunks,
                                 "stored_compressed_bytes": st.stored_bytes, "metadata_bytes": new_meta,
                                 "metadata_chunks": sum(1 for r in layer.refs if r.metadata),
                                 "parent_used": layer.parent_used})
                if parent is not None:
                    parent.path.unlink()
                parent = layer
        assert parent is not None
        parent.path.unlink()
        new_total = sum(r["new_bytes"] for r in releases)  # type: ignore[misc]
        stored = sum(r["stored_compressed_bytes"] for r in releases)  # type: ignore[misc]
        on_disk = sum(p.stat().st_size for p in store_dir.rglob("*") if p.is_file())
        shutil.rmtree(store_dir)
        out[variant] = {
            "built_on_previous_release": on_parent,
            "releases": releases,
            "largest_image_bytes": largest,
            "largest_stored_compressed_bytes": largest_stored,
            "stored_uncompressed_bytes": new_total,
            "ratio_stored_over_largest": round(new_total / largest, 3),
            "stored_compressed_bytes": stored,
            "ratio_stored_compressed_over_largest_compressed": round(stored / largest_stored, 3),
            "store_on_disk_bytes": on_disk,
            "chunks_per_release": round(sum(r["chunks"] for r in releases) / len(releases)),  # type: ignore[misc]
            "metadata_chunks_per_release": round(sum(r["metadata_chunks"] for r in releases)  # type: ignore[misc]
                                                 / len(releases)),
            "baseline_fixed_1MiB_ratio": round(fixed_new / largest, 3),
        }
        print(f"{variant}: {out[variant]['ratio_stored_over_largest']} uncompressed, "
              f"{out[variant]['ratio_stored_compressed_over_largest_compressed']} compressed, "
              f"{out[variant]['chunks_per_release']} chunks", file=sys.stderr)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", choices=["quick", "full"], default=os.environ.get("BENCH_SIZE", "quick"))
    ap.add_argument("--runs", type=int, default=None, help="throughput rounds (quick: 3, full: 5)")
    ap.add_argument("--package", default="Django")
    ap.add_argument("--versions", nargs="*", default=[f"4.2.{i}" for i in range(1, 11)])
    ap.add_argument("--skip-rootfs", action="store_true")
    ap.add_argument("--throughput-only", action="store_true",
                    help="only the throughput rounds, appended to 'rootfs_more_runs' of the existing results")
    args = ap.parse_args()
    if (args.runs is not None and args.runs < 1) or not args.versions:
        ap.error("--runs must be at least 1, and --versions name at least one release")
    full = args.size == "full"
    if args.throughput_only:
        kept = json.loads(RESULTS.read_text())
        with tempfile.TemporaryDirectory(prefix="bench-build-", dir=CACHE.parent) as t:
            run = bench_throughput(debian_rootfs(), args.runs or (5 if full else 3), Path(t))
        kept.setdefault("rootfs_more_runs", []).append(run)
        RESULTS.write_text(json.dumps(kept, indent=2) + "\n")
        print(json.dumps(run, indent=2))
        return
    result: dict[str, object] = {
        "size": args.size,
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()},
        "goals": {"throughput": "layerstore MBps >= mkfs_erofs MBps, and layerstore_compressed (build + chunk + "
                                "hash + zstd of every distinct chunk) MBps >= mkfs_erofs MBps",
                  "size": "layerstore image_bytes <= mkfs_erofs image_bytes",
                  "dedup": "ratio_stored_over_largest <= 1.3 over ten releases (normalized_parent; "
                           "and normalized, built afresh)"},
    }
    with tempfile.TemporaryDirectory(prefix="bench-build-", dir=CACHE.parent if CACHE.parent.exists() else None) as t:
        work = Path(t)
        if not args.skip_rootfs:
            result["rootfs"] = bench_throughput(debian_rootfs(), args.runs or (5 if full else 3), work)
            for p in work.iterdir():
                p.unlink()
        result["dedup"] = bench_dedup(args.package, args.versions, work, full)
    out = RESULTS if full else RESULTS.with_name(f"build-{args.size}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
