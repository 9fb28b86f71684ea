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

`--size` defaults to $BENCH_SIZE (as `make bench` sets it), else quick: 1,000 and 10,000, 1 client,
20 CLI calls per point, 6 A/B blocks, one round (~4 minutes, most of it teardown: see docs/benchmarks-compose.md);
full: 1 and 4 clients, two rounds, 50 CLI calls per point, 20 A/B blocks (medians of the rounds are reported, and
each round's headline figures with the machine's load while it ran).
Needs root, mkfs.erofs and busybox-static.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import multiprocessing
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DEFAULT_OUT = ROOT / "bench" / "results" / "compose.json"
SIZES: dict[str, dict[str, Any]] = {
    "quick": {"scales": [1000, 10000], "clients": [1], "cli": 20, "rounds": 1, "ab_blocks": 6},
    "full": {"scales": [1000, 10000], "clients": [1, 4], "cli": 50, "rounds": 2, "ab_blocks": 20},
}
GOALS = {"rate_per_s": 200, "p99_ms": 50, "mounted": 10000}
INNER_ENV = "LAYERSTORE_COMPOSE_INNER"
CGROUP_ENV = "LAYERSTORE_COMPOSE_CGROUP"
ENV_TAG = "compose:1"
PROBES = ("etc/motd", "opt/toolkit/VERSION", "workspace/README.md")  # one file of each layer
APPLETS = ["sh", "echo", "cat", "ls", "mkdir", "rm", "touch", "test", "true", "false", "head", "env", "id"]
LAYERCTL = str(Path(sys.executable).with_name("layerctl"))


def log(msg: str) -> None:
    print(f"compose: {msg}", file=sys.stderr, flush=True)


