"""Garbage collection against the backend's own bare rates (issue 13, docs/benchmarks-gc.md).

A store of `--chunks` chunk objects (quick 6,000, full 100,000), half of them garbage, plus
chunk maps of 200 chunks and environments, on the local backend and on S3 (radosgw of a real
single-node Ceph started here through testkit.ceph_cluster, unless `--ceph-dir DIR` names one
left running). Per round: a bare `list_info` of the whole store, one `layergc.collect` (grace 0;
phases from its report), a check that exactly the live set is left and reads back verified, the
garbage written back, then a bare `delete_many` of exactly the keys the collector deleted.
Goal: the collection within 1.5x of bare list + bare delete.

    python bench/gc.py [--size quick|full] [--chunks N] [--rounds N] [--backends local,s3] [--profile]

`--size` defaults to $BENCH_SIZE (as `make bench` sets it), else quick (6,000 chunks, 1 round,
about a minute with the Ceph start, most of it filling S3 and writing the garbage back through
radosgw, ~300 objects/s here; bench/results/gc-quick.json); full: 100,000 chunks, 2 rounds
(bench/results/gc.json). `--profile` adds a collection under cProfile per backend
(not timed into the ratio) and prints where its main thread spends its time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.gcbench import session  # noqa: E402

SIZES = {"quick": {"chunks": 6_000, "rounds": 1}, "full": {"chunks": 100_000, "rounds": 2}}
RESULTS = ROOT / "bench" / "results"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default=os.environ.get("BENCH_SIZE", "quick"))
    ap.add_argument("--chunks", type=int, help="chunk objects per store (a multiple of 2 x --per-blob)")
    ap.add_argument("--per-blob", type=int, default=200, help="chunks per chunk map")
    ap.add_argument("--shared", type=int, default=20, help="live chunks each garbage chunk map names too")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--backends", default="local,s3")
    ap.add_argument("--workers", type=int, help="fill threads (default 8 local, 16 S3)")
    ap.add_argument("--profile", action="store_true", help="one more collection per backend under cProfile")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--workdir", type=Path, help="where the local store and the cluster live (default: a temp dir)")
    ap.add_argument("--ceph-dir", type=Path, help="use a cluster left running by `ceph_cluster.py start DIR`")
    args = ap.parse_args(argv)
    args.chunks = args.chunks or SIZES[args.size]["chunks"]
    args.rounds = max(1, args.rounds or SIZES[args.size]["rounds"])
    args.backends = args.backends.split(",")
    if set(args.backends) - {"local", "s3"}:
        ap.error(f"unknown backend(s) {sorted(set(args.backends) - {'local', 's3'})}")
    if args.per_blob < 1 or args.chunks < 2 * args.per_blob:
        ap.error("--per-blob must be at least 1 and --chunks at least 2 x --per-blob")
    if args.chunks % (2 * args.per_blob) or not 0 <= args.shared <= args.per_blob:
        ap.error("--chunks must be a multiple of 2 x --per-blob, --shared at most --per-blob")
    out = args.out or RESULTS / ("gc.json" if args.size == "full" else "gc-quick.json")
    doc = session.run(args)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    for backend, r in doc["results"].items():
        m = r["median"]
        print(f"{backend}: gc {m['gc_seconds']:.2f} s vs bare list {m['bare_list_seconds']:.2f} s + delete "
              f"{m['bare_delete_seconds']:.2f} s: ratio {m['ratio']:.2f} (goal <= {session.GOAL}: "
              f"{'met' if m['goal_met'] else 'MISSED'})", file=sys.stderr)
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
