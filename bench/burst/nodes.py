"""The burst at cluster shape (issue 19): N simulated nodes on this machine, one store, one shaped link.

Each node has its own network namespace (`cluster.ClusterLink`), its own node disk (a loop device with
its own ext4, `nodedisk.NodeDisk`), its own memory cgroup, and its own runner (`runner.py`: the node
daemon and the shim, or the conventional puller and content store, and runc), started with
`nsenter --net` into the node's namespace. All nodes get GO at the same moment; all-started and
all-finished are taken over every sandbox of every node. The store (the real single-node Ceph,
radosgw) runs in the link namespace and is set up once for every shape and contender of the run.

State, data flow and what happens when a process dies: docs/burst-nodes.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import cgroups, inputs, metrics, spec
from .cephstore import StoreProcess
from .cluster import ClusterLink
from .nodedisk import NodeDisk
from .orchestrate import REPO, Bench, Options, cpu_seconds, delta, sandbox_cgroups, stop_runner

NODE_DISK_GIB = 8
NODE_DISK_INODES = 400_000
READY_TIMEOUT_S = 300.0
BURST_TIMEOUT_S = 1800.0

# Issue 19's goals at cluster shape (lazy against the conventional path, same run).
GOALS = {
    "all_started_speedup_min": 10.0,
    "all_finished_speedup_min": 2.0,
    "disk_write_ratio_no_uppers_max": 0.10,
    "store_bytes_ratio_max": 0.40,
}


@dataclass
class NodeOptions:
    shapes: list[spec.Shape]
    environments: tuple[str, ...]
    contenders: tuple[str, ...]
    output: Path
    size: str = "quick"
    rounds: int = 1
    docs: Path | None = None

    @property
    def disk(self) -> tuple[int, int]:
        """(GiB, inodes) of each node disk: mkfs writes every inode table up front (nothing left for
        a background thread during a burst), so the tiny size gets a small one."""
        return (1, 50_000) if self.size == "tiny" else (NODE_DISK_GIB, NODE_DISK_INODES)


class ClusterMemory:
    """Samples every node's cgroup (node side + its live sandboxes) together: the peak of the sum
    (what the cluster holds at its busiest) and each node's own peak."""

    def __init__(self, groups: list[cgroups.MemoryCgroup]) -> None:
        self.groups = groups
        self.peak_total = 0
        self.peak_total_anon = 0
        self.peak_node = [0] * len(groups)
        self.peak_node_anon = [0] * len(groups)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample_once(self) -> None:
        total = anon_total = 0
        for i, g in enumerate(self.groups):
            with contextlib.suppress(OSError, ValueError):
                u, a = g.sample()
                total += u
                anon_total += a
                self.peak_node[i] = max(self.peak_node[i], u)
                self.peak_node_anon[i] = max(self.peak_node_anon[i], a)
        self.peak_total = max(self.peak_total, total)
        self.peak_total_anon = max(self.peak_total_anon, anon_total)

    def start(self, interval: float = 0.2) -> None:
        def loop() -> None:
            while not self._stop.wait(interval):
                self.sample_once()

        self._thread = threading.Thread(target=loop, daemon=True, name="cluster-mem")
        self._thread.start()

    def stop(self) -> None:
        """Stop sampling: one last sample, and each node's peak at least its own cgroup's kernel
        peak (a burst shorter than the interval would otherwise go unseen)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample_once()
        for i, g in enumerate(self.groups):
            self.peak_node[i] = max(self.peak_node[i], g.kernel_peak() or 0)


def _readline(proc: subprocess.Popen[str], timeout: float) -> str:
    """One line from the runner, or "" on EOF or after `timeout` seconds."""
    assert proc.stdout is not None
    end = time.monotonic() + timeout
    while True:
        left = end - time.monotonic()
        if left <= 0:
            return ""
        r, _, _ = select.select([proc.stdout], [], [], min(left, 1.0))
        if r:
            return proc.stdout.readline()
        if proc.poll() is not None:
            return proc.stdout.readline()


class ClusterBench(Bench):
    """The one-node benchmark's set-up (inputs, store, pushes, contenders) with N nodes per burst."""

    def __init__(self, nopts: NodeOptions) -> None:
        size = spec.SIZES.get(nopts.size, spec.SIZES["quick"])
        opts = Options(size=size, sandboxes=0, rate_mbit=nopts.shapes[0].rate_mbit,
                       environments=nopts.environments, contenders=nopts.contenders, output=nopts.output,
                       readset=False, rounds=nopts.rounds, docs=nopts.docs)
        super().__init__(opts)
        self.nopts = nopts
        self.clink: ClusterLink | None = None
        self.node_disks: list[NodeDisk] = []
        self.uppers_disks: list[NodeDisk] = []  # each node's uppers disk, at NODE/sandboxes during a burst

    # -- the whole run -------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        o, no = self.opts, self.nopts
        try:
            t = time.monotonic()
            inputs.ensure_debs(["runc", "iproute2", "e2fsprogs", "mount", "util-linux"])
            self.layers = inputs.build_all(o.environments)
            self.results = self._header()
            self.results.update(benchmark="burst-nodes", size=no.size, sandboxes=None, rate_mbit=None,
                                shapes={}, load_at_start=_uptime(), notes=o.notes)  # kept if interrupted
            self.results["timings"] = {"inputs_s": round(time.monotonic() - t, 1)}
            self._up()
            self._setup_contenders()
            runnable = []
            skipped = {}
            for name in o.contenders:
                skip = self._skip_reason(name)
                if not skip and name in spec.CONTAINERD_CONTENDERS:
                    skip = "not run at cluster shape yet (one registry per node is not wired)"
                if skip:
                    inputs.log(f"{name}: skipped ({skip})")
                    skipped[name] = {"skipped": skip}
                else:
                    runnable.append(name)
            for shape in no.shapes:
                self._run_shape(shape, runnable, skipped)
            self.results["notes"] = o.notes
            self.results["load_at_end"] = _uptime()
            self._write()
            return self.results
        finally:
            self.cleanup.run()

    def _run_shape(self, shape: spec.Shape, runnable: list[str], skipped: dict[str, Any]) -> None:
        assert self.clink is not None
        o = self.opts
        inputs.log(f"shape {shape.label}: {shape.nodes} nodes x {shape.per_node} sandboxes, "
                   f"link {shape.rate_mbit:g} Mbit/s")
        self.clink.set_rate(shape.rate_mbit)
        self._nodes_up(shape.nodes)
        plan = spec.Plan.round_robin(o.environments, shape.nodes * shape.per_node).spread(shape.nodes)
        res: dict[str, Any] = {"nodes": shape.nodes, "per_node": shape.per_node, "rate_mbit": shape.rate_mbit,
                               "sandboxes": shape.nodes * shape.per_node, "load_before": _uptime(),
                               "contenders": dict(skipped)}
        self.results["shapes"][shape.label] = res
        rounds: dict[str, list[dict[str, Any]]] = {n: [] for n in runnable}
        for r in range(o.rounds):
            k = r % len(runnable) if runnable else 0
            for name in runnable[k:] + runnable[:k]:
                inputs.log(f"{shape.label} round {r + 1}/{o.rounds}: {name}")
                try:
                    rounds[name].append(self._run_nodes(name, plan))
                except Exception as e:  # noqa: BLE001 - one contender's failure must not sink the others
                    inputs.log(f"{shape.label} {name} failed: {e}")
                    o.notes.append(f"{shape.label} {name}, round {r + 1}: the run failed: {e}")
                    if not rounds[name]:
                        res["contenders"][name] = {"skipped": f"the run failed: {e}"}
                    continue
                res["contenders"][name] = metrics.combine(rounds[name])
                self._write()
        res["load_after"] = _uptime()
        add_cluster_ratios(res)
        self._write()
        self._nodes_down()

    # -- link, store, disks --------------------------------------------------------------------
    def _up(self) -> None:
        self._open_run()
        self.clink = ClusterLink(self.run_dir.parent, rate_mbit=self.opts.rate_mbit)
        self.clink.setup()
        self.link = self.clink  # type: ignore[assignment] - the set-up code needs ns_argv/store_addr/counters
        self.cleanup.push("link", self.clink.teardown)
        self.store = StoreProcess(self.clink, self.run_dir / "ceph")  # type: ignore[arg-type]
        t = time.monotonic()
        self.store.start()
        self.cleanup.push("store", self.store.stop)
        self.results["timings"]["store_start_s"] = round(time.monotonic() - t, 1)
        os.environ.update(self.store.s3_env())
        # the host's own disk: profiling runs for prefetch hints (set-up, not measured)
        gib, inodes = self.nopts.disk
        self.disk = NodeDisk(self.run_dir / "hostdisk.img", self.run_dir / "host", size_gib=gib, inodes=inodes)
        self.disk.attach()
        self.cleanup.push("node disk", self.disk.detach)

    def _nodes_up(self, n: int) -> None:
        assert self.clink is not None
        self._nodes_down()
        self.clink.set_nodes(n)
        for i in range(n):
            gib, inodes = self.nopts.disk
            d = NodeDisk(self.run_dir / f"node{i}.img", self.run_dir / f"node{i}", size_gib=gib, inodes=inodes)
            d.attach()
            self.node_disks.append(d)
            u = NodeDisk(self.run_dir / f"uppers{i}.img", self.run_dir / f"uppers{i}", size_gib=gib, inodes=inodes)
            u.attach()
            self.uppers_disks.append(u)
        self.cleanup.push("node disks", self._nodes_down)

    def _nodes_down(self) -> None:
        from .lazy import sweep_mounts

        disks, self.node_disks = self.node_disks, []
        uppers, self.uppers_disks = self.uppers_disks, []
        if self.clink is not None:
            self.clink.set_nodes(0)  # nothing of a node outlives its namespace (ours by construction)
        for u in uppers:  # (each sits in its node's disk)
            u.detach()
        for d in disks:
            with contextlib.suppress(Exception):
                sweep_mounts(d.mountpoint)
            d.detach()

    # -- one contender on every node at once ------------------------------------------------
    def _run_nodes(self, name: str, plan: list[list[str]]) -> dict[str, Any]:
        from .lazy import sweep_mounts

        assert self.clink is not None and self.store is not None
        n = len(plan)
        groups: list[cgroups.MemoryCgroup] = []
        procs: list[subprocess.Popen[str]] = []
        outs: list[Path] = []
        cg_root = f"lsburst-{os.getpid()}"
        t_setup = time.monotonic()
        try:
            for i in range(n):
                disk = self.node_disks[i]
                self.uppers_disks[i].unmount()
                sweep_mounts(disk.mountpoint)
                disk.fresh()
                node = disk.mountpoint / name
                node.mkdir()
                self.uppers_disks[i].fresh_at(node / "sandboxes")  # the sandboxes' directories, apart
                cg = cgroups.MemoryCgroup(f"{cg_root}/{name}-n{i}")
                cg.create()
                groups.append(cg)
                out_file = self.run_dir / f"result-{name}-n{i}.json"
                with contextlib.suppress(FileNotFoundError):
                    out_file.unlink()
                outs.append(out_file)
                p: dict[str, Any] = {
                    "contender": name, "cgroup": f"{cg_root}/{name}-n{i}", "node_dir": str(node),
                    "sandboxes": plan[i], "output": str(out_file), "endpoint": self.store.endpoint,
                    "bucket": "burst", "runc_root": str(node / "runc"), "store_url": self.store_url(),
                    "layerctl": str(Path(sys.executable).parent / "layerctl"),
                }
                if self.lazy is not None:
                    p["env_refs"] = self.lazy.hinted_refs if name == "lazy-prefetch" else self.lazy.env_refs
                plan_file = self.run_dir / f"plan-{name}-n{i}.json"
                plan_file.write_text(json.dumps(p))
                proc = subprocess.Popen(
                    self.clink.node_argv(i, [sys.executable, "-m", "bench.burst.runner", str(plan_file)]),
                    cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                    env={**os.environ, "PYTHONPATH": str(REPO)})
                procs.append(proc)
                cg.sandbox_glob = sandbox_cgroups(name, proc.pid)
            for i, proc in enumerate(procs):
                if _readline(proc, READY_TIMEOUT_S).strip() != "READY":
                    raise RuntimeError(f"{name}: the runner of node {i} did not start")
            inputs.log(f"{name}: {n} nodes ready in {time.monotonic() - t_setup:.1f} s")
            ports0, q0 = self.clink.port_stats(), self.clink.qdisc_stats()
            disk0 = [d.counters() for d in self.node_disks[:n]]
            up0 = [d.counters() for d in self.uppers_disks[:n]]
            cpu0, load0 = cpu_seconds(), os.getloadavg()[0]
            mem = ClusterMemory(groups)
            mem.start()
            t0 = time.time()
            for proc in procs:
                assert proc.stdin is not None
                proc.stdin.write("GO\n")
                proc.stdin.flush()
            done = [_readline(proc, BURST_TIMEOUT_S).strip().startswith("DONE") for proc in procs]
            mem.stop()
            ports1, q1 = self.clink.port_stats(), self.clink.qdisc_stats()
            disk1 = [d.counters() for d in self.node_disks[:n]]
            up1 = [d.counters() for d in self.uppers_disks[:n]]
            cpu1 = cpu_seconds()
            used = [d.used_bytes() for d in self.node_disks[:n]]
            kpeak = [g.kernel_peak() for g in groups]
            load1 = os.getloadavg()[0]
            t_down = time.monotonic()
            inputs.log(f"{name}: burst done in {time.time() - t0:.1f} s")
            for proc in procs:
                with contextlib.suppress(BrokenPipeError, OSError):
                    assert proc.stdin is not None
                    proc.stdin.write("TEARDOWN\n")
                    proc.stdin.flush()
            for proc in procs:
                stop_runner(proc)  # they tear down in parallel; each wait is for the slowest
        finally:
            stop_all(procs)
            for g in groups:
                g.remove()
            for u in self.uppers_disks:
                u.unmount()
        inputs.log(f"{name}: nodes torn down in {time.monotonic() - t_down:.1f} s")
        raws = []
        for i in range(n):
            if done[i] and outs[i].exists():
                raws.append(json.loads(outs[i].read_text()))
            else:
                raws.append({"t0": t0, "sandboxes": [
                    {"index": j, "env": env, "launched": t0, "started": None, "finished": None, "rc": None,
                     "error": f"node {i}: the runner did not finish"} for j, env in enumerate(plan[i])],
                    "facts": {}})
        assert self.clink is not None
        per_node = []
        for i in range(n):
            peer = self.clink.nodes[i].peer
            fetched = ports1.get(peer, (0, 0))[1] - ports0.get(peer, (0, 0))[1]
            sent = ports1.get(peer, (0, 0))[0] - ports0.get(peer, (0, 0))[0]
            s = metrics.summarize(dict(raws[i], t0=t0), {})
            per_node.append({
                "node": i, "sandboxes": len(plan[i]), "envs": sorted(set(plan[i])),
                "layer_bytes": sum(self.layers[x].facts.get("content_bytes", 0)
                                   for x in {x for e in plan[i] for x in inputs.env_layers(e)}),
                "failed": s["failed"], "all_started_s": s["all_started_s"],
                "all_finished_s": s["all_finished_s"], "fetched_bytes": fetched, "sent_bytes": sent,
                "disk_write_bytes": disk1[i].minus(disk0[i]).write_bytes, "disk_used_bytes": used[i],
                "uppers_disk_write_bytes": up1[i].minus(up0[i]).write_bytes,
                "mem_peak_bytes": mem.peak_node[i], "mem_peak_anon_bytes": mem.peak_node_anon[i],
                "mem_peak_node_side_bytes": kpeak[i], "facts": raws[i].get("facts", {}),
                "phases_median_s": s.get("phases_median_s", {}),
            })
        boxes = [dict(b, node=i) for i, raw in enumerate(raws) for b in raw["sandboxes"]]
        bridge = "lsbr0"
        measured = {
            "link_rx_bytes": sum(x["fetched_bytes"] for x in per_node),
            "link_tx_bytes": sum(x["sent_bytes"] for x in per_node),
            "store_bridge_tx_bytes": ports1.get(bridge, (0, 0))[1] - ports0.get(bridge, (0, 0))[1],
            "qdisc_bytes": delta(q1.get("bytes"), q0.get("bytes")),
            "qdisc_drops": delta(q1.get("drops"), q0.get("drops")),
            "disk_write_bytes": sum(x["disk_write_bytes"] for x in per_node),
            "uppers_disk_write_bytes": sum(x["uppers_disk_write_bytes"] for x in per_node),
            "disk_used_bytes": sum(used),
            "mem_peak_bytes": mem.peak_total,
            "mem_peak_anon_bytes": mem.peak_total_anon,
            "mem_peak_node_max_bytes": max(mem.peak_node) if n else 0,
            "machine_cpu_busy_s": round(cpu1[0] - cpu0[0], 2),
            "machine_cpu_iowait_s": round(cpu1[1] - cpu0[1], 2),
            "loadavg_before": round(load0, 2),
            "loadavg_after": round(load1, 2),
        }
        out = metrics.summarize({"t0": t0, "sandboxes": boxes, "facts": {}}, measured)
        out.pop("facts", None)
        out["per_node"] = per_node
        out["disk_split"] = disk_split(per_node, name)
        return out


