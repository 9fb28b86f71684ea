"""Cold-burst benchmark (DSec's experiment on one node): N sandboxes of several real environments start at
once on a cold node, with the store (real Ceph radosgw) behind one shaped link. Contenders: the
conventional path (tar.gz layers pulled and extracted, overlay, runc), layerstore lazy (with and without
prefetch hints) and layerstore --eager. Needs root.

    python bench/burst.py [--size quick|full] [--sandboxes N] [--rate-mbit R] [--contenders a,b,...]

Results: bench/results/burst-<size>.json, plots bench/results/burst-<size>-*.png, and the generated
section of docs/benchmarks.md. Downloads are cached under bench/.cache/ (git-ignore it).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)

from bench.burst import report, spec  # noqa: E402
from bench.burst.orchestrate import Bench, Options, remeasure_readset  # noqa: E402


def parse_args(argv: list[str] | None = None) -> Options:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(spec.SIZES), default=os.environ.get("BENCH_SIZE", "quick"))
    ap.add_argument("--sandboxes", type=int, default=None, help="burst size (default: the size's)")
    ap.add_argument("--rate-mbit", type=float, default=None, help="link bandwidth (default 1000)")
    ap.add_argument("--environments", default=None, help="comma-separated (default: the size's)")
    ap.add_argument("--contenders", default=None,
                    help="comma-separated subset of " + ",".join(spec.SIZES["full"].contenders))
    ap.add_argument("--rounds", type=int, default=None, help="rounds of every contender (default: the size's)")
    ap.add_argument("--no-readset", action="store_true", help="skip measuring the bytes the tasks read")
    ap.add_argument("--readset-only", type=Path, default=None, metavar="RESULTS",
                    help="only measure the bytes read again for an existing results file, and re-render")
    ap.add_argument("--output", type=Path, default=None)
    ap.add_argument("--docs", type=Path, default=REPO / "docs" / "benchmarks.md")
    ap.add_argument("--no-docs", action="store_true", help="do not update docs/benchmarks.md")
    a = ap.parse_args(argv)
    size = spec.SIZES[a.size]
    envs = tuple(a.environments.split(",")) if a.environments else size.environments
    for e in envs:
        if e not in spec.ENVIRONMENTS:
            ap.error(f"unknown environment {e!r} (known: {', '.join(spec.ENVIRONMENTS)})")
    contenders = tuple(a.contenders.split(",")) if a.contenders else size.contenders
    if a.readset_only is not None:
        a.output = a.readset_only
    opts = Options(size=size, sandboxes=a.sandboxes or size.sandboxes, rate_mbit=a.rate_mbit or size.rate_mbit,
                   environments=envs, contenders=contenders,
                   output=a.output or REPO / "bench" / "results" / f"burst-{size.name}.json",
                   readset=not a.no_readset, rounds=a.rounds or size.rounds, docs=None if a.no_docs else a.docs,
                   readset_only=a.readset_only is not None)
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    if os.geteuid() != 0:
        print("burst: needs root (network namespaces, mounts, runc)", file=sys.stderr)
        return 2
    if opts.readset_only:
        results = remeasure_readset(opts.output)
        sys.stdout.write(report.render(opts.output, opts.docs, opts.output.parent))
        return 0
    results = Bench(opts).run()
    section = report.render(opts.output, opts.docs, opts.output.parent)
    sys.stdout.write(section)
    failed = sum(c.get("failed", 0) for c in results.get("contenders", {}).values() if isinstance(c, dict))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
