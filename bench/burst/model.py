"""A model of a cold burst at cluster shape, fitted to `bench/burst.py --nodes` and used to predict DSec's
8,192-sandbox burst (160 nodes) for the conventional (eager pull + unpack) and the lazy path.

Pure logic: no I/O except `main`, which reads results files and prints a Markdown table.

Per node (sandboxes spread evenly, every node alike), s = sandboxes / nodes:

conventional
    fetch per node        B = U / r                      (the node's layers as tar.gz; U uncompressed)
    transfer              max(nodes * B / W, B / w)      (the store's shared bandwidth W, a node's NIC w)
    unpack                U / (x * j)                    (x bytes/s per unpack stream, j streams at once)
    all started           transfer + unpack + s * c / p  (c core-seconds per sandbox creation, p cores)
    all finished          all started + T                (T: the task)
    node disk writes      B + U + uppers

lazy
    metadata per node     M = m * U                      (superblocks, inodes, chunk maps before a mount)
    all started           t0 + max(nodes * M / W, M / w) + s * c / p   (t0: a cold mount's latency)
    fetch per node        F = k * a * U                  (a: access ratio; k: wire bytes per byte read)
    all finished          all started + max(l * T, max(nodes * F / W, F / w))   (l: the task's slowdown)
    node disk writes      z * F + uppers                 (z: bytes the cache writes per byte fetched)

`fit` takes the constants this machine measured (x, c, t0, l, k*a, z, the link's efficiency); the
DSec workload (`dsec_workload`) takes its volumes from DSec's own figures (1,600 GB of node disk
writes with eager pull, 700 GB lazy, over 160 nodes). What DSec does not report (its store bandwidth,
NIC, cores per node, task time) are inputs with stated defaults; `sensitivity` says how much each
moves the prediction.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

GB = 1e9


@dataclass(frozen=True)
class Workload:
    sandboxes: int
    nodes: int
    node_bytes: float  # U: uncompressed bytes of the distinct layers one node needs
    access_ratio: float  # a: the fraction of those bytes the sandboxes read
    task_s: float  # T: the task itself, on a node with its layers in place
    upper_bytes: float = 0.0  # per sandbox: the task's own writes (the same on both paths)

    @property
    def per_node(self) -> float:
        return self.sandboxes / self.nodes


@dataclass(frozen=True)
class Costs:
    store_Bps: float  # W: the store's bandwidth, shared by every node
    nic_Bps: float  # w: one node's link
    compression: float = 3.0  # r: uncompressed / tar.gz
    unpack_Bps: float = 100e6  # x: one unpack stream (gunzip + tar + file system), uncompressed bytes/s
    unpack_streams: float = 4.0  # j: layers unpacked at once on a node
    create_core_s: float = 0.05  # c: core-seconds to create and start one sandbox (mount, bundle, runtime)
    cores: float = 2.0  # p: cores per node
    cold_mount_s: float = 0.4  # t0: latency of a cold lazy mount (round trips), not bandwidth
    meta_fraction: float = 0.045  # m: metadata fetched before a lazy mount, per byte of layer
    wire_per_read: float = 1.0  # k: bytes on the wire per byte the tasks read (chunking, compression)
    lazy_task_factor: float = 1.1  # l: the task's time when its reads are lazy, against local files
    cache_write_per_fetched: float = 3.0  # z: node cache bytes written per byte fetched (3: decompressed)


@dataclass(frozen=True)
class Prediction:
    path: str
    all_started_s: float
    all_finished_s: float
    store_bytes: float
    node_fetch_bytes: float
    node_disk_write_bytes: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _transfer(nodes: int, per_node_bytes: float, c: Costs) -> float:
    return max(nodes * per_node_bytes / c.store_Bps, per_node_bytes / c.nic_Bps)


def predict(w: Workload, c: Costs) -> dict[str, Prediction]:
    if w.nodes < 1 or w.sandboxes < 1 or c.store_Bps <= 0 or c.nic_Bps <= 0:
        raise ValueError("nodes, sandboxes and bandwidths must be positive")
    s = w.per_node
    create = s * c.create_core_s / c.cores
    uppers = s * w.upper_bytes
    b = w.node_bytes / c.compression
    conv_started = _transfer(w.nodes, b, c) + w.node_bytes / (c.unpack_Bps * c.unpack_streams) + create
    conv = Prediction("conventional", conv_started, conv_started + w.task_s, w.nodes * b, b,
                      b + w.node_bytes + uppers)
    meta = c.meta_fraction * w.node_bytes
    fetch = c.wire_per_read * w.access_ratio * w.node_bytes
    lazy_started = c.cold_mount_s + _transfer(w.nodes, meta, c) + create
    lazy_finished = lazy_started + max(c.lazy_task_factor * w.task_s, _transfer(w.nodes, fetch, c))
    lazy = Prediction("lazy", lazy_started, lazy_finished, w.nodes * fetch, fetch,
                      c.cache_write_per_fetched * fetch + uppers)
    return {"conventional": conv, "lazy": lazy}


def speedups(p: dict[str, Prediction]) -> dict[str, float]:
    conv, lazy = p["conventional"], p["lazy"]
    return {"all_started": conv.all_started_s / lazy.all_started_s,
            "all_finished": conv.all_finished_s / lazy.all_finished_s,
            "store_bytes": lazy.store_bytes / conv.store_bytes,
            "node_disk_writes": lazy.node_disk_write_bytes / conv.node_disk_write_bytes}


# -- DSec ---------------------------------------------------------------------------------------
DSEC_SANDBOXES = 8192
DSEC_NODES = 160
DSEC_EAGER_WRITES = 1600 * GB  # node disk writes, all nodes, eager pull
DSEC_LAZY_WRITES = 700 * GB  # the same, lazy EROFS
DSEC_MINUTES = {"conventional": 60.0, "lazy": 35.0}
DSEC_ACCESS = (0.042, 0.133)


def dsec_volumes(access_ratio: float, compression: float = 3.0,
                 lazy_write_per_read: float = 1.0) -> tuple[float, float]:
    """(U per node, uppers per sandbox) from DSec's node disk writes: per node, eager writes
    U/r + U + uppers and lazy writes g*a*U + uppers (g: their cache's bytes per byte read; 1 for an
    uncompressed EROFS chunk cache). Two equations, two unknowns."""
    eager, lazy = DSEC_EAGER_WRITES / DSEC_NODES, DSEC_LAZY_WRITES / DSEC_NODES
    u = (eager - lazy) / (1 + 1 / compression - lazy_write_per_read * access_ratio)
    uppers_node = eager - u * (1 + 1 / compression)
    if u <= 0 or uppers_node < 0:
        raise ValueError("DSec's write figures do not fit these ratios")
    return u, uppers_node / (DSEC_SANDBOXES / DSEC_NODES)


def dsec_workload(access_ratio: float, task_s: float, compression: float = 3.0) -> Workload:
    u, upper = dsec_volumes(access_ratio, compression)
    return Workload(DSEC_SANDBOXES, DSEC_NODES, u, access_ratio, task_s, upper)


def calibrate_task(w: Workload, c: Costs, lazy_s: float) -> float:
    """The task time that makes the lazy path finish in `lazy_s` (DSec's 35 min): one unknown fitted
    to one observation, so that the conventional path's time is a prediction, not a fit."""
    base = predict(replace(w, task_s=0.0), c)["lazy"].all_started_s
    return max(0.0, (lazy_s - base) / c.lazy_task_factor)


def required_store_Bps(w: Workload, c: Costs, conv_s: float) -> float | None:
    """The store bandwidth at which the conventional path would take `conv_s` (DSec's 60 min), all
    else equal; None if even an idle link cannot make it that slow or fast."""
    lo, hi = 1e3, 1e13
    f = lambda bw: predict(w, replace(c, store_Bps=bw, nic_Bps=max(c.nic_Bps, bw)))["conventional"].all_finished_s  # noqa: E731
    if not f(hi) <= conv_s <= f(lo):
        return None
    for _ in range(200):
        mid = (lo * hi) ** 0.5
        if f(mid) > conv_s:
            lo = mid
        else:
            hi = mid
    return (lo * hi) ** 0.5


SENSITIVE = ("store_Bps", "nic_Bps", "compression", "unpack_Bps", "create_core_s", "cores", "cold_mount_s",
             "meta_fraction", "wire_per_read", "lazy_task_factor")


def sensitivity(w: Workload, c: Costs, metric: str = "all_finished", step: float = 0.1) -> dict[str, float]:
    """Elasticity of the lazy/conventional speed-up `metric` to each input: the relative change of the
    speed-up for a +`step` relative change of the input (0.5 means +10% input -> +5% speed-up)."""
    base = speedups(predict(w, c))[metric]
    out = {}
    for name in SENSITIVE:
        v = getattr(c, name)
        out[name] = (speedups(predict(w, replace(c, **{name: v * (1 + step)})))[metric] / base - 1) / step
    for name in ("node_bytes", "access_ratio", "task_s"):
        v = getattr(w, name)
        out[name] = (speedups(predict(replace(w, **{name: v * (1 + step)}), c))[metric] / base - 1) / step
    return out


# -- fitting to this machine's runs ----------------------------------------------------------------
def node_layer_bytes(results: dict[str, Any], shape: dict[str, Any]) -> list[float]:
    """U of every node of a shape: the uncompressed bytes of the distinct layers its sandboxes use
    (the plan is the benchmark's: round robin over the environments, sandbox j on node j % nodes)."""
    envs = list(results.get("environments", {}))
    layers = results.get("layers", {})
    n, m = int(shape["nodes"]), int(shape["per_node"])
    plan = [envs[i % len(envs)] for i in range(n * m)] if envs else []
    out = []
    for k in range(n):
        names = {name for e in plan[k::n] for name in results["environments"][e]}
        out.append(float(sum(layers.get(name, {}).get("content_bytes", 0) for name in names)))
    return out


def fit(results: dict[str, Any]) -> dict[str, Any]:
    """This machine's constants from one `burst_nodes` results dict (every shape with both paths).
    Returns the constants and the observations they came from."""
    layers = results.get("layers", {})
    content = {k: float(v.get("content_bytes", 0)) for k, v in layers.items()}
    gz = {k: float(v.get("tar_gz_bytes", 0)) for k, v in layers.items()}
    compression = sum(content.values()) / sum(gz.values()) if sum(gz.values()) else 3.0
    unpack, create, mount, slow, fetched_frac, z, eff = [], [], [], [], [], [], []
    cores = float(results.get("machine", {}).get("cpus") or 2)
    for sh in results.get("shapes", {}).values():
        cs = sh.get("contenders", {})
        conv, lazy = cs.get("conventional"), cs.get("lazy")
        if not conv or conv.get("skipped") or not lazy or lazy.get("skipped"):
            continue
        n_boxes = sh["nodes"] * sh["per_node"]
        dl_end = 0.0
        t0s = []
        for node in conv.get("per_node", []):
            for name, t in ((node.get("facts") or {}).get("layers") or {}).items():
                if t.get("extract_s") and content.get(name):
                    unpack.append(content[name] / t["extract_s"])
                dl_end = max(dl_end, t.get("download_s", 0.0))
                t0s.append(t)
        if dl_end and conv.get("bytes_fetched"):
            eff.append(conv["bytes_fetched"] * 8 / (sh["rate_mbit"] * 1e6) / dl_end)
        mount_s = (lazy.get("phases_median_s") or {}).get("mount_s")
        if lazy.get("all_started_s") and mount_s is not None:
            mount.append(mount_s)
            create.append(max(0.0, lazy["all_started_s"] - mount_s) * cores / n_boxes)
        cr = (conv.get("phases_median_s") or {}).get("run_s")
        lr = (lazy.get("phases_median_s") or {}).get("run_s")
        if cr and lr:
            slow.append(lr / cr)
        u_total = sum(node_layer_bytes(results, sh))
        if u_total and lazy.get("bytes_fetched"):
            fetched_frac.append(lazy["bytes_fetched"] / u_total)
        split = lazy.get("disk_split") or {}
        if split.get("layer_data") and lazy.get("bytes_fetched"):
            z.append(split["layer_data"] / lazy["bytes_fetched"])

    def med(v: list[float], default: float) -> float:
        return round(statistics.median(v), 4) if v else default

    return {
        "compression": round(compression, 3),
        "unpack_Bps": med(unpack, 100e6),
        "create_core_s": med(create, 0.05),
        "cold_mount_s": med(mount, 0.4),
        "lazy_task_factor": med(slow, 1.1),
        "fetched_fraction": med(fetched_frac, 0.12),
        "cache_write_per_fetched": med(z, 3.0),
        "link_efficiency": med(eff, 0.9),
        "observations": {"unpack_Bps": len(unpack), "create": len(create), "shapes": len(results.get("shapes", {}))},
    }


def costs_from_fit(f: dict[str, Any], *, store_Bps: float, nic_Bps: float, cores: float, access_ratio: float,
                   measured_access: float) -> Costs:
    """DSec-side costs: this machine's per-unit constants, the given bandwidths and cores. k (wire per
    byte read) is the measured fetched fraction over the measured access ratio."""
    return Costs(store_Bps=store_Bps, nic_Bps=nic_Bps, compression=f["compression"], unpack_Bps=f["unpack_Bps"],
                 create_core_s=f["create_core_s"], cores=cores, cold_mount_s=f["cold_mount_s"],
                 wire_per_read=f["fetched_fraction"] / measured_access, lazy_task_factor=f["lazy_task_factor"],
                 cache_write_per_fetched=f["cache_write_per_fetched"])


def check_against_run(results: dict[str, Any], f: dict[str, Any]) -> list[dict[str, Any]]:
    """The model, with the fitted constants and each shape's own volumes, against what each shape
    measured (a consistency check of the fit, not a prediction)."""
    out = []
    cores = float(results.get("machine", {}).get("cpus") or 2)
    for label, sh in results.get("shapes", {}).items():
        cs = sh.get("contenders", {})
        conv, lazy = cs.get("conventional"), cs.get("lazy")
        if not conv or conv.get("skipped") or not lazy or lazy.get("skipped"):
            continue
        us = node_layer_bytes(results, sh)
        if not any(us):
            continue
        u = statistics.mean(us)
        task = (conv.get("phases_median_s") or {}).get("run_s") or 0.0
        w = Workload(sh["nodes"] * sh["per_node"], sh["nodes"], u, f["fetched_fraction"], task)
        bw = sh["rate_mbit"] * 1e6 / 8 * f["link_efficiency"]
        # On one machine every node shares its cores: creation is the whole burst over the machine.
        c = Costs(store_Bps=bw, nic_Bps=bw, compression=f["compression"], unpack_Bps=f["unpack_Bps"],
                  unpack_streams=1.0, create_core_s=f["create_core_s"], cores=cores / sh["nodes"],
                  cold_mount_s=f["cold_mount_s"], wire_per_read=1.0, lazy_task_factor=f["lazy_task_factor"],
                  cache_write_per_fetched=f["cache_write_per_fetched"])
        p = predict(w, c)
        out.append({"shape": label, "predicted": {k: v.to_json() for k, v in p.items()},
                    "measured": {k: {"all_started_s": cs[k].get("all_started_s"),
                                     "all_finished_s": cs[k].get("all_finished_s"),
                                     "store_bytes": cs[k].get("bytes_fetched")} for k in ("conventional", "lazy")}})
    return out


def dsec_table(f: dict[str, Any], *, measured_access: float, store_Bps: float = 100 * GB,
               nic_Bps: float = 25e9 / 8, cores: float = 64.0,
               lazy_task_factor: float | None = None) -> list[dict[str, Any]]:
    """DSec's burst at both ends of its access-ratio range: T calibrated on the lazy 35 min, the
    conventional time predicted, and the store bandwidth that would make it DSec's 60 min.
    `lazy_task_factor` overrides the fitted slowdown of lazy tasks (1.0: a kernel read path)."""
    rows = []
    for a in DSEC_ACCESS:
        c = costs_from_fit(f, store_Bps=store_Bps, nic_Bps=nic_Bps, cores=cores, access_ratio=a,
                           measured_access=measured_access)
        if lazy_task_factor is not None:
            c = replace(c, lazy_task_factor=lazy_task_factor)
        w0 = dsec_workload(a, 0.0, c.compression)
        task = calibrate_task(w0, c, DSEC_MINUTES["lazy"] * 60)
        w = replace(w0, task_s=task)
        p = predict(w, c)
        need = required_store_Bps(w, c, DSEC_MINUTES["conventional"] * 60)
        rows.append({"access_ratio": a, "node_bytes": w.node_bytes, "upper_bytes": w.upper_bytes, "task_s": task,
                     "predicted": {k: v.to_json() for k, v in p.items()}, "speedups": speedups(p),
                     "store_Bps_for_60_min": need, "sensitivity_finished": sensitivity(w, c, "all_finished"),
                     "sensitivity_started": sensitivity(w, c, "all_started"),
                     "inputs": {"store_Bps": c.store_Bps, "nic_Bps": c.nic_Bps, "cores": c.cores,
                                "lazy_task_factor": c.lazy_task_factor, "wire_per_read": c.wire_per_read},
                     "no_task": {k: v.to_json() for k, v in predict(replace(w, task_s=0.0), c).items()}})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="fit the burst model to burst_nodes results and predict DSec")
    ap.add_argument("results", type=Path, nargs="+")
    ap.add_argument("--measured-access", type=float, default=0.119,
                    help="the access ratio of this benchmark's tasks (bench/burst.py's read set: 11.9%%)")
    a = ap.parse_args(argv)
    fits = [fit(json.loads(p.read_text())) for p in a.results]
    f = fits[0] if len(fits) == 1 else {k: statistics.median(x[k] for x in fits) for k in fits[0]
                                        if k != "observations"}
    variants = {"default": {}, "kernel read path (l = 1)": {"lazy_task_factor": 1.0},
                "store 10 GB/s": {"store_Bps": 10 * GB}, "store 1.25 GB/s (10 Gbit/s)": {"store_Bps": 1.25 * GB},
                "16 cores per node": {"cores": 16.0}}
    out = {"fit": f, "checks": [c for p in a.results for c in check_against_run(json.loads(p.read_text()), f)],
           "dsec": {name: dsec_table(f, measured_access=a.measured_access, **kw)  # type: ignore[arg-type]
                    for name, kw in variants.items()}}
    json.dump(out, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
