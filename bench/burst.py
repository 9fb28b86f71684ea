"""Cold-burst benchmark (DSec's experiment on one node): N sandboxes of several real environments start at
once on a cold node, with the store (real Ceph radosgw) behind one shaped link. Contenders: the
conventional path (tar.gz layers pulled and extracted, overlay, runc), layerstore lazy (with and without
prefetch hints) and layerstore --eager; containerd pulling from a registry behind the same link, through
`ctr` (containerd-overlayfs, containerd-layerstore) and through its CRI plugin as the kubelet would
(cri-overlayfs, cri-layerstore; with --pull-rounds N also PullImage alone, N cold rounds per image, into
bench/results/cri-pull-<size>.json). Needs root.

    python bench/burst.py [--size quick|full] [--sandboxes N] [--rate-mbit R] [--contenders a,b,...] [--pull-rounds N]
    python bench/burst.py --nodes size|N|NxM[,NxM...] [--size quick|full|tiny] [--per-node M] [--rate-mbit R[,R]]

With --nodes: the burst at cluster shape (N simulated nodes, each with its own network namespace, node
disk, memory cgroup and node daemon/shim or puller, one store behind one shared shaped link;
docs/burst-nodes.md). `--nodes size` runs the size's shapes (quick 4x4; full 16x4 and 8x16 at 1000
and 250 Mbit/s; tiny 2x2). Results: bench/results/burst_nodes-<size>.json.

Results: bench/results/burst-<size>.json, plots bench/results/burst-<size>-*.png, and the generated
section of docs/benchmarks-burst.md (with --nodes: docs/benchmarks-burst-nodes.md).
Downloads are cached under bench/.cache/ (git-ignore it).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SUPPORT = REPO / "tests" / "support"  # testkit (the Ceph cluster, the CRI client)
for _p in (SUPPORT, REPO):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), str(SUPPORT), os.environ.get("PYTHONPATH", "")) if p)

from bench.burst import nodereport, report, spec  # noqa: E402
from bench.burst.nodes import ClusterBench, NodeOptions  # noqa: E402
from bench.burst.orchestrate import Bench, Options, remeasure_readset  # noqa: E402


def parse_args(argv: list[str] | None = None) -> Options | NodeOptions:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(set(spec.SIZES) | set(spec.NODE_SIZES)),
                    default=os.environ.get("BENCH_SIZE", "quick"))
    ap.add_argument("--sandboxes", type=int, default=None, help="burst size (default: the size's)")
    ap.add_argument("--rate-mbit", default=None, help="link bandwidth (default 1000; with --nodes: R[,R...])")
    ap.add_argument("--nodes", default=None, metavar="SHAPES",
                    help="cluster shape: `size` (the size's shapes), N, NxM or a comma-separated list")
    ap.add_argument("--per-node", type=int, default=4, help="sandboxes per node when --nodes gives only N")
    ap.add_argument("--environments", default=None, help="comma-separated (default: the size's)")
    ap.add_argument("--contenders", default=None,
                    help="comma-separated subset of " + ",".join(spec.SIZES["full"].contenders))
    ap.add_argument("--rounds", type=int, default=None, help="rounds of every contender (default: the size's)")
    ap.add_argument("--pull-rounds", type=int, default=0, metavar="N",
                    help="after the bursts, time PullImage alone for the CRI contenders, N rounds per image")
    ap.add_argument("--pull-output", type=Path, default=None,
                    help="where the PullImage timing goes (default: cri-pull-<size>.json beside --output)")
    ap.add_argument("--no-readset", action="store_true", help="skip measuring the bytes the tasks read")
    ap.add_argument("--readset-only", type=Path, default=None, metavar="RESULTS",
                    help="only measure the bytes read again for an existing results file, and re-render")
    ap.add_argument("--output", type=Path, default=None)
    ap.add_argument("--docs", type=Path, default=None,
                    help="the page to update (default docs/benchmarks-burst.md;"
                    " with --nodes docs/benchmarks-burst-nodes.md)")
    ap.add_argument("--no-docs", action="store_true", help="do not update the benchmark's page")
    a = ap.parse_args(argv)
    if a.docs is None:
        a.docs = REPO / "docs" / ("benchmarks-burst-nodes.md" if a.nodes is not None else "benchmarks-burst.md")
    if a.nodes is not None:
        return parse_nodes(ap, a)
    if a.size not in spec.SIZES:
        ap.error(f"--size {a.size} is for --nodes only")
    size = spec.SIZES[a.size]
    envs = tuple(a.environments.split(",")) if a.environments else size.environments
    for e in envs:
        if e not in spec.ENVIRONMENTS and envs != (spec.TINY.name,):  # (tiny alone: smoke tests)
            ap.error(f"unknown environment {e!r} (known: {', '.join(spec.ENVIRONMENTS)}, or tiny alone)")
    contenders = tuple(a.contenders.split(",")) if a.contenders else size.contenders
    if a.readset_only is not None:
        a.output = a.readset_only
    try:
        rate = float(a.rate_mbit) if a.rate_mbit is not None else float(size.rate_mbit)
    except ValueError:
        ap.error(f"--rate-mbit: {a.rate_mbit!r} is not a number (Mbit/s)")
    if not 1 <= rate <= 100_000:
        ap.error(f"--rate-mbit: {rate:g}: the link must be 1-100000 Mbit/s")
    if (a.sandboxes is not None and a.sandboxes < 1) or (a.rounds is not None and a.rounds < 1):
        ap.error("--sandboxes and --rounds must be at least 1")
    if a.pull_rounds < 0:
        ap.error("--pull-rounds must be at least 0")
    output = a.output or REPO / "bench" / "results" / f"burst-{size.name}.json"
    opts = Options(size=size, sandboxes=a.sandboxes or size.sandboxes, rate_mbit=rate,
                   environments=envs, contenders=contenders,
                   output=output, readset=not a.no_readset, rounds=a.rounds or size.rounds,
                   docs=None if a.no_docs else a.docs, readset_only=a.readset_only is not None,
                   pull_rounds=a.pull_rounds,
                   pull_output=a.pull_output or output.parent / f"cri-pull-{size.name}.json")
    return opts


def parse_nodes(ap: argparse.ArgumentParser, a: argparse.Namespace) -> NodeOptions:
    try:
        rates = tuple(float(r) for r in a.rate_mbit.split(",")) if a.rate_mbit else None
        if a.nodes == "size":
            shapes = [s if rates is None else spec.Shape(s.nodes, s.per_node, r)
                      for s in spec.NODE_SIZES[a.size] for r in ((s.rate_mbit,) if rates is None else rates)]
            shapes = list(dict.fromkeys(shapes))
        else:
            shapes = spec.Shape.parse(a.nodes, a.per_node, rates or (1000.0,))
    except ValueError as e:
        ap.error(str(e))
    if any(not 1 <= s.rate_mbit <= 100_000 for s in shapes):
        ap.error("--rate-mbit: the link must be 1-100000 Mbit/s")
    if not shapes:
        ap.error("--nodes: no shape")
    if a.environments:
        envs = tuple(a.environments.split(","))
    elif a.size == "tiny":
        envs = (spec.TINY.name,)
    else:
        envs = spec.SIZES[a.size].environments
    for e in envs:
        if e != spec.TINY.name and e not in spec.ENVIRONMENTS:
            ap.error(f"unknown environment {e!r} (known: {', '.join(spec.ENVIRONMENTS)}, tiny)")
    contenders = tuple(a.contenders.split(",")) if a.contenders else spec.NODE_CONTENDERS
    for c in contenders:
        if c != "conventional" and c not in spec.LAYERSTORE_CONTENDERS:
            ap.error(f"--nodes runs conventional and {', '.join(spec.LAYERSTORE_CONTENDERS)}, not {c!r}")
    return NodeOptions(shapes=shapes, environments=envs, contenders=contenders, size=a.size,
                       output=a.output or REPO / "bench" / "results" / f"burst_nodes-{a.size}.json",
                       rounds=a.rounds or 1, docs=None if a.no_docs else a.docs)


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    if os.geteuid() != 0:
        print("burst: needs root (network namespaces, mounts, runc)", file=sys.stderr)
        return 2
    if isinstance(opts, NodeOptions):
        results = ClusterBench(opts).run()
        section = nodereport.render(opts.output, opts.docs)
        sys.stdout.write(section)
        # a sandbox that failed, or a contender that was asked for and could not run, fails the run
        failed = sum(c.get("failed", 0) + (1 if c.get("skipped") else 0) for sh in results.get("shapes", {}).values()
                     for c in sh.get("contenders", {}).values() if isinstance(c, dict))
        return 1 if failed else 0
    if opts.readset_only:
        results = remeasure_readset(opts.output)
        sys.stdout.write(report.render(opts.output, opts.docs, opts.output.parent))
        return 0
    results = Bench(opts).run()
    section = report.render(opts.output, opts.docs, opts.output.parent)
    sys.stdout.write(section)
    failed = sum(c.get("failed", 0) for c in results.get("contenders", {}).values() if isinstance(c, dict))
    failed += sum(int(c.get("failed") or 0) + (1 if c.get("skipped") else 0)  # a PullImage that failed
                  for c in (results.get("cri_pull") or {}).get("contenders", {}).values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
