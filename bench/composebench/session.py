"""The run itself, inside its private mount namespace (started by `isolation`): its node disk made
(`disk`: a fresh journaled ext4 on a loop device unless `--disk workdir`), the environment built,
an anchor sandbox holding the layers mounted (warm), every contender at every scale in rounds, the
durability A/B, the CLI at one mounted sandbox, then everything torn down and checked."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shutil
import signal
import tempfile
from pathlib import Path
from typing import Any

from . import project, report
from .disk import LoopDisk, describe_workdir, unmount_all
from .inputs import make_environment, make_trees
from .probes import cli_round, limits, machine, usable
from .spec import AB_BLOCK, CGROUP_ENV, CONTENDERS, ENV_TAG, GOALS, PROBES, log
from .workloads import durability_ab, run_contender


def inner(args: argparse.Namespace) -> int:
    linux = project.linux()
    shim_cls = project.shim_class()

    cg = os.environ.get(CGROUP_ENV)
    if cg:  # everything started from here on (clients, the node daemon, layerctl) is charged to it
        Path(cg, "cgroup.procs").write_text(str(os.getpid()))

    lim = limits()
    need = max(args.scales) * 2 + 100
    if lim["fs.mount-max"] is not None and int(lim["fs.mount-max"]) < need:
        raise SystemExit(f"compose: fs.mount-max is {lim['fs.mount-max']}; {need} needed "
                         f"(sysctl -w fs.mount-max={need * 2})")
    when = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    doc: dict[str, Any] = {"benchmark": "compose", "when": when,
                           "machine": machine(), "limits": lim, "goals": GOALS,
                           "mount_namespace": os.readlink("/proc/self/ns/mnt")}
    anchor: Any = None
    shim: Any = None
    disk: LoopDisk | None = None
    # Ctrl-C and SIGTERM both tear the run down (the finally below) instead of leaving its node disk
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupted)
    work = Path(tempfile.mkdtemp(prefix="layerstore-compose-", dir=args.workdir))
    doc["workdir"] = str(work)
    # what the outer process needs to check and clean up after a run that ends without its document
    Path(args.inner_out).write_text(json.dumps({"workdir": str(work), "mount_namespace": doc["mount_namespace"]}))
    try:
        if args.disk == "loop":  # everything the run writes goes on a fresh journaled ext4 (see disk.py)
            disk = LoopDisk(work, max(args.scales))
            disk.make()
            run = disk.mountpoint
            doc["node_disk"] = disk.describe()
        else:
            run = work
            doc["node_disk"] = describe_workdir(work)
        log(f"building the environment in {run}; node disk: {json.dumps(doc['node_disk'])}")
        trees = make_trees(run)
        store, blobs = make_environment(run, trees)
        (run / "plain-roots").mkdir()
        linux.bind_private(run / "plain-roots")
        node = run / "node"
        cfg = {"work": str(run), "node": str(node), "store": store, "trees": {k: str(v) for k, v in trees.items()}}
        shim = shim_cls.for_node(node, store)
        # starts the daemon, mounts the layers: warm
        anchor = shim.mount(project.mount_request_class()(ENV_TAG, sandbox="anchor"))
        usable(anchor.target)
        doc["environment"] = {"tag": ENV_TAG, "layers": blobs, "probes": list(PROBES)}
        contenders = [(kind, c) for kind in CONTENDERS for c in args.clients]
        rounds: dict[str, list[dict[str, Any]]] = {}
        for rnd in range(args.rounds):
            # Rounds go over every contender before the next starts: load from elsewhere on a shared
            # machine spreads over all of them instead of hitting one. Every other round goes in the
            # reverse order: the contender after another's mass teardown starts on a node disk
            # still busy with it (see `settle`), and each should get that place as often.
            for kind, clients in (contenders if rnd % 2 == 0 else contenders[::-1]):
                cli = args.cli if clients == 1 and rnd == 0 else 0
                log(f"round {rnd + 1}: {kind}, {clients} client(s)")
                vs = args.vs_plain_blocks if kind == "layerstore-api" and clients == 1 else 0
                res = run_contender(kind, cfg, args.scales, clients, rnd, cli, vs)
                rounds.setdefault(f"{kind}/clients={clients}", []).append(res)
        if args.ab_blocks:
            log(f"durability A/B: {args.ab_blocks} blocks of {AB_BLOCK}")
            doc["durability_ab"] = durability_ab(cfg, args.ab_blocks)
        if args.cli:
            doc["cli_at_1_mounted"] = cli_round(cfg, args.cli, "start")
        doc["results"] = {k: report.median_results(v) for k, v in rounds.items()}
        doc["rounds"] = args.rounds
        if args.rounds > 1:
            doc["per_round"] = report.per_round(rounds)
        doc["ratios"] = report.ratios(doc)
        shim.unmount(anchor.id)
        anchor = None
        shim.stop_daemon()
        shim.close()
        shim = None
        left = linux.mounts_under(linux.read_mounts(), str(work))
        doc["inner_check"] = {"mounts_left": [m.mountpoint for m in left]}
    finally:
        # The teardown runs to its end: a second Ctrl-C (or a SIGTERM) would leave the node disk behind.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        with contextlib.suppress(Exception):
            if shim is not None:
                for sb in shim.sandboxes():
                    with contextlib.suppress(Exception):
                        shim.unmount(sb.id)
                shim.stop_daemon()
                shim.close()
        # the daemon stopped first; then the mounts on the node disk, the disk, its loop device
        unmount_all(work, disk)
        shutil.rmtree(work, ignore_errors=True)
    doc["machine"]["loadavg_at_end"] = os.getloadavg()
    Path(args.inner_out).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


def _interrupted(signum: int, frame: Any) -> None:
    """The first SIGINT or SIGTERM interrupts the run; any later one is ignored, so that the teardown
    runs to its end (a second one in it would leave the node disk behind)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    raise KeyboardInterrupt(f"signal {signum}")
