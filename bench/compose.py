"""Warm sandbox composition on one node: sandboxes per second, latency from request to a usable root
filesystem, and memory per mounted sandbox, at 1,000 and at 10,000 concurrently mounted sandboxes of
one environment, against a plain overlay of directories as the baseline, in the same run.

The environment has three layers, built with `layerctl build --push` into a local store and named
with `layerctl env create`: a busybox base, a toolkit (/opt/toolkit) and a workspace (/workspace).
"Warm" = the node daemon runs and the layers are mounted (one anchor sandbox holds them for the whole
run); each request composes a new sandbox. "Usable" = one file of each layer has been read through
the sandbox's overlay. Contenders:

* plain-overlay: what any runtime does at the least: mkdir the sandbox's upper, work and root, one
  overlay mount(2) of the three layer directories, no bookkeeping;
* layerstore-api: `Shim.mount("compose:1")` in a long-lived process (tag resolution, node lock, state
  transactions, record file, shared EROFS layers) — what a node agent calls;
* durability A/B: the shim API with and without an fsync per state transaction (the durability the
  shim used before), in alternating blocks of 100 sandboxes in one process, so that both variants
  see the same disk and the same load from elsewhere;
* layerstore-cli: `layerctl mount` / `layerctl umount` as processes, a smaller sample at the start and
  at 10,000 mounted (Python start-up, imports, a store client, the start-up recovery check per call).

Each runs with 1 client and with N concurrent client processes (each its own shim, like separate
`mount.layerstore` invocations or agent workers); CPU time per mount is measured in each client
(user + system), which the load from other work on a shared machine does not inflate the way it
inflates wall-clock rates. Memory per sandbox = the growth of the kernel memory charged to the run's
own memory cgroup (slab: mounts, overlay and ext4 inodes, dentries; a child of the cgroup the
script starts in, so nothing else on the machine counts), with the machine-wide /proc/meminfo Slab
and /proc/slabinfo deltas beside it (noisy on a shared machine), plus the shim's own state (LMDB
pages in use, the record file) and the processes' RSS.

The run happens in a private mount namespace of its own (the script re-executes itself under
`unshare --mount`): 10,000 overlays would otherwise sit in the host's mount table, where every reader
of /proc/self/mountinfo on the machine (other tests, daemons, tools) would parse them, and a killed run
would leave them behind. The outer process checks afterwards that nothing is left: no mount, no loop
device, no process, no namespace, no directory.

    python bench/compose.py [--size quick|full] [--scales 1000,10000] [--clients 1,4] [--out FILE]

`--size` defaults to $BENCH_SIZE (as `make bench` sets it), else quick: 1,000 and 3,000, 1 client,
5 CLI calls per point, 2 A/B blocks, one round (~1 minute; at 10,000 it took ~5 minutes, most of it
the unmounts, which slow down with every mount in the table: see docs/benchmarks-compose.md);
full: 1 and 4 clients, two rounds, 50 CLI calls per point, 20 A/B blocks (medians of the rounds are reported, and
each round's headline figures with the machine's load while it ran); mounted30k: 10,000 and 30,000, 1 client,
no fsync A/B (~10-15 minutes here). `--mounted 10000,30000` (= `--scales`) sets the scales of any size. Every
run reports the shim's mount rate over the plain overlay's at each scale, in the same run and round (`ratios`);
full and mounted30k also alternate the two in blocks of 200 mounts in one process while the largest scale of
the shim's sandboxes is mounted (`vs_plain_ab`: both see the same minutes of the shared machine's load).
Needs root, mkfs.erofs and busybox-static. The code is in bench/composebench/ (one module per concern).

The node's disk (`--disk`, recorded as `node_disk`): by default everything the run writes (trees, store,
node, the plain overlay's directories) goes on a fresh ext4 with a journal on a loop device (a sparse
32 GiB image in the work directory, mounted at WORK/disk), as on a real node. On an ext4 without a
journal (this machine's root file system) the inode allocator skips every inode deleted in the last
minute, so after one contender's mass teardown the next one's mkdirs cost 4-20x more system time,
varying with what ran before: the rounds swung 0.35x-1.68x. `--disk workdir` keeps the old behaviour
(the work directory's own file system).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.composebench import spec  # noqa: E402
from bench.composebench.isolation import is_inner, outer  # noqa: E402
from bench.composebench.session import inner  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(spec.SIZES), default=os.environ.get("BENCH_SIZE", "quick"))
    ap.add_argument("--scales", "--mounted", dest="scales",
                    help="comma-separated numbers of mounted sandboxes (ascending), e.g. 10000,30000")
    ap.add_argument("--clients", help="comma-separated client counts")
    ap.add_argument("--cli", type=int, help="layerctl calls per CLI point (0: none)")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--ab-blocks", type=int, help=f"blocks of {spec.AB_BLOCK} sandboxes for the fsync A/B (0: none)")
    ap.add_argument("--vs-plain-blocks", type=int, help=f"blocks of {spec.VS_PLAIN_BLOCK} sandboxes per contender "
                    "for the interleaved shim / plain overlay A/B at the largest scale (0: none)")
    ap.add_argument("--out", type=Path, default=spec.DEFAULT_OUT)
    ap.add_argument("--workdir", default="/var/tmp", help="where the run's work directory is made (with --disk "
                    "loop: the node disk's image and mount point; with --disk workdir: the store, node and trees)")
    ap.add_argument("--disk", choices=("loop", "workdir"), default="loop",
                    help="the node's disk: a fresh journaled ext4 on a loop device (default), or the work "
                    "directory's own file system")
    ap.add_argument("--inner-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    size = spec.SIZES[args.size]
    try:
        args.scales = [int(x) for x in args.scales.split(",")] if args.scales else size["scales"]
        args.clients = [int(x) for x in args.clients.split(",")] if args.clients else size["clients"]
    except ValueError:
        ap.error("--scales and --clients take comma-separated whole numbers")
    if not args.scales or min(args.scales) < 1 or args.scales != sorted(set(args.scales)):
        ap.error("--scales: ascending numbers of mounted sandboxes, each at least 1")
    if not args.clients or min(args.clients) < 1:
        ap.error("--clients: each at least 1")
    args.cli = size["cli"] if args.cli is None else args.cli
    args.rounds = size["rounds"] if args.rounds is None else args.rounds
    args.ab_blocks = size["ab_blocks"] if args.ab_blocks is None else args.ab_blocks
    args.vs_plain_blocks = size["vs_plain_blocks"] if args.vs_plain_blocks is None else args.vs_plain_blocks
    if args.rounds < 1 or min(args.cli, args.ab_blocks, args.vs_plain_blocks) < 0:
        ap.error("--rounds must be at least 1; --cli, --ab-blocks and --vs-plain-blocks at least 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("compose: needs root (mounts)")
    if is_inner():
        return inner(args)
    # The run re-executes this script inside a private mount namespace, with the same arguments.
    return outer(Path(__file__).resolve(), list(argv if argv is not None else sys.argv[1:]), args.out)


if __name__ == "__main__":
    sys.exit(main())
