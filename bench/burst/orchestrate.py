"""The benchmark's conductor: set up the link, the store and the inputs once, then run every contender's
burst on a fresh node, reading the counters around it, and write the results.

Everything the run creates (namespace, veth, Ceph daemons, loop device, mounts, cgroups, daemons) is
torn down in `finally` blocks, by an atexit hook and on SIGTERM/SIGINT; a run that was killed outright
is cleaned up by the next one from the state files under bench/.cache/run/.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import cgroups, inputs, metrics, readset, spec
from .cephstore import StoreProcess
from .conventional import s3_client, upload_layers
from .netlink import Link
from .nodedisk import NodeDisk

BUCKET = "burst"
REPO = Path(__file__).resolve().parents[2]
SUPPORT = REPO / "tests" / "support"  # testkit: the CRI client and the containerd config of the tests


@dataclass
class Options:
    size: spec.Size
    sandboxes: int
    rate_mbit: float
    environments: tuple[str, ...]
    contenders: tuple[str, ...]
    output: Path
    readset: bool = True
    rounds: int = 1
    docs: Path | None = None
    readset_only: bool = False
    pull_rounds: int = 0  # PullImage alone, for the CRI contenders (crinode.CriNode.time_pulls)
    pull_output: Path | None = None
    notes: list[str] = field(default_factory=list)


class Cleanup:
    """LIFO of cleanup actions that run once: at the end, at exit, or on a signal."""

    def __init__(self) -> None:
        self._actions: list[tuple[str, Callable[[], None]]] = []
        self._lock = threading.Lock()
        atexit.register(self.run)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    def push(self, what: str, fn: Callable[[], None]) -> None:
        with self._lock:
            self._actions.append((what, fn))

    def pop(self, what: str) -> None:
        """Run the newest action named `what` now."""
        with self._lock:
            for i in range(len(self._actions) - 1, -1, -1):
                if self._actions[i][0] == what:
                    _, fn = self._actions.pop(i)
                    break
            else:
                return
        _safely(what, fn)

    def run(self) -> None:
        while True:
            with self._lock:
                if not self._actions:
                    return
                what, fn = self._actions.pop()
            _safely(what, fn)


def _safely(what: str, fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - cleanup goes on
        print(f"burst: cleanup of {what} failed: {e}", file=sys.stderr)


class Bench:
    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.run_dir = inputs.run_root() / f"run-{os.getpid()}"
        self.cleanup = Cleanup()
        self.link: Link | None = None
        self.store: StoreProcess | None = None
        self.disk: NodeDisk | None = None
        self.uppers_disk: NodeDisk | None = None  # at NODE/sandboxes during a burst (nodedisk.py)
        self.layers: dict[str, inputs.Layer] = {}
        self.results: dict[str, Any] = {}
        self.lazy: Any = None  # bench.burst.lazy.LayerstoreSetup when available
        self.registry: Any = None  # bench.burst.ctrnode.RegistryProcess for the containerd contenders
        self.image_refs: dict[str, dict[str, str]] = {}  # containerd contender -> env -> image reference
        self.pause = ""  # the pod sandbox image of the CRI contenders
        self.sources = False  # the link counts the registry's and the store's bytes apart

    # -- the whole run -------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        o = self.opts
        try:
            t = time.monotonic()
            inputs.ensure_debs(["runc", "iproute2", "e2fsprogs", "mount"])
            self.layers = inputs.build_all(o.environments)
            self.results = self._header()
            self.results["timings"] = {"inputs_s": round(time.monotonic() - t, 1)}
            self._up()
            plan = spec.Plan.round_robin(o.environments, o.sandboxes)
            self._setup_contenders()
            if o.readset:
                t = time.monotonic()
                self.results["read_set"] = self._measure_readset()
                self.results["timings"]["read_set_s"] = round(time.monotonic() - t, 1)
                if self.results["read_set"].get("cached"):
                    o.notes.append("bytes read: measured by an earlier run of the same inputs (cached under "
                                   "bench/.cache/readsets)")
            self.results["contenders"] = {}
            runnable = []
            for name in o.contenders:
                skip = self._skip_reason(name)
                if skip:
                    inputs.log(f"{name}: skipped ({skip})")
                    self.results["contenders"][name] = {"skipped": skip}
                else:
                    runnable.append(name)
            rounds: dict[str, list[dict[str, Any]]] = {n: [] for n in runnable}
            for r in range(o.rounds):
                # Each round starts with another contender, so none always runs first or last.
                k = r % len(runnable) if runnable else 0
                for name in runnable[k:] + runnable[:k]:
                    inputs.log(f"round {r + 1}/{o.rounds}: {name}: burst of {len(plan.sandboxes)} sandboxes")
                    try:
                        rounds[name].append(self._run_contender(name, plan.sandboxes))
                    except Exception as e:  # noqa: BLE001 - one contender's failure must not sink the others
                        inputs.log(f"round {r + 1}: {name} failed: {e}")
                        o.notes.append(f"{name}, round {r + 1}: the run failed: {e}")
                        if not rounds[name]:
                            self.results["contenders"][name] = {"skipped": f"the run failed: {e}"}
                        continue
                    self.results["contenders"][name] = metrics.combine(rounds[name])
                    self._write()
            self._time_pulls([n for n in runnable if n in spec.CRI_CONTENDERS])
            self.results["notes"] = o.notes
            metrics.add_ratios(self.results)
            self._write()
            return self.results
        finally:
            self.cleanup.run()

    def _header(self) -> dict[str, Any]:
        o = self.opts
        return {
            "benchmark": "burst",
            "size": o.size.name,
            "sandboxes": o.sandboxes,
            "rate_mbit": o.rate_mbit,
            "rounds": o.rounds,
            "environments": {e: inputs.env_layers(e) for e in o.environments},
            "layers": {k: v.to_json() for k, v in self.layers.items()},
            "machine": {"cpus": os.cpu_count(), "kernel": platform.release(),
                        "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)},
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "code": code_version(),
        }

    def _write(self) -> None:
        self.opts.output.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.opts.output.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.results, indent=1, sort_keys=False) + "\n")
        os.replace(tmp, self.opts.output)

    # -- link, store, node disk ------------------------------------------------------------
    def _open_run(self) -> None:
        """Clear what killed runs left, make this run's directory, and have the clean-up remove it
        and this run's cgroups."""
        cleanup_stale_runs(self.run_dir.parent)
        cgroups.remove_stale()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.cleanup.push("run dir", lambda: shutil.rmtree(self.run_dir, ignore_errors=True))
        self.cleanup.push("cgroups", lambda: [cgroups.remove_everywhere(n) for n in (f"lsburst-{os.getpid()}",
                                                                                   "lsburst-sandboxes")])

    def _up(self) -> None:
        self._open_run()
        self.link = Link(self.run_dir.parent, rate_mbit=self.opts.rate_mbit)
        self.link.setup()
        self.cleanup.push("link", self.link.teardown)
        self.store = StoreProcess(self.link, self.run_dir / "ceph")
        t = time.monotonic()
        self.store.start()
        self.cleanup.push("store", self.store.stop)
        self.results["timings"]["store_start_s"] = round(time.monotonic() - t, 1)
        os.environ.update(self.store.s3_env())
        self.disk = NodeDisk(self.run_dir / "nodedisk.img", self.run_dir / "node")
        self.disk.attach()
        self.cleanup.push("node disk", self.disk.detach)
        self.uppers_disk = NodeDisk(self.run_dir / "uppersdisk.img", self.run_dir / "uppers")
        self.uppers_disk.attach()
        self.cleanup.push("uppers disk", self.uppers_disk.detach)  # (LIFO: before the node disk it sits in)

    def _setup_contenders(self) -> None:
        assert self.store is not None and self.link is not None
        client = s3_client(self.store.endpoint)
        with contextlib.suppress(Exception):
            client.create_bucket(Bucket=BUCKET)
        t = time.monotonic()
        c0 = self.link.counters()
        upload_layers(client, BUCKET, {k: v.tar_gz for k, v in self.layers.items()})
        self.results["timings"]["upload_tar_gz_s"] = round(time.monotonic() - t, 1)
        self.results["upload_link_tx_bytes"] = self.link.counters().minus(c0).tx_bytes
        if any(c in self.opts.contenders for c in (*spec.LAYERSTORE_CONTENDERS, "containerd-layerstore",
                                                   "cri-layerstore")):
            from . import lazy

            missing = lazy.missing_commands()
            if missing:
                self.opts.notes.append(f"layerstore contenders not available yet: {', '.join(missing)}")
                return
            t = time.monotonic()
            self.lazy = lazy.LayerstoreSetup(store_url=self.store_url(), layers=self.layers,
                                              environments=self.opts.environments, work=self.run_dir / "layerstore")
            self.lazy.push_and_create()
            self.results["timings"]["layerstore_push_s"] = round(time.monotonic() - t, 1)
            if "lazy-prefetch" in self.opts.contenders:
                t = time.monotonic()
                assert self.disk is not None
                self.disk.fresh()
                try:
                    self.lazy.record_traces(self.disk.mountpoint / "profile")
                except Exception as e:  # noqa: BLE001 - the other contenders still run
                    self.opts.notes.append(f"prefetch hints could not be recorded: {e}")
                finally:
                    self.disk.unmount()
                self.results["timings"]["profile_s"] = round(time.monotonic() - t, 1)
            self.results["layerstore"] = self.lazy.facts()
        self._setup_containerd()

    def _setup_containerd(self) -> None:
        """A registry behind the link, holding each environment as an ordinary OCI image (the
        conventional path's tar.gz layers) and as an image of layerstore layer pointers (and for the
        CRI contenders the pause image); the link counts the registry's and the store's bytes apart."""
        wanted = [c for c in self.opts.contenders if c in (*spec.CONTAINERD_CONTENDERS, *spec.CRI_CONTENDERS)]
        if not wanted:
            return
        from . import ctrnode

        if ctrnode.missing():
            self.opts.notes.append(f"containerd contenders: missing {', '.join(ctrnode.missing())}")
            return
        assert self.link is not None and self.store is not None
        t = time.monotonic()
        self.registry = ctrnode.RegistryProcess(self.link, self.run_dir / "registry")
        self.registry.start()
        self.cleanup.push("registry", self.registry.stop)
        try:
            port = urllib.parse.urlsplit(self.store.endpoint).port or 80
            self.link.count_sources({"registry": ctrnode.REGISTRY_PORT, "store": port})
            self.sources = True
        except (OSError, subprocess.CalledProcessError) as e:
            self.opts.notes.append(f"bytes by source not counted (iptables in the link's namespace: {e})")
        refs: dict[str, dict[str, str]] = {}
        if any(c.endswith("-overlayfs") for c in wanted):
            refs["overlayfs"] = ctrnode.push_images(self.registry.host, self.layers, self.opts.environments)
        if any(c.endswith("-layerstore") for c in wanted) and self.lazy is not None:
            refs["layerstore"] = ctrnode.push_environments(
                self.registry.host, str(Path(sys.executable).parent / "layerctl"), self.store_url(),
                self.lazy.env_refs)
        self.image_refs = {c: refs[c.split("-", 1)[1]] for c in wanted if c.split("-", 1)[1] in refs}
        if any(c in spec.CRI_CONTENDERS for c in wanted):
            from testkit.cri import push_pause

            self.pause = push_pause(self.run_dir / "pause", self.registry.host, "burst/pause", insecure=True)
        self.results["timings"]["registry_push_s"] = round(time.monotonic() - t, 1)

    def store_url(self) -> str:
        assert self.store is not None
        return f"s3://{BUCKET}/layerstore?endpoint={self.store.endpoint}"

    def _skip_reason(self, name: str) -> str:
        if name == "conventional":
            return ""
        if name in spec.CONTAINERD_CONTENDERS or name in spec.CRI_CONTENDERS:
            return "" if name in self.image_refs else "containerd set-up failed or missing (see notes)"
        if name in spec.LAYERSTORE_CONTENDERS:
            from . import lazy

            missing = lazy.missing_commands(name)
            if missing:
                return "not available yet: " + ", ".join(missing)
            if self.lazy is None:
                return "layerstore set-up failed"
            if name == "lazy-prefetch" and not self.lazy.hinted_refs:
                return "no prefetch hints (profiling run failed or `env create --prefetch-trace` missing)"
            return ""
        return f"unknown contender {name}"

    # -- bytes the tasks read ----------------------------------------------------------------
    def _measure_readset(self) -> dict[str, Any]:
        """The bytes the tasks read: a property of the inputs (the same layer files, environments
        and task), so measured once per set of inputs and kept beside them in the cache."""
        assert self.disk is not None
        tars = {k: v.tar_gz for k, v in self.layers.items()}
        key = hashlib.sha256(json.dumps({
            "envs": list(self.opts.environments), "task": spec.TASK_SCRIPT,
            "tars": {k: [str(p), p.stat().st_size, p.stat().st_mtime_ns] for k, p in sorted(tars.items())},
        }, sort_keys=True).encode()).hexdigest()[:16]
        cached = inputs.cache_root() / "readsets" / f"{key}.json"
        if cached.exists():
            return dict(json.loads(cached.read_text()), cached=True)
        self.disk.fresh()
        try:
            measured = readset.measure(self.disk, tars, self.opts.environments)
        finally:
            self.disk.unmount()
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_text(json.dumps(measured))
        return measured

    # -- one contender -----------------------------------------------------------------------
    def _run_contender(self, name: str, sandboxes: list[str], mode: str = "burst") -> dict[str, Any]:
        """One burst of `name` on a fresh node (mode "pulls": PullImage alone, see `_time_pulls`)."""
        assert self.disk is not None and self.link is not None and self.store is not None
        assert self.uppers_disk is not None
        self.uppers_disk.unmount()  # (a contender that failed before its runner started may have left it)
        self.disk.fresh()
        node = self.disk.mountpoint / name
        node.mkdir()
        # the sandboxes' directories (uppers, work, bundles) on a disk of their own, for every contender
        self.uppers_disk.fresh_at(node / "sandboxes")
        self.cleanup.push(f"uppers disk {name}", self.uppers_disk.unmount)
        cg = cgroups.MemoryCgroup(f"lsburst-{os.getpid()}/{name}")
        cg.create()
        self.cleanup.push(f"cgroup {name}", cg.remove)
        runc_root = node / "runc"  # on the node disk, where the shim keeps its runc state too
        plan_file = self.run_dir / f"plan-{name}.json"
        out_file = self.run_dir / f"result-{name}.json"
        plan: dict[str, Any] = {
            "contender": name, "cgroup": f"lsburst-{os.getpid()}/{name}", "node_dir": str(node),
            "sandboxes": sandboxes, "output": str(out_file), "endpoint": self.store.endpoint, "bucket": BUCKET,
            "runc_root": str(runc_root), "store_url": self.store_url(),
            "layerctl": str(Path(sys.executable).parent / "layerctl"), "mode": mode,
            "pull_rounds": self.opts.pull_rounds, "pause": self.pause,
        }
        if self.lazy is not None:
            plan["env_refs"] = self.lazy.hinted_refs if name == "lazy-prefetch" else self.lazy.env_refs
        if name in self.image_refs:
            assert self.registry is not None
            plan.update(image_refs=self.image_refs[name], registry=self.registry.host,
                        snapshotter=name.split("-", 1)[1])
        plan_file.write_text(json.dumps(plan))
        proc = subprocess.Popen([sys.executable, "-m", "bench.burst.runner", str(plan_file)], cwd=REPO,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": os.pathsep.join((str(REPO), str(SUPPORT)))})
        self.cleanup.push(f"runner {name}", lambda: stop_runner(proc))
        cg.sandbox_glob = sandbox_cgroups(name, proc.pid)
        assert proc.stdin is not None and proc.stdout is not None
        try:
            if proc.stdout.readline().strip() != "READY":
                raise RuntimeError(f"{name}: the runner did not start")
            link0, disk0, up0 = self.link.counters(), self.disk.counters(), self.uppers_disk.counters()
            src0 = self.link.source_bytes() if self.sources else {}
            qdisc0 = self.link.qdisc_stats()
            cpu0, load0 = cpu_seconds(), os.getloadavg()[0]
            cg.start_sampling()
            proc.stdin.write("GO\n")
            proc.stdin.flush()
            line = proc.stdout.readline().strip()
            if not line.startswith("DONE"):
                raise RuntimeError(f"{name}: the runner failed")
            link1, disk1, up1 = self.link.counters(), self.disk.counters(), self.uppers_disk.counters()
            src1 = self.link.source_bytes() if self.sources else {}
            qdisc1 = self.link.qdisc_stats()
            cpu1 = cpu_seconds()
            cg.stop_sampling()
            used = self.disk.used_bytes()
            peak = cg.kernel_peak()
            proc.stdin.write("TEARDOWN\n")
            proc.stdin.flush()
            proc.wait(timeout=300)
        finally:
            self.cleanup.pop(f"runner {name}")
            cg.stop_sampling()
            self.cleanup.pop(f"uppers disk {name}")
        raw = json.loads(out_file.read_text())
        measured = {
            "link_rx_bytes": link1.minus(link0).rx_bytes,
            "link_tx_bytes": link1.minus(link0).tx_bytes,
            **{f"{k}_bytes": v - src0.get(k, 0) for k, v in src1.items()},  # registry_bytes, store_bytes
            "qdisc_bytes": delta(qdisc1.get("bytes"), qdisc0.get("bytes")),
            "qdisc_drops": delta(qdisc1.get("drops"), qdisc0.get("drops")),
            "disk_write_bytes": disk1.minus(disk0).write_bytes,  # without the sandboxes' dirs: uppers disk
            "uppers_disk_write_bytes": up1.minus(up0).write_bytes,
            "disk_read_bytes": disk1.minus(disk0).read_bytes,
            "disk_used_bytes": used,
            "mem_peak_bytes": cg.peak_usage_sampled,
            "mem_peak_anon_bytes": cg.peak_anon,
            "mem_peak_node_side_bytes": peak,
            # The machine is shared: how busy it was (all processes, ours included) while the burst ran.
            "machine_cpu_busy_s": round(cpu1[0] - cpu0[0], 2),
            "machine_cpu_iowait_s": round(cpu1[1] - cpu0[1], 2),
            "loadavg_before": round(load0, 2),
            "loadavg_after": round(os.getloadavg()[0], 2),
        }
        self.cleanup.pop(f"cgroup {name}")
        return metrics.summarize_pulls(raw, measured) if mode == "pulls" else metrics.summarize(raw, measured)

    def _time_pulls(self, names: list[str]) -> None:
        """PullImage alone for the CRI contenders, each on a fresh node (`--pull-rounds`): into the
        results and a file of its own."""
        o = self.opts
        if not o.pull_rounds or not names:
            return
        pulls: dict[str, Any] = {}
        for name in names:
            inputs.log(f"{name}: PullImage alone, {o.pull_rounds} round(s) of {len(o.environments)} image(s)")
            try:
                pulls[name] = self._run_contender(name, [], mode="pulls")
            except Exception as e:  # noqa: BLE001 - the burst's results stand
                o.notes.append(f"{name}: PullImage timing failed: {e}")
                pulls[name] = {"skipped": f"the run failed: {e}"}
        self.results["cri_pull"] = {"rounds": o.pull_rounds, "contenders": pulls, "goal": metrics.pull_goal(pulls)}
        if o.pull_output is not None:
            keys = ("size", "rate_mbit", "environments", "machine", "started", "code")
            doc = {**{k: self.results.get(k) for k in keys}, "benchmark": "cri_pull", **self.results["cri_pull"]}
            o.pull_output.parent.mkdir(parents=True, exist_ok=True)
            o.pull_output.write_text(json.dumps(doc, indent=1) + "\n")


def code_version() -> dict[str, Any]:
    """The commit the run measured, and the tracked files that differed from it (the work tree is
    shared: others' uncommitted changes run too)."""
    def git(*args: str) -> str:
        p = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
        return p.stdout.rstrip("\n") if p.returncode == 0 else ""

    dirty = [ln[3:] for ln in git("status", "--porcelain", "--untracked-files=no").splitlines()
             if ln.endswith(".py")]  # the code that ran (not results or docs)
    return {"commit": git("rev-parse", "--short=12", "HEAD"), "modified": dirty}


def remeasure_readset(results_file: Path) -> dict[str, Any]:
    """Measure the bytes the tasks read again for an existing results file (its environments) and
    recompute its ratios; needs neither the link nor the store."""
    results = json.loads(results_file.read_text())
    envs = tuple(results["environments"])
    layers = inputs.build_all(envs)
    cleanup = Cleanup()
    run_dir = inputs.run_root() / f"run-{os.getpid()}"
    try:
        cleanup_stale_runs(run_dir.parent)
        run_dir.mkdir(parents=True, exist_ok=True)
        cleanup.push("run dir", lambda: shutil.rmtree(run_dir, ignore_errors=True))
        disk = NodeDisk(run_dir / "nodedisk.img", run_dir / "node")
        disk.attach()
        cleanup.push("node disk", disk.detach)
        disk.fresh()
        try:
            results["read_set"] = readset.measure(disk, {k: v.tar_gz for k, v in layers.items()}, envs)
        finally:
            disk.unmount()
    finally:
        cleanup.run()
    metrics.add_ratios(results)
    results.setdefault("notes", []).append("bytes read re-measured after the run (`bench/burst.py --readset-only`)")
    tmp = results_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1) + "\n")
    os.replace(tmp, results_file)
    return results


