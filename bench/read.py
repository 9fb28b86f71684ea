"""Read throughput of EROFS images served lazily by the node daemon (`layerctl daemon`), against the
same images mounted file-backed from a local file (the physical limit here) and the plain source
directory. Same run, same data for every contender.

Workloads:
- `seq`: sequential read (1 MiB reads) of the large files of an image of random data;
- `walk_hash`: os.walk + read + blake3 of every file of a copy of a Python standard library.

Contenders (EROFS is mounted with mount(2), file-backed, no loop device; `_dio`: `-o directio`):
- `erofs_local`, `erofs_local_dio`: the image file on local disk. `erofs_local` is the reference:
  every ratio is to it;
- `fuse_warm`, `fuse_warm_dio`: EROFS on MOUNTPOINT/blobs/<digest> of a daemon whose node cache
  holds every chunk of the image (all reads are cache hits);
- `fuse_cold`, `fuse_cold_dio`: the same with an empty node cache and a local-directory store on
  the same disk (every chunk is fetched, verified, decompressed, committed and served);
- `promoted` ("layerstore warm, promoted"): the same warm node cache, the blob pinned through the
  daemon (`fuse_client.control.pin`) and EROFS mounted file-backed, buffered, on the pinned cache
  data file, as the runtime shim does for complete blobs: no FUSE hop at all;
- `fanotify_warm`, `fanotify_partial`, `fanotify_cold` (docs/fanotify.md): EROFS mounted buffered
  on the node cache's data file, attached (marked, metadata filled), the daemon started with
  LAYERSTORE_DATA_PATH=fanotify and filling missing chunks on pre-content events. warm: the warm
  cache (complete: the mark goes after the first events); partial: every chunk but the blob's last
  data chunk (the mark stays, every read raises an event answered from the cache, until the
  workload reaches that chunk); cold: an empty cache and the local store, as `fuse_cold`.
  Goals: warm and partial at least 0.97x of erofs_local, cold daemon CPU per GB fetched at most
  half of fuse_cold's (`cold_cpu_<workload>`), the same from S3 (`cold_cpu_s3_<link>`);
- `source`: the plain directory the images were built from;
- `erofsfuse` (erofs-utils): reported as unavailable (see UNAVAILABLE).

Cache states are explicit and the same for every contender and every run: a fresh EROFS mount,
a freshly started daemon for the FUSE contenders (nothing of the node cache mapped or in memory
beyond its index), then `sync; echo 3 > /proc/sys/vm/drop_caches`, then the timed workload. So
"warm" means the node cache holds the chunks on local disk, and no contender reads anything from
the page cache. Cold runs mount before dropping the caches: opening the blob fetches its metadata
chunks (timed apart, as `mount_s`). The `hot` section is labelled apart: everything in the page
cache (an untimed first pass, then a fresh EROFS mount, no drop), which leaves the cost of the
FUSE path itself.

Measured with every FUSE run: the FUSE read requests (the daemon's hits + misses), bytes served and
fetched, the daemon's CPU time; with every EROFS run: the page cache held afterwards by EROFS, by
its backing file (the image file or the FUSE blob file) and by the node cache's data file
(cachestat(2)): the memory side of `directio`. `--daemon-probe strace|perf` attaches `strace -c -f`
or `perf stat` (task clock, page faults, context switches) to the daemon for exactly each timed
FUSE run: counts per request that the load of a shared machine does not move.

The cost of one FUSE request on the cache-hit path: O_DIRECT reads of 4 KiB, 128 KiB and 1 MiB of
a blob through the mount, the data in the page cache (wall time, and the daemon's own CPU time
from its main thread's schedstat, per request as counted by the daemon), and the read handler
alone, called without a kernel (the daemon's Python share).

S3 (`--s3`, default on): cold sequential read of an image in an S3 store on a local Ceph RGW
(testkit.ceph_cluster) against the store's own parallel GET bandwidth (16 threads, the daemon's
fetch concurrency), both measured in every round, and the same cold read on the fanotify path (daemon CPU per GB
against the FUSE path's); first over loopback (RGW, the OSD and the
daemon share the 2 CPUs, no network limit), then over a shaped link, as a store is reached on a
real node: RGW in a network namespace behind a veth pair with a tbf rate limit
(bench/burst/netlink.py, bench/burst/cephstore.py), at each rate of `--s3-rates` (quick: 1, full: 1 and
4 Gbit/s). Every pair records the CPU seconds per GB of the client, the daemon, Ceph and the
machine, and (shaped) the bytes that crossed the link.

Rounds interleave the contenders (the order rotates each round). Figures: best and median of the
rounds; ratios both as best/best and as the median of same-round ratios (the machine is shared:
see loadavg). The code is in bench/readbench/ (one module per concern; see its __init__.py).

    python bench/read.py [--size quick|full] [--reps N] [--s3 | --no-s3] [--s3-rates MBIT,...] [--out FILE]
                         [--contenders a,b] [--workloads a,b]

`--size` defaults to $BENCH_SIZE (as `make bench` sets it), else full. quick: 128 MiB of large
files, 2 rounds, no all-in-page-cache section, S3 with 64 MiB over loopback and 1 Gbit/s (about 2
minutes; results in bench/results/read-quick.json; 256 MiB, 3 rounds, the hot section and both
links took 4.6 minutes at load 6-13);
full: 1 GiB, 7 rounds, S3 with 512 MiB over loopback, 1 and 4 Gbit/s (about 10 minutes;
bench/results/read.json).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.readbench import spec  # noqa: E402
from bench.readbench.session import run_in_workdir  # noqa: E402
from bench.readbench.workloads import WORKLOADS  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(spec.SIZES), default=spec.default_size())
    ap.add_argument("--big-mib", type=int, default=None)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--s3-mib", type=int, default=None)
    ap.add_argument("--s3", action=argparse.BooleanOptionalAction, default=True,
                    help="also: cold reads from S3 on a local Ceph RGW (default on)")
    ap.add_argument("--s3-rates", default=None, metavar="MBIT,...",
                    help="shaped-link rates (Mbit/s) for the S3 pair, besides loopback; empty: loopback only "
                         "(default: the size's)")
    ap.add_argument("--contenders", default=",".join(spec.CONTENDERS),
                    help="comma-separated subset of " + ",".join(spec.CONTENDERS))
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset of " + ",".join(WORKLOADS))
    ap.add_argument("--hot", action=argparse.BooleanOptionalAction, default=None,
                    help="the all-in-page-cache section (default: full only)")
    ap.add_argument("--hit-path", action=argparse.BooleanOptionalAction, default=True,
                    help="the cost of one FUSE request on the cache-hit path")
    ap.add_argument("--daemon-env", action="append", default=[], metavar="KEY=VALUE",
                    help="extra environment for the daemon (e.g. for profiling)")
    ap.add_argument("--daemon-arg", action="append", default=[], metavar="ARG",
                    help="extra `layerctl daemon` argument (repeat for each; default: the shipped defaults)")
    ap.add_argument("--daemon-probe", choices=sorted(spec.DAEMON_PROBES), default=None,
                    help="attach it to the daemon for each timed FUSE run; its summary goes into the results")
    ap.add_argument("--workdir", type=Path, default=None, help="default: a temporary directory under /var/tmp")
    ap.add_argument("--out", type=Path, default=None,
                    help="default: bench/results/read.json (full) or read-<size>.json")
    args = ap.parse_args(argv)
    for name, value in spec.SIZES[args.size].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.out is None:
        args.out = spec.default_out(args.size)
    try:
        args.s3_rates = [float(r) for r in args.s3_rates.split(",") if r.strip()]
    except ValueError:
        ap.error(f"--s3-rates: {args.s3_rates!r} is not a comma-separated list of numbers (Mbit/s)")
    if bad := [r for r in args.s3_rates if not 1 <= r <= 100_000]:
        ap.error(f"--s3-rates: {', '.join(f'{r:g}' for r in bad)}: each rate must be 1-100000 Mbit/s")
    if bad := [n for n in ("big_mib", "reps", "s3_mib") if getattr(args, n) < 1]:
        ap.error(", ".join(f"--{n.replace('_', '-')}" for n in bad) + ": must be at least 1")
    args.contenders = [c for c in args.contenders.split(",") if c]
    args.workloads = [w for w in args.workloads.split(",") if w]
    if unknown := (set(args.contenders) - set(spec.CONTENDERS)) | (set(args.workloads) - set(WORKLOADS)):
        ap.error(f"unknown contender or workload: {', '.join(sorted(unknown))}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    spec.DAEMON_ARGS[:] = args.daemon_arg
    spec.DAEMON_PROBE[:] = spec.DAEMON_PROBES[args.daemon_probe] if args.daemon_probe else []
    if os.geteuid() != 0:
        print("needs root (mounts, drop_caches)", file=sys.stderr)
        return 2
    return run_in_workdir(args)


if __name__ == "__main__":
    sys.exit(main())