# -- inputs ------------------------------------------------------------------------------------
def make_trees(work: Path) -> dict[str, Path]:
    """base: static busybox + /etc; toolkit: 400 small files under /opt/toolkit; workspace: a 200-file
    repository under /workspace. Small on purpose: composition cost does not depend on layer size."""
    busybox = shutil.which("busybox")
    if busybox is None:
        raise SystemExit("compose: needs busybox-static (.ci/install-deps.sh)")
    base = work / "trees" / "base"
    (base / "bin").mkdir(parents=True)
    shutil.copy(busybox, base / "bin" / "busybox")
    for a in APPLETS:
        os.symlink("busybox", base / "bin" / a)
    for d in ("etc", "tmp", "proc", "sys", "dev", "root"):
        (base / d).mkdir()
    (base / "etc" / "motd").write_text("base\n")
    (base / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    tk = work / "trees" / "toolkit" / "opt" / "toolkit"
    for i in range(20):
        d = tk / "lib" / f"pkg{i:02d}"
        d.mkdir(parents=True)
        for j in range(20):
            (d / f"mod{j:02d}.py").write_text(f"# toolkit module {i}.{j}\n" * 40)
    (tk / "VERSION").write_text("toolkit 1\n")
    ws = work / "trees" / "workspace" / "workspace"
    for i in range(10):
        d = ws / "src" / f"m{i}"
        d.mkdir(parents=True)
        for j in range(20):
            (d / f"f{j:02d}.py").write_text(f"def f{j}():\n    return {i * 100 + j}\n" * 10)
    (ws / "README.md").write_text("workspace\n")
    return {"base": base, "toolkit": work / "trees" / "toolkit", "workspace": work / "trees" / "workspace"}


def layerctl(*args: str) -> dict[str, Any]:
    p = subprocess.run([LAYERCTL, *args], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"layerctl {' '.join(args[:2])}: {p.stderr.strip()}")
    return json.loads(p.stdout) if p.stdout.strip().startswith("{") else {}


def make_environment(work: Path, trees: dict[str, Path]) -> tuple[str, dict[str, str]]:
    store = str(work / "store")
    layerctl("store", "init", "--store", store)
    blobs = {role: str(layerctl("build", str(t), "--push", "--store", store, "--all-root", "--json")["blob"])
             for role, t in trees.items()}
    layerctl("env", "create", "--store", store, "--base", blobs["base"], "--toolkit", blobs["toolkit"],
             "--workspace", blobs["workspace"], "-t", ENV_TAG, "--json")
    return store, blobs


# -- measurements ------------------------------------------------------------------------------
def meminfo() -> dict[str, int]:
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        k, v = line.split(":", 1)
        if k in ("Slab", "SReclaimable", "SUnreclaim", "MemAvailable", "KernelStack", "PageTables"):
            out[k] = int(v.split()[0]) * 1024
    return out


def slabinfo() -> dict[str, int]:
    """Bytes in use per slab cache (active objects x object size)."""
    out = {}
    try:
        lines = Path("/proc/slabinfo").read_text().splitlines()[2:]
    except OSError:
        return out
    for line in lines:
        f = line.split()
        out[f[0]] = int(f[1]) * int(f[3])
    return out


def rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def cgroup_memory() -> dict[str, int]:
    """Kernel memory and all memory charged to the run's own memory cgroup (v1), if it has one."""
    cg = os.environ.get(CGROUP_ENV)
    out: dict[str, int] = {}
    if cg:
        for key, name in (("kmem", "memory.kmem.usage_in_bytes"), ("total", "memory.usage_in_bytes")):
            with contextlib.suppress(OSError, ValueError):
                out[key] = int(Path(cg, name).read_text())
    return out


def snapshot() -> dict[str, Any]:
    return {"meminfo": meminfo(), "slab": slabinfo(), "cgroup": cgroup_memory(), "t": time.monotonic()}


def per_sandbox(before: dict[str, Any], after: dict[str, Any], n: int) -> dict[str, Any]:
    mi = {k: round((after["meminfo"][k] - before["meminfo"][k]) / n) for k in ("Slab", "SReclaimable", "SUnreclaim")}
    deltas = {k: after["slab"].get(k, 0) - before["slab"].get(k, 0) for k in after["slab"]}
    top = sorted(deltas.items(), key=lambda kv: -kv[1])[:8]
    cg = {f"cgroup_{k}_bytes": round((after["cgroup"][k] - before["cgroup"][k]) / n)
          for k in after["cgroup"] if k in before["cgroup"]}
    return {**cg, "machine_slab_bytes": mi["Slab"], "machine_sreclaimable_bytes": mi["SReclaimable"],
            "machine_sunreclaim_bytes": mi["SUnreclaim"],
            "machine_top_slab_caches_bytes": {k: round(v / n) for k, v in top if v > 0}}


def stats(lat: list[float]) -> dict[str, Any]:
    if not lat:
        return {}
    s = sorted(lat)

    def pct(p: float) -> float:
        return round(s[min(len(s) - 1, int(p * len(s)))] * 1000, 3)

    return {"n": len(s), "p50_ms": pct(0.50), "p90_ms": pct(0.90), "p99_ms": pct(0.99),
            "max_ms": round(s[-1] * 1000, 3), "mean_ms": round(statistics.fmean(s) * 1000, 3)}


class TimedLock:
    """Wraps the shim's node lock to record how long each acquisition waited and was held."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.waits: list[float] = []
        self.holds: list[float] = []
        self._depth = 0
        self._t = 0.0

    def __enter__(self) -> TimedLock:
        t = time.perf_counter()
        self.inner.__enter__()
        if self._depth == 0:
            self._t = time.perf_counter()
            self.waits.append(self._t - t)
        self._depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth == 0:
            self.holds.append(time.perf_counter() - self._t)
        self.inner.__exit__(*exc)


def usable(target: str) -> None:
    for p in PROBES:
        with open(os.path.join(target, p), "rb") as f:
            if not f.read(1):
                raise RuntimeError(f"{target}/{p} is empty")


# -- contenders --------------------------------------------------------------------------------
class Plain:
    """mkdir upper/work/root + one overlay mount(2) of the three layer directories. The roots are
    on a mount of their own (a private bind mount of WORK/plain-roots, made by `inner`), as the
    shim's are: overlayfs walks every child mount of the mounts its upper and lowers are on at
    each mount(2), so roots mounted beside them would make each mount O(mounted) in the kernel."""

    name = "plain-overlay"

    def __init__(self, work: Path, trees: dict[str, Path], tag: str) -> None:
        self.root = work / f"plain-{tag}"
        self.roots = work / "plain-roots"
        self.root.mkdir(parents=True, exist_ok=True)
        self.lowers = ":".join(str(trees[r]) for r in ("workspace", "toolkit", "base"))

    def open(self) -> None:
        pass

    def mount(self, i: str) -> tuple[str, str]:
        from fuse_client import linux

        d = self.root / i
        d.mkdir()
        up, wk, rt = d / "upper", d / "work", self.roots / i
        up.mkdir()
        wk.mkdir()
        rt.mkdir()
        linux.mount("overlay", rt, "overlay", 0, f"lowerdir={self.lowers},upperdir={up},workdir={wk},"
                       "redirect_dir=off,metacopy=off,index=off")
        return i, str(rt)

    def unmount(self, handle: str) -> None:
        from fuse_client import linux

        linux.umount(self.roots / handle)
        os.rmdir(self.roots / handle)
        shutil.rmtree(self.root / handle)

    def close(self) -> None:
        pass

    def state_bytes(self) -> dict[str, int]:
        return {}


class Api:
    """`Shim.mount(tag)` in a long-lived process; `fsync` re-adds a flush per state transaction."""

    name = "layerstore-api"

    def __init__(self, node: Path, store: str, *, fsync: bool = False) -> None:
        self.node, self.store, self.fsync = node, store, fsync
        self.shim: Any = None
        self.lock: TimedLock | None = None
        if fsync:
            self.name = "layerstore-api-fsync"

    def open(self) -> None:
        from runtime_shim.shim import Shim

        self.shim = Shim.for_node(self.node, self.store)
        self.lock = self.shim.lock = TimedLock(self.shim.lock)
        if self.fsync:
            state = self.shim.state
            plain_write = state.write

            @contextlib.contextmanager
            def synced_write() -> Iterator[Any]:
                with plain_write() as t:
                    yield t
                state.sync()

            state.write = synced_write

    def mount(self, i: str) -> tuple[str, str]:
        sb = self.shim.mount(ENV_TAG, sandbox=f"c{i}")
        return sb.id, sb.target

    def unmount(self, handle: str) -> None:
        self.shim.unmount(handle)

    def close(self) -> None:
        if self.shim is not None:
            self.shim.close()
            self.shim = None

    def state_bytes(self) -> dict[str, int]:
        from runtime_shim.state import NodeState

        with NodeState(self.node / "state") as st:
            return st.size()


def make_contender(kind: str, cfg: dict[str, Any], tag: str) -> Any:
    if kind == "plain-overlay":
        return Plain(Path(cfg["work"]), {k: Path(v) for k, v in cfg["trees"].items()}, tag)
    return Api(Path(cfg["node"]), cfg["store"], fsync=kind == "layerstore-api-fsync")


def worker(kind: str, cfg: dict[str, Any], tag: str, ids: list[str], barrier: Any, out: Any) -> None:
    """One client: mount `ids` (each made usable), then wait, then unmount them."""
    c = make_contender(kind, cfg, tag)
    c.open()
    lat, handles = [], []
    lock = getattr(c, "lock", None)
    # per operation: the sum of its lock acquisitions (a mount takes the lock twice, a teardown twice)
    holds: list[float] = []
    waits: list[float] = []

    def lock_mark() -> tuple[int, int]:
        return (len(lock.holds), len(lock.waits)) if lock else (0, 0)

    def lock_add(mark: tuple[int, int]) -> None:
        if lock:
            holds.append(sum(lock.holds[mark[0]:]))
            waits.append(sum(lock.waits[mark[1]:]))

    barrier.wait()
    t0, cpu0 = time.monotonic(), time.process_time()
    for i in ids:
        t = time.perf_counter()
        mark = lock_mark()
        h, target = c.mount(i)
        lock_add(mark)
        usable(target)
        lat.append(time.perf_counter() - t)
        handles.append(h)
    t1, cpu1 = time.monotonic(), time.process_time()
    res: dict[str, Any] = {"lat": lat, "start": t0, "end": t1, "cpu": cpu1 - cpu0, "rss": rss(os.getpid()),
                           "lock_holds": holds, "lock_waits": waits}
    holds, waits = [], []
    if lock:
        lock.holds, lock.waits = [], []
    out.put(("mounted", res))
    barrier.wait()  # the parent measures memory at the checkpoint meanwhile
    barrier.wait()
    ulat = []
    t0, cpu0 = time.monotonic(), time.process_time()
    for h in handles:
        t = time.perf_counter()
        mark = lock_mark()
        c.unmount(h)
        lock_add(mark)
        ulat.append(time.perf_counter() - t)
    out.put(("unmounted", {"lat": ulat, "start": t0, "end": time.monotonic(), "cpu": time.process_time() - cpu0,
                           "lock_holds": holds}))
    c.close()


def run_phase(kind: str, cfg: dict[str, Any], tag: str, ids: list[str], clients: int,
              at_checkpoint: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Mount `ids` with `clients` processes, call `at_checkpoint` while they are all mounted, then
    unmount them with the same clients."""
    ctx = multiprocessing.get_context("spawn")  # LMDB handles must not cross a fork
    barrier = ctx.Barrier(clients + 1)
    out = ctx.Queue()
    shares = [ids[k::clients] for k in range(clients)]
    procs = [ctx.Process(target=worker, args=(kind, cfg, f"{tag}-{k}", shares[k], barrier, out))
             for k in range(clients)]
    for p in procs:
        p.start()
    try:
        barrier.wait(timeout=300)
        got = [out.get(timeout=3600) for _ in procs]
        mounted = [r for what, r in got if what == "mounted"]
        barrier.wait(timeout=60)
        extra = at_checkpoint()
        barrier.wait(timeout=3600)
        got = [out.get(timeout=3600) for _ in procs]
        unmounted = [r for what, r in got if what == "unmounted"]
    except BaseException:
        barrier.abort()
        for p in procs:
            p.kill()
        raise
    finally:
        for p in procs:
            p.join(timeout=600)
    lat = [x for r in mounted for x in r["lat"]]
    wall = max(r["end"] for r in mounted) - min(r["start"] for r in mounted)
    ulat = [x for r in unmounted for x in r["lat"]]
    uwall = max(r["end"] for r in unmounted) - min(r["start"] for r in unmounted)
    holds = [x for r in mounted for x in r["lock_holds"]]
    waits = [x for r in mounted for x in r["lock_waits"]]
    uholds = [x for r in unmounted for x in r["lock_holds"]]
    cpu = sum(r["cpu"] for r in mounted) / len(lat)
    ucpu = sum(r["cpu"] for r in unmounted) / len(ulat)
    return {"mount": {"rate_per_s": round(len(lat) / wall, 1), **stats(lat), "cpu_ms": round(cpu * 1000, 3),
                      "cpu_bound_rate_per_2_cores": round(2 / cpu, 1)},
            "lock_hold_per_mount": stats(holds), "lock_wait_per_mount": stats(waits),
            "unmount": {"rate_per_s": round(len(ulat) / uwall, 1), **stats(ulat), "cpu_ms": round(ucpu * 1000, 3)},
            "lock_hold_per_unmount": stats(uholds),
            "client_rss_bytes": max(r["rss"] for r in mounted), **extra}


# -- one contender at every scale ----------------------------------------------------------------
def run_contender(kind: str, cfg: dict[str, Any], scales: list[int], clients: int, rnd: int,
                  cli_sample: int) -> dict[str, Any]:
    """Grow from 0 to each scale in turn (the sandboxes of the earlier scales stay mounted), measure at
    each checkpoint, then tear everything down. Each step's figures are for the sandboxes mounted in
    that step (e.g. the 9,000 that take the node from 1,000 to 10,000)."""
    tag = f"r{rnd}-{kind}-{clients}"
    settle()
    load_start = os.getloadavg()[0]
    base = snapshot()
    results: dict[str, Any] = {}
    done = 0
    # Scales are nested: phase k mounts scale[k] - scale[k-1] more while phase k-1's clients hold theirs.
    # Each phase is one run_phase whose checkpoint callback starts the next phase (so that all are
    # mounted at once when the next is measured), then the phases unmount innermost first.

    def phase(k: int) -> dict[str, Any]:
        nonlocal done
        n = scales[k] - (scales[k - 1] if k else 0)
        ids = [f"{tag}-{done + j}" for j in range(n)]
        done += n

        def checkpoint() -> dict[str, Any]:
            snap = snapshot()
            extra: dict[str, Any] = {"memory_per_sandbox": per_sandbox(base, snap, scales[k]),
                                     "mounted": scales[k]}
            extra.update(node_facts(kind, cfg, scales[k], cli_sample))
            log(f"{tag}: {scales[k]} mounted (load {os.getloadavg()[0]:.1f})")
            if k + 1 < len(scales):
                extra["next"] = phase(k + 1)
            return extra

        return run_phase(kind, cfg, tag, ids, clients, checkpoint)

    nested = phase(0)
    k = 0
    while nested is not None:
        nxt = nested.pop("next", None)
        results[str(scales[k])] = nested
        nested, k = nxt, k + 1
    for r in results.values():
        r["loadavg_1min"] = [round(load_start, 1), round(os.getloadavg()[0], 1)]  # at start, at end
    return results


SETTLE_S = 6.0


def settle() -> None:
    """Flush the previous contender's writes and pause, so that their writeback does not land in
    the next contender's measurement. (It does not undo what a mass teardown leaves on the node
    disk: measured, creating a sandbox's three directories costs 0.11 ms on a fresh ext4 and
    0.29 ms after 10,000 sandboxes' directories were deleted, still after a sync and 6 s. That is
    part of the spread between rounds; the round-robin order gives each contender both states.)"""
    os.sync()
    time.sleep(float(os.environ.get("LAYERSTORE_COMPOSE_SETTLE_S", SETTLE_S)))


def node_facts(kind: str, cfg: dict[str, Any], mounted: int, cli_sample: int) -> dict[str, Any]:
    """Measured at a checkpoint: the shim's state size, what reading the mount table costs, the CLI."""
    from fuse_client import linux

    facts: dict[str, Any] = {}
    t = time.perf_counter()
    with open("/proc/self/mountinfo", "rb") as f:
        size = len(f.read())
    read_s = time.perf_counter() - t
    t = time.perf_counter()
    n = len(linux.read_mounts())
    facts["mountinfo"] = {"bytes": size, "mounts": n, "read_ms": round(read_s * 1000, 2),
                          "read_and_parse_ms": round((time.perf_counter() - t) * 1000, 2)}
    t = time.perf_counter()
    subprocess.run(["unshare", "--mount", "true"], check=True)
    facts["new_mount_namespace_ms"] = round((time.perf_counter() - t) * 1000, 2)
    if kind.startswith("layerstore"):
        from runtime_shim.shim import Shim
        from runtime_shim.state import NodeState

        node = Path(cfg["node"])
        with NodeState(node / "state") as st:
            size_b = st.size()
        rec = next(node.glob("sandboxes/c*/sandbox.json"), None)
        facts["state"] = {"lmdb_used_bytes_per_sandbox": round(size_b["used"] / (mounted + 1)),  # + the anchor
                          "lmdb_file_bytes": size_b["file"],
                          "record_file_bytes": rec.stat().st_size if rec else None}
        t = time.perf_counter()
        shim = Shim.for_node(node, cfg["store"], auto_recover=False)
        t1 = time.perf_counter()
        shim.recover_if_needed()
        t2 = time.perf_counter()
        rep = shim.recover()
        t3 = time.perf_counter()
        daemon = None
        with shim.state.read() as txn:
            d = txn.daemon()
            daemon = d.pid if d else None
        shim.close()
        facts["shim_start_ms"] = round((t1 - t) * 1000, 2)
        facts["startup_recovery_check_ms"] = round((t2 - t1) * 1000, 2)
        facts["full_recover_ms"] = round((t3 - t2) * 1000, 1)
        facts["full_recover_changed"] = rep.changed
        facts["daemon_rss_bytes"] = rss(daemon) if daemon else None
        if cli_sample and kind == "layerstore-api":
            facts["cli"] = cli_round(cfg, cli_sample, f"{mounted}")
    return facts


def cli_round(cfg: dict[str, Any], n: int, tag: str) -> dict[str, Any]:
    """`layerctl mount` then `layerctl umount`, n each, as processes, one at a time."""
    targets = [Path(cfg["work"]) / "cli" / f"{tag}-{i}" for i in range(n)]
    ml, ul = [], []
    for tgt in targets:
        t = time.perf_counter()
        p = subprocess.run([LAYERCTL, "mount", "--node-dir", cfg["node"], "--store", cfg["store"], ENV_TAG, str(tgt)],
                           capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"layerctl mount: {p.stderr.strip()}")
        usable(str(tgt))
        ml.append(time.perf_counter() - t)
    for tgt in targets:
        t = time.perf_counter()
        p = subprocess.run([LAYERCTL, "umount", "--node-dir", cfg["node"], str(tgt)], capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"layerctl umount: {p.stderr.strip()}")
        ul.append(time.perf_counter() - t)
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    bare = time.perf_counter() - t
    return {"mount": stats(ml), "umount": stats(ul), "bare_python_start_ms": round(bare * 1000, 1)}


AB_BLOCK = 100


def durability_ab(cfg: dict[str, Any], blocks: int) -> dict[str, Any]:
    """The shim with (`fsync`) and without (`nosync`) a flush after each state transaction, in
    alternating blocks of AB_BLOCK mounts then AB_BLOCK teardowns, in one process: both see the
    same disk and the same load from elsewhere. About 1,000 sandboxes stay mounted meanwhile."""
    settle()
    variants = {"nosync": Api(Path(cfg["node"]), cfg["store"]), "fsync": Api(Path(cfg["node"]), cfg["store"],
                                                                               fsync=True)}
    for c in variants.values():
        c.open()
    lat: dict[str, dict[str, list[float]]] = {v: {"mount": [], "unmount": []} for v in variants}
    wall: dict[str, dict[str, float]] = {v: {"mount": 0.0, "unmount": 0.0} for v in variants}
    background = [variants["nosync"].mount(f"ab-bg-{i}")[0] for i in range(1000)]
    try:
        for b in range(blocks):
            name = ("nosync", "fsync")[b % 2]
            c = variants[name]
            handles = []
            t0 = time.perf_counter()
            for i in range(AB_BLOCK):
                t = time.perf_counter()
                h, target = c.mount(f"ab-{b}-{i}")
                usable(target)
                lat[name]["mount"].append(time.perf_counter() - t)
                handles.append(h)
            t1 = time.perf_counter()
            for h in handles:
                t = time.perf_counter()
                c.unmount(h)
                lat[name]["unmount"].append(time.perf_counter() - t)
            wall[name]["mount"] += t1 - t0
            wall[name]["unmount"] += time.perf_counter() - t1
    finally:
        for h in background:
            variants["nosync"].unmount(h)
        for c in variants.values():
            c.close()
    out: dict[str, Any] = {"blocks": blocks, "block": AB_BLOCK, "mounted_meanwhile": 1000}
    for name in variants:
        out[name] = {op: {"rate_per_s": round(len(lat[name][op]) / wall[name][op], 1), **stats(lat[name][op])}
                     for op in ("mount", "unmount")}
    return out


# -- the run -------------------------------------------------------------------------------------
def limits() -> dict[str, Any]:
    def read(p: str) -> str | None:
        try:
            return Path(p).read_text().strip()
        except OSError:
            return None

    import resource

    return {"fs.mount-max": read("/proc/sys/fs/mount-max"), "nofile": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
            "fs.inotify.max_user_watches": read("/proc/sys/fs/inotify/max_user_watches"),
            "fs.inotify.max_user_instances": read("/proc/sys/fs/inotify/max_user_instances"),
            "fs.file-max": read("/proc/sys/fs/file-max"), "user.max_mnt_namespaces":
            read("/proc/sys/user/max_mnt_namespaces")}


def machine() -> dict[str, Any]:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "unknown")
    return {"cpu": cpu, "cores": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version(),
            "loadavg_at_start": os.getloadavg()}