def stop_all(procs: list[subprocess.Popen[str]], grace: float = 60.0) -> None:
    """Stop every runner at once (an interrupted burst: they may be mid-burst, not reading stdin):
    SIGTERM to all (each tears down what it started), one shared grace period, then SIGKILL; what
    is left in a node's namespace goes with the namespace."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        with contextlib.suppress(OSError):
            assert p.stdin is not None
            p.stdin.close()
        with contextlib.suppress(ProcessLookupError):
            p.terminate()
    end = time.monotonic() + grace
    for p in live:
        try:
            p.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def disk_split(per_node: list[dict[str, Any]], contender: str) -> dict[str, int]:
    """Node disk writes summed over the nodes, split as the one-node report splits them: layer data
    (node cache / tar.gz + extracted), cache index, uppers, runc + shim state, the rest (journal,
    metadata, rewrites), and what the daemon / puller process itself wrote. Pure."""
    tot = {"disk_written": 0, "layer_data": 0, "cache_index": 0, "uppers": 0, "state": 0, "process_written": 0}
    apart = any("uppers_disk_write_bytes" in x for x in per_node)  # the uppers were on a disk of their own
    if apart:
        tot["uppers_disk_written"] = 0
    for x in per_node:
        b = (x.get("facts") or {}).get("disk_breakdown") or {}
        tot["disk_written"] += int(x.get("disk_write_bytes") or 0)
        if apart:
            tot["uppers_disk_written"] += int(x.get("uppers_disk_write_bytes") or 0)
        if contender == "conventional":
            tot["layer_data"] += int(b.get("content", 0)) + int(b.get("snapshots", 0))
            tot["state"] += int(b.get("runc_state", 0))
            tot["process_written"] += int(b.get("agent_write_bytes", 0))
        else:
            tot["layer_data"] += int(b.get("cache_data", 0))
            tot["cache_index"] += int(b.get("cache_index", 0))
            tot["state"] += int(b.get("shim_state", 0)) + int(b.get("runc_state", 0))
            tot["process_written"] += int(b.get("daemon_write_bytes", 0))
        tot["uppers"] += int(b.get("uppers", 0))
    tot["rest"] = (tot["disk_written"] - tot["layer_data"] - tot["cache_index"] - tot["state"]
                   - (0 if apart else tot["uppers"]))
    if apart:  # the old estimate, from the same run: both disks' writes less the uppers' allocated bytes
        tot["subtracted"] = tot["disk_written"] + tot["uppers_disk_written"] - tot["uppers"]
    return tot


def add_cluster_ratios(shape: dict[str, Any]) -> None:
    """Ratios of every contender against the conventional path in the same shape, and issue 19's
    goals for lazy. Node disk writes are compared without the uppers (the tasks' own writes, the
    same on both paths). Pure."""
    cs = shape.get("contenders", {})
    base = cs.get("conventional")
    if not base or base.get("skipped"):
        return
    def r(a: Any, b: Any) -> float | None:
        return round(a / b, 3) if isinstance(a, int | float) and isinstance(b, int | float) and b else None

    def no_uppers(c: dict[str, Any]) -> int | None:
        """Node disk writes without the uppers: by construction when they had a disk of their own."""
        d = c.get("disk_split") or {}
        if "disk_written" not in d:
            return None
        return d["disk_written"] if "uppers_disk_written" in d else d["disk_written"] - d["uppers"]

    def split(c: dict[str, Any], key: str) -> int | None:
        return (c.get("disk_split") or {}).get(key)

    for c in cs.values():
        if c.get("skipped"):
            continue
        c["ratios"] = {
            "all_started_speedup": r(base.get("all_started_s"), c.get("all_started_s")),
            "all_finished_speedup": r(base.get("all_finished_s"), c.get("all_finished_s")),
            "store_bytes_ratio": r(c.get("bytes_fetched"), base.get("bytes_fetched")),
            "disk_write_ratio": r(c.get("disk_write_bytes"), base.get("disk_write_bytes")),
            "disk_write_ratio_no_uppers": r(no_uppers(c), no_uppers(base)),
            "disk_write_ratio_subtracted": r(split(c, "subtracted"), split(base, "subtracted")),
            "uppers_disk_write_ratio": r(split(c, "uppers_disk_written"), split(base, "uppers_disk_written")),
            "disk_write_ratio_charged": r(metrics.charged_writes(split(c, "disk_written"),
                                                                 split(c, "uppers_disk_written"),
                                                                 split(base, "uppers_disk_written")),
                                          split(base, "disk_written")),
            "mem_peak_ratio": r(c.get("mem_peak_bytes"), base.get("mem_peak_bytes")),
        }
    lazy = cs.get("lazy")
    if lazy and not lazy.get("skipped"):
        lr = lazy["ratios"]
        shape["goals"] = {
            "all_started_speedup": _goal(lr["all_started_speedup"], GOALS["all_started_speedup_min"], ">="),
            "all_finished_speedup": _goal(lr["all_finished_speedup"], GOALS["all_finished_speedup_min"], ">="),
            "disk_write_ratio_no_uppers": _goal(lr["disk_write_ratio_no_uppers"],
                                                GOALS["disk_write_ratio_no_uppers_max"], "<="),
            "store_bytes_ratio": _goal(lr["store_bytes_ratio"], GOALS["store_bytes_ratio_max"], "<="),
        }


def _goal(value: float | None, target: float, op: str) -> dict[str, Any]:
    met = None if value is None else (value >= target if op == ">=" else value <= target)
    return {"value": value, "target": f"{op} {target:g}", "met": met}


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