def cleanup_stale_runs(root: Path) -> None:
    """Run directories of runs that were killed outright: their node disk and files."""
    for d in root.glob("run-*"):
        try:
            pid = int(d.name.split("-", 1)[1])
        except ValueError:
            continue
        if pid == os.getpid() or Path(f"/proc/{pid}").exists():
            continue
        from .lazy import sweep_mounts

        sweep_mounts(d)
        # every loop device the run attached: node and uppers disks, one node's or a cluster's
        for state in d.glob("*.state.json"):
            NodeDisk(d / (state.name[:-len(".state.json")] + ".img"), d / "node").cleanup_stale()
        shutil.rmtree(d, ignore_errors=True)


def cpu_seconds() -> tuple[float, float]:
    """(busy, iowait) CPU-seconds of the whole machine since boot, from /proc/stat."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    idle, iowait = f[3], f[4]
    return (sum(f[:8]) - idle - iowait) / hz, iowait / hz


def sandbox_cgroups(contender: str, runner_pid: int) -> str:
    if contender == "conventional":
        from .conventional import ConventionalNode

        return ConventionalNode.sandbox_cgroups(str(runner_pid))
    if contender in spec.CONTAINERD_CONTENDERS:
        from .ctrnode import ContainerdNode

        return ContainerdNode.sandbox_cgroups(str(runner_pid))
    if contender in spec.CRI_CONTENDERS:
        from .crinode import CriNode

        return CriNode.sandbox_cgroups(str(runner_pid))
    from .lazy import LayerstoreNode

    return LayerstoreNode.sandbox_cgroups(str(runner_pid))


def delta(a: object, b: object) -> int | None:
    return a - b if isinstance(a, int) and isinstance(b, int) else None


def stop_runner(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(Exception):
        assert proc.stdin is not None
        proc.stdin.close()  # EOF: the runner tears down what it started
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