def median_results(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Numbers: median over the rounds; everything else from the first round."""
    first = rounds[0]
    if len(rounds) == 1:
        return first
    out: dict[str, Any] = {}
    for k, v in first.items():
        if isinstance(v, dict):
            out[k] = median_results([r[k] for r in rounds if isinstance(r.get(k), dict)])
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = round(statistics.median(r[k] for r in rounds if isinstance(r.get(k), (int, float))), 3)
        else:
            out[k] = v
    return out


def inner(args: argparse.Namespace) -> int:
    from fuse_client import linux
    from runtime_shim.shim import Shim

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
    work = Path(tempfile.mkdtemp(prefix="layerstore-compose-", dir=args.workdir))
    doc["workdir"] = str(work)
    try:
        log(f"building the environment in {work}")
        trees = make_trees(work)
        store, blobs = make_environment(work, trees)
        from fuse_client import linux

        (work / "plain-roots").mkdir()
        linux.bind_private(work / "plain-roots")
        node = work / "node"
        cfg = {"work": str(work), "node": str(node), "store": store, "trees": {k: str(v) for k, v in trees.items()}}
        shim = Shim.for_node(node, store)
        anchor = shim.mount(ENV_TAG, sandbox="anchor")  # starts the daemon, mounts the layers: warm
        usable(anchor.target)
        doc["environment"] = {"tag": ENV_TAG, "layers": blobs, "probes": list(PROBES)}
        contenders = [("plain-overlay", c) for c in args.clients] + [("layerstore-api", c) for c in args.clients]
        rounds: dict[str, list[dict[str, Any]]] = {}
        for rnd in range(args.rounds):
            # Rounds go over every contender before the next starts: load from elsewhere on a shared
            # machine spreads over all of them instead of hitting one.
            for kind, clients in contenders:
                cli = args.cli if clients == 1 and rnd == 0 else 0
                log(f"round {rnd + 1}: {kind}, {clients} client(s)")
                res = run_contender(kind, cfg, args.scales, clients, rnd, cli)
                rounds.setdefault(f"{kind}/clients={clients}", []).append(res)
        if args.ab_blocks:
            log(f"durability A/B: {args.ab_blocks} blocks of {AB_BLOCK}")
            doc["durability_ab"] = durability_ab(cfg, args.ab_blocks)
        if args.cli:
            doc["cli_at_1_mounted"] = cli_round(cfg, args.cli, "start")
        doc["results"] = {k: median_results(v) for k, v in rounds.items()}
        doc["rounds"] = args.rounds
        if args.rounds > 1:  # each round's headline figures, with the machine's load while it ran
            def headline(r: dict[str, Any]) -> dict[str, Any]:
                return {"mount": r["mount"], "unmount_rate_per_s": r["unmount"]["rate_per_s"],
                        "loadavg_1min": r["loadavg_1min"]}

            doc["per_round"] = {k: [{scale: headline(r[scale]) for scale in r} for r in v] for k, v in rounds.items()}
        shim.unmount(anchor.id)
        anchor = None
        shim.stop_daemon()
        shim.close()
        shim = None
        left = linux.mounts_under(linux.read_mounts(), str(work))
        doc["inner_check"] = {"mounts_left": [m.mountpoint for m in left]}
    finally:
        with contextlib.suppress(Exception):
            if shim is not None:
                for sb in shim.sandboxes():
                    with contextlib.suppress(Exception):
                        shim.unmount(sb.id)
                shim.stop_daemon()
                shim.close()
        from fuse_client import linux

        for m in linux.mounts_under(linux.read_mounts(), str(work)):
            with contextlib.suppress(Exception):
                linux.umount(m.mountpoint, lazy=True)
        shutil.rmtree(work, ignore_errors=True)
    doc["machine"]["loadavg_at_end"] = os.getloadavg()
    Path(args.inner_out).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


def leftovers(doc: dict[str, Any]) -> dict[str, Any]:
    """Seen from outside the run's namespace, after it ended: what is left of it."""
    work = doc.get("workdir", "/nonexistent")
    ns = doc.get("mount_namespace")
    procs, in_ns = [], []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if ns and os.readlink(f"/proc/{pid}/ns/mnt") == ns:
                in_ns.append(int(pid))
            if work.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                procs.append(int(pid))
        except OSError:
            continue
    loops = []
    for dev in Path("/sys/block").glob("loop*"):
        bf = dev / "loop" / "backing_file"
        with contextlib.suppress(OSError):
            if bf.exists() and bf.read_text().startswith(work):
                loops.append(dev.name)
    from fuse_client import linux

    mounts = [m.mountpoint for m in linux.mounts_under(linux.read_mounts(), work)]
    return {"processes": procs, "processes_in_namespace": in_ns, "loop_devices": loops, "mounts": mounts,
            "workdir_exists": os.path.exists(work),
            "clean": not (procs or in_ns or loops or mounts or os.path.exists(work))}


def make_cgroup() -> Path | None:
    """A memory cgroup (v1) for the run, under the one this process is in (so that whatever accounts
    for that one still sees the run), to charge the run's kernel memory to. None if there is none."""
    try:
        rel = next(ln.split(":", 2)[2] for ln in Path("/proc/self/cgroup").read_text().splitlines()
                   if ln.split(":", 2)[1] == "memory")
    except (OSError, StopIteration):
        return None
    cg = Path("/sys/fs/cgroup/memory") / rel.lstrip("/") / f"layerstore-compose-{os.getpid()}"
    try:
        cg.mkdir()
    except OSError:
        return None
    return cg


def remove_cgroup(cg: Path | None, wait: float = 0) -> list[int]:
    """Remove the run's cgroup; the processes still in it (none, after a clean run)."""
    deadline = time.monotonic() + wait
    while cg is not None:
        try:
            left = [int(x) for x in (cg / "cgroup.procs").read_text().split()]
        except OSError:
            return []
        if not left:
            with contextlib.suppress(OSError):
                cg.rmdir()
            return []
        if time.monotonic() > deadline:
            return left
        time.sleep(0.5)
    return []


def verdicts(doc: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, per in doc.get("results", {}).items():
        for scale, r in per.items():
            m = r.get("mount", {})
            out[f"{name}@{scale}"] = {
                "rate_ok": m.get("rate_per_s", 0) >= GOALS["rate_per_s"],
                "p99_ok": m.get("p99_ms", 1e9) <= GOALS["p99_ms"],
            }
    scales = [int(s) for per in doc.get("results", {}).values() for s in per]
    out["mounted_10000_ok"] = bool(scales) and max(scales) >= GOALS["mounted"] and doc.get("leftovers", {}).get("clean")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default=os.environ.get("BENCH_SIZE", "quick"))
    ap.add_argument("--scales", help="comma-separated numbers of mounted sandboxes (ascending)")
    ap.add_argument("--clients", help="comma-separated client counts")
    ap.add_argument("--cli", type=int, help="layerctl calls per CLI point (0: none)")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--ab-blocks", type=int, help=f"blocks of {100} sandboxes for the fsync A/B (0: none)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--workdir", default="/var/tmp", help="where the run's store, node and trees live")
    ap.add_argument("--inner-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    size = SIZES[args.size]
    args.scales = [int(x) for x in args.scales.split(",")] if args.scales else size["scales"]
    args.clients = [int(x) for x in args.clients.split(",")] if args.clients else size["clients"]
    args.cli = size["cli"] if args.cli is None else args.cli
    args.rounds = size["rounds"] if args.rounds is None else args.rounds
    args.ab_blocks = size["ab_blocks"] if args.ab_blocks is None else args.ab_blocks
    if os.geteuid() != 0:
        raise SystemExit("compose: needs root (mounts)")
    if os.environ.get(INNER_ENV):
        return inner(args)
    with tempfile.NamedTemporaryFile(prefix="compose-", suffix=".json", delete=False) as tmp:
        inner_out = tmp.name
    cgroup = make_cgroup()
    try:
        argv2 = [a for a in (argv if argv is not None else sys.argv[1:])]
        cmd = ["unshare", "--mount", "--propagation", "private", sys.executable, str(Path(__file__).resolve()),
               *argv2, "--inner-out", inner_out]
        env = {**os.environ, INNER_ENV: "1", **({CGROUP_ENV: str(cgroup)} if cgroup else {})}
        rc = subprocess.run(cmd, env=env).returncode
        text = Path(inner_out).read_text() if os.path.getsize(inner_out) else ""
    finally:
        with contextlib.suppress(OSError):
            os.unlink(inner_out)
    if rc != 0 or not text:
        log(f"the run failed (exit {rc})")
        remove_cgroup(cgroup, wait=30)
        return rc or 1
    doc = json.loads(text)
    deadline = time.monotonic() + 30  # the daemon may take a moment to exit after its mount went
    while True:
        doc["leftovers"] = leftovers(doc)
        cgroup_left = remove_cgroup(cgroup)  # (a multiprocessing helper may take a moment to exit)
        doc["leftovers"]["processes_in_cgroup"] = cgroup_left
        doc["leftovers"]["clean"] = doc["leftovers"]["clean"] and not cgroup_left
        if doc["leftovers"]["clean"] or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    doc["verdicts"] = verdicts(doc)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    log(f"wrote {args.out}; clean: {doc['leftovers']['clean']}")
    summary(doc)
    return 0 if doc["leftovers"]["clean"] else 1


def summary(doc: dict[str, Any]) -> None:
    ab = doc.get("durability_ab")
    if ab:
        for name in ("nosync", "fsync"):
            m, u = ab[name]["mount"], ab[name]["unmount"]
            log(f"durability A/B {name:6s}: mount {m['rate_per_s']:7.1f}/s p50 {m['p50_ms']:6.2f} "
                f"p99 {m['p99_ms']:6.2f} ms | unmount {u['rate_per_s']:7.1f}/s p99 {u['p99_ms']:6.2f} ms")
    for name, per in doc.get("results", {}).items():
        for scale, r in per.items():
            m, u, mem = r["mount"], r["unmount"], r["memory_per_sandbox"]
            log(f"{name:30s} {scale:>6s}: {m['rate_per_s']:7.1f}/s p50 {m['p50_ms']:6.2f} p99 {m['p99_ms']:6.2f} ms "
                f"cpu {m['cpu_ms']:5.2f} ms | unmount {u['rate_per_s']:6.1f}/s | kmem "
                f"{mem.get('cgroup_kmem_bytes', 0) / 1024:5.1f} KiB "
                f"(machine slab {mem['machine_slab_bytes'] / 1024:6.1f})")


if __name__ == "__main__":
    sys.exit(main())
