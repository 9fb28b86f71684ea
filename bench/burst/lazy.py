"""The layerstore contenders: lazy (cold node cache), lazy with prefetch hints, and --eager.

Set-up (not timed): every layer's tar.gz (the very files the conventional path uses) is built into an
EROFS image and pushed to the S3 store through the link (`layerctl build --push`), and each environment
is created and tagged (`layerctl env create`). For the hinted variant, one profiling run per environment
on a node whose daemon records its trace (`layerctl daemon --record-trace`), then the environments are
created again with `--prefetch-trace`.

The burst: the node daemon is started before the burst on an empty cache (a node service, like the
containerd of the conventional path), then every sandbox is one `layerctl run`, all launched at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from . import pushcache, spec
from .inputs import Layer, env_layers, log
from .sandbox import SandboxResult, parse_output, tail

# What the contenders need from the CLI: (argv for --help, a string the help must contain).
REQUIRED = {
    "layerctl build --push": (["build", "--help"], "--push"),
    "layerctl env create --prefetch-trace": (["env", "create", "--help"], "--prefetch-trace"),
    "layerctl daemon --record-trace": (["daemon", "--help"], "--record-trace"),
    "layerctl run --eager --node-dir": (["run", "--help"], "--eager"),
    "layerctl stats --json": (["stats", "--help"], "--json"),
}
# Only the contenders that need them.
OPTIONAL = {"lazy-noreadahead": {"layerctl daemon --readahead": (["daemon", "--help"], "--readahead")}}


def layerctl() -> str:
    return str(Path(sys.executable).with_name("layerctl"))


def missing_commands(contender: str | None = None) -> list[str]:
    missing = []
    wanted = dict(REQUIRED)
    if contender is not None:
        wanted.update(OPTIONAL.get(contender, {}))
    for name, (argv, needle) in wanted.items():
        try:
            p = subprocess.run([layerctl(), *argv], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            missing.append(name)
            continue
        if p.returncode != 0 or needle not in p.stdout:
            missing.append(name)
    return missing


def _layerctl_json(*args: str) -> Any:
    p = subprocess.run([layerctl(), *args], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"layerctl {' '.join(args[:2])} failed: {tail(p.stderr.strip(), 600)}")
    return json.loads(p.stdout)


class LayerstoreSetup:
    def __init__(self, *, store_url: str, layers: dict[str, Layer], environments: tuple[str, ...],
                 work: Path) -> None:
        self.store_url = store_url
        self.layers = layers
        self.environments = environments
        self.work = work
        self.blobs: dict[str, dict[str, Any]] = {}
        self.env_refs: dict[str, str] = {}
        self.hinted_refs: dict[str, str] = {}
        self.trace_facts: dict[str, Any] = {}
        self.push_facts: dict[str, Any] = {}

    def push_and_create(self) -> None:
        """The layers into the run's (empty) store: built once per set of inputs and builder code into
        the push cache (bench/burst/pushcache.py), then their objects copied into the store."""
        self.work.mkdir(parents=True, exist_ok=True)
        subprocess.run([layerctl(), "store", "init", "--store", self.store_url], capture_output=True, check=False)
        t = time.monotonic()
        local, results = pushcache.built(self.layers, layerctl(), _layerctl_json)
        self.push_facts = {"build_s": round(time.monotonic() - t, 2)}
        t = time.monotonic()
        self.push_facts["objects_copied"] = pushcache.copy_store(local, self.store_url)
        self.push_facts["copy_s"] = round(time.monotonic() - t, 2)
        for name, res in results.items():
            self.blobs[name] = res
            log(f"pushed {name}: {res.get('blob')} ({res.get('size', 0) / 1e6:.0f} MB, {res.get('chunks')} chunks)")
        log(f"layers: built in {self.push_facts['build_s']} s (0: cached), {self.push_facts['objects_copied']} "
            f"objects copied into the store in {self.push_facts['copy_s']} s")
        for env in self.environments:
            self.env_refs[env] = self._create(env, f"burst-{env}:cold")

    def _create(self, env: str, tag: str, trace: Path | None = None) -> str:
        names = env_layers(env)
        args = ["env", "create", "--store", self.store_url, "--base", self.blobs[names[0]]["blob"]]
        for n in names[1:-1]:
            args += ["--toolkit", self.blobs[n]["blob"]]
        args += ["--workspace", self.blobs[names[-1]]["blob"], "-t", tag, "--json"]
        if trace is not None:
            args += ["--prefetch-trace", str(trace)]
        _layerctl_json(*args)
        return tag

    def record_traces(self, node_dir: Path) -> None:
        """One profiling run per environment on a node whose daemon records the access trace."""
        trace = self.work / "trace.json"
        with contextlib.suppress(FileNotFoundError):
            trace.unlink()
        node = LayerstoreNode(node_dir, store_url=self.store_url, env_refs=self.env_refs, eager=False,
                              layerctl=layerctl(), record_trace=trace)
        try:
            for i, env in enumerate(self.environments):
                r = SandboxResult(i, env, launched=time.time())
                node.run_sandbox(i, env, spec.task_command(spec.environment(env)), r)
                if not r.ok:
                    raise RuntimeError(f"profiling run of {env} failed: {r.error or r.rc}")
        finally:
            node.teardown()  # stops the daemon, which writes the trace
        data = json.loads(trace.read_text())
        self.trace_facts = {"chunks": {b: len(c) for b, c in data.get("blobs", {}).items()}}
        for env in self.environments:
            self.hinted_refs[env] = self._create(env, f"burst-{env}:hinted", trace)

    def facts(self) -> dict[str, Any]:
        return {"blobs": self.blobs, "env_refs": self.env_refs, "hinted_refs": self.hinted_refs,
                "trace": self.trace_facts, "push": self.push_facts}


class LayerstoreNode:
    """One node: the daemon on an empty cache, started before the burst (a node service, like the
    conventional path's containerd), and a node agent that starts every sandbox of the burst at once.

    launcher "api" (default): the agent calls the shim in-process (the steps of `runtime_shim.sandbox.runner.run`:
    mount the sandbox's root, write the bundle, runc, unmount), one thread per sandbox, as the
    conventional runner does with its overlay and runc, over one `Shim.for_node` (one store client for
    the burst; the node lock is per thread). A manifest's prefetch hints are applied by the shim.
    launcher "cli": one `layerctl run` process per sandbox (what a user types; pays a Python start and
    a store client per sandbox)."""

    def __init__(self, node_dir: Path, *, store_url: str, env_refs: dict[str, str], eager: bool, layerctl: str,
                 record_trace: Path | None = None, launcher: str = "api",
                 daemon_args: list[str] | None = None) -> None:
        self.node_dir = node_dir
        self.store_url = store_url
        self.env_refs = env_refs
        self.eager = eager
        self.layerctl = layerctl
        self.record_trace = record_trace
        self.launcher = launcher
        self.daemon_args = list(daemon_args or [])
        self.tag = f"{os.getpid()}"
        self.daemon_start_s: float | None = None
        self.stats: dict[str, Any] = {}
        self.upper_bytes: list[int] = []
        self.shim: Any = None
        self._start_daemon()

    def _start_daemon(self) -> None:
        from runtime_shim.node.shim import Shim
        from runtime_shim.supervise.daemon import default_command

        trace = self.record_trace
        extra = self.daemon_args

        def command(store: str, cache: Path, mountpoint: Path) -> list[str]:
            argv = default_command(store, cache, mountpoint)
            return argv + (["--record-trace", str(trace)] if trace is not None else []) + extra

        t = time.monotonic()
        self.shim = Shim.for_node(self.node_dir, self.store_url, daemon_command=command)
        self.shim.resolver.check()  # the agent's store client, ready before the burst (as the conventional path's)
        with self.shim.lock:
            self.shim.blobs.ensure()
        self.daemon_start_s = round(time.monotonic() - t, 3)

    def run_sandbox(self, index: int, env: str, command: list[str], result: SandboxResult) -> None:
        sid = f"lsb-{'e' if self.eager else 'l'}{self.tag}-{index}"
        t0 = time.time()
        if self.launcher == "cli":
            argv = [self.layerctl, "run", "--store", self.store_url, "--node-dir", str(self.node_dir),
                    "--sandbox", sid, *(["--eager"] if self.eager else []), self.env_refs[env], "--", *command]
            p = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, errors="replace")
            out, err, rc = p.stdout, p.stderr, p.returncode
        else:
            out, err, rc = self._run_api(sid, env, command, result)
        if self.launcher == "cli" or result.finished is None:
            result.finished = time.time()
        result.rc = rc
        parse_output(out, result)
        if rc != 0:
            result.error = tail(err + out)
        if result.started is not None:
            result.phases.update({"to_start_s": result.started - t0, "run_s": result.finished - result.started})

    def _run_api(self, sid: str, env: str, command: list[str], result: SandboxResult) -> tuple[str, str, int]:
        """`runtime_shim.sandbox.runner.run`, step by step so that each step is timed."""
        from runtime_shim.node.request import MountRequest

        shim = self.shim
        t0 = time.time()
        spec_ = shim.resolve(self.env_refs[env])  # timed apart; mount() takes the resolved environment
        tr = time.time()
        sb = shim.mount(MountRequest(spec_, sandbox=sid, eager=self.eager))
        t1 = time.time()
        lock_wait = shim.lock.waited
        try:
            backend = shim.backend("runc")
            backend.prepare(sb, command)  # the OCI bundle, in the sandbox's /layerstore/<id> cgroup
            with tempfile.TemporaryFile() as fout, tempfile.TemporaryFile() as ferr:
                try:
                    rc = backend.wait(backend.start(sb.id, stdin=subprocess.DEVNULL, stdout=fout, stderr=ferr))
                finally:
                    backend.delete(sb.id)
                fout.seek(0)
                ferr.seek(0)
                out, err = fout.read().decode(errors="replace"), ferr.read().decode(errors="replace")
        finally:
            t2 = time.time()
            self.upper_bytes.append(tree_bytes(Path(sb.upper)))
            shim.unmount(sb.id)
            result.phases = {"resolve_s": tr - t0, "mount_s": t1 - tr, "lock_wait_s": lock_wait,
                             "unmount_s": time.time() - t2}
            result.finished = t2
        return out, err, rc

    def teardown(self) -> None:
        try:
            if self.shim is not None:
                for sb in self.shim.sandboxes():
                    with contextlib.suppress(Exception):
                        self.shim.unmount(sb.id)
                with self.shim.lock:
                    self.shim.blobs.stop()
                self.shim.close()
                self.shim = None
        finally:
            sweep_mounts(self.node_dir)

    def facts(self) -> dict[str, Any]:
        with contextlib.suppress(Exception):
            self.stats = _layerctl_json("stats", "--cache", str(self.node_dir / "cache"), "--json")
        from fuse_client.nodecache.cachedir import recorded_format  # plain, or zstd ($LAYERSTORE_CACHE_FORMAT)

        return {"daemon_start_s": self.daemon_start_s, "daemon_stats": self.stats, "launcher": self.launcher,
                "daemon_args": self.daemon_args, "cache_format": recorded_format(self.node_dir / "cache"),
                "disk_breakdown": self.disk_breakdown()}

    def disk_breakdown(self) -> dict[str, int]:
        """Bytes on the node disk by owner, read at the end of the burst (before teardown): the
        daemon's cache (chunk data files, its LMDB index, its journal), the shim's state (LMDB) and
        record files, the runc state, and the sandboxes' uppers (summed at each sandbox's end, since
        a teardown deletes them). Allocated bytes (st_blocks), not bytes written."""
        cache = self.node_dir / "cache"
        out = {"uppers": sum(self.upper_bytes)}
        index = 0
        data = 0
        for p in cache.rglob("*") if cache.exists() else ():
            if p.is_file() and not p.is_symlink():
                n = p.lstat().st_blocks * 512
                if p.suffix == ".mdb" or "index" in p.parts or "journal" in p.name:
                    index += n
                else:
                    data += n
        out["cache_data"], out["cache_index"] = data, index
        out["shim_state"] = tree_bytes(self.node_dir / "state") + tree_bytes(self.node_dir / "sandboxes")
        out["runc_state"] = tree_bytes(self.node_dir / "oci")
        # what the processes themselves wrote (page-cache writes, counted when dirtied)
        out["agent_write_bytes"] = process_write_bytes(os.getpid())
        with contextlib.suppress(Exception), self.shim.state.read() as t:
            rec = t.daemon()
            if rec is not None:
                out["daemon_write_bytes"] = process_write_bytes(rec.pid)
        return out

    @staticmethod
    def sandbox_cgroups(tag: str) -> str:
        """Where runc puts this node's sandboxes (the shim's cgroupsPath is /layerstore/<id>)."""
        return f"layerstore/lsb-[el]{tag}-*"


def process_write_bytes(pid: int) -> int:
    """/proc/<pid>/io write_bytes: bytes the process (all its threads) caused to be written to storage."""
    try:
        with open(f"/proc/{pid}/io") as f:
            for line in f:
                if line.startswith("write_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree_bytes(root: Path) -> int:
    """Allocated bytes of the regular files under `root` (0 if it is gone)."""
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
    return total


def sweep_mounts(root: Path) -> None:
    """Unmount whatever is still mounted under `root`, deepest first (a crashed run's leftovers)."""
    from layerstore import linux

    for m in linux.mounts_under(linux.read_mounts(), str(root.resolve())):  # deepest first
        with contextlib.suppress(linux.MountError):
            linux.detach(m.mountpoint)


def remove_tree(path: Path) -> None:
    sweep_mounts(path)
    shutil.rmtree(path, ignore_errors=True)
