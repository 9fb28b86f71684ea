"""Sandbox creation with runc against crun, through the shim's own container backends (issue 19).

The same shim, the same composed root (the tiny busybox environment, warm: its layers are in the node
cache), the same bundle; only the OCI runtime differs. crun runs as the shim runs it on this machine:
crun 1.8.1 refuses the hybrid cgroup layout, so the shim's crun backend wraps every call in a private
mount namespace with /sys/fs/cgroup/unified unmounted (`unshare` + `sh`): that wrapper is part of
what crun costs here, and is measured with it.

Two measurements, runtimes alternated so that neither always goes first:
- one at a time: prepare (bundle) -> `run` (create, start, the task `true`, exit) -> `delete`;
- a burst: K sandboxes at once per runtime (one thread each), wall time to the last exit.

`--private-mount-ns`: the whole benchmark runs once in a private mount namespace with
/sys/fs/cgroup/unified unmounted, so crun needs no wrapper per call (what a node agent that lives in
such a namespace would pay); runc runs in the same namespace.

Needs root. Writes bench/results/sandbox_runtime.json (or sandbox_runtime-private-ns.json). Does not
change the shim's default.

    python bench/sandbox_runtime.py [--sandboxes N] [--burst N] [--rounds N] [--private-mount-ns]

Defaults from $BENCH_SIZE (as `make bench` sets it), else quick: 10 one at a time per runtime, 2
bursts of 16; full: 60, 4 bursts of 32.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)

from bench.burst import inputs, spec  # noqa: E402
from bench.burst.lazy import LayerstoreNode, LayerstoreSetup, layerctl, sweep_mounts  # noqa: E402

RUNTIMES = ("runc", "crun")
COMMAND = ["/bin/sh", "-c", "exit 0"]


def version(binary: str) -> str:
    p = subprocess.run([binary, "--version"], capture_output=True, text=True)
    return p.stdout.splitlines()[0] if p.returncode == 0 and p.stdout else "?"


def one(shim: Any, runtime: str, sid: str, env_spec: Any) -> dict[str, Any]:
    """One sandbox through `runtime`: the shim's steps (mount, bundle, run, delete, unmount), timed."""
    from runtime_shim.node.request import MountRequest

    sb = shim.mount(MountRequest(env_spec, sandbox=sid))
    out: dict[str, Any] = {"runtime": runtime}
    try:
        backend = shim.backend(runtime)
        t0 = time.perf_counter()
        backend.prepare(sb, COMMAND)
        t1 = time.perf_counter()
        ex = backend.start(sb.id, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        rc = backend.wait(ex)
        t2 = time.perf_counter()
        err = ex.process.stderr.read().decode(errors="replace")[-400:] if ex.process.stderr else ""
        backend.delete(sb.id)
        t3 = time.perf_counter()
        out.update(rc=rc, prepare_s=t1 - t0, run_s=t2 - t1, delete_s=t3 - t2, total_s=t3 - t0,
                   error=err if rc else "")
    except Exception as e:  # noqa: BLE001 - a runtime that cannot run here is a result
        out.update(rc=None, error=f"{type(e).__name__}: {e}"[-400:])
    finally:
        shim.unmount(sb.id)
    return out


def burst(shim: Any, runtime: str, k: int, tag: str, env_spec: Any) -> dict[str, Any]:
    results: list[dict[str, Any]] = [{} for _ in range(k)]

    def go(i: int) -> None:
        results[i] = one(shim, runtime, f"rt-{tag}-{runtime}-{i}", env_spec)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(k)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"runtime": runtime, "sandboxes": k, "wall_s": wall, "failed": sum(1 for r in results if r.get("rc") != 0),
            "run_s_median": statistics.median(r["run_s"] for r in results if "run_s" in r) if any(
                "run_s" in r for r in results) else None}


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in rows if r.get("rc") == 0]
    out: dict[str, Any] = {"runs": len(rows), "failed": len(rows) - len(ok)}
    for k in ("prepare_s", "run_s", "delete_s", "total_s"):
        vals = sorted(r[k] for r in ok)
        if vals:
            out[f"{k}_median"] = round(statistics.median(vals), 4)
            out[f"{k}_p90"] = round(vals[min(len(vals) - 1, int(0.9 * (len(vals) - 1) + 0.5))], 4)
    errors = sorted({r["error"] for r in rows if r.get("error")})
    if errors:
        out["errors"] = errors[:3]
    return out


def main(argv: list[str] | None = None) -> int:
    size = os.environ.get("BENCH_SIZE", "quick")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sandboxes", type=int, default=10 if size == "quick" else 60, help="one at a time, per runtime")
    ap.add_argument("--burst", type=int, default=16 if size == "quick" else 32, help="sandboxes at once")
    ap.add_argument("--rounds", type=int, default=2 if size == "quick" else 4, help="bursts per runtime")
    ap.add_argument("--output", type=Path, default=None)
    ap.add_argument("--private-mount-ns", action="store_true",
                    help="run in a private mount namespace without /sys/fs/cgroup/unified (crun unwrapped)")
    a = ap.parse_args(argv)
    if min(a.sandboxes, a.burst, a.rounds) < 1:
        ap.error("--sandboxes, --burst and --rounds must be at least 1")
    if os.geteuid() != 0:
        print("sandbox_runtime: needs root (mounts, runc, crun)", file=sys.stderr)
        return 2
    mode = "private-ns" if a.private_mount_ns else "shim-wrapped"
    if a.output is None:
        a.output = REPO / "bench" / "results" / ("sandbox_runtime-private-ns.json" if a.private_mount_ns
                                                 else "sandbox_runtime.json")
    if a.private_mount_ns and os.environ.get("LAYERSTORE_RUNTIME_BENCH_NS") != "1":
        argv2 = [sys.executable, str(Path(__file__).resolve()), *(argv if argv is not None else sys.argv[1:])]
        if "--output" not in argv2:
            argv2 += ["--output", str(a.output)]
        script = 'umount -l /sys/fs/cgroup/unified 2>/dev/null; exec "$@"'
        return subprocess.run(["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c", script,
                               "runtime-bench", *argv2], env={**os.environ, "LAYERSTORE_RUNTIME_BENCH_NS": "1"}
                              ).returncode
    missing = [b for b in (*RUNTIMES, "unshare") if shutil.which(b) is None]
    work = inputs.run_root().with_name(f"layerstore-bench-runtime-{os.getpid()}")
    store_url = f"file://{work}/store"
    node: LayerstoreNode | None = None
    results: dict[str, Any] = {
        "benchmark": "sandbox_runtime", "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release()},
        "cgroups": sorted(p.name for p in Path("/sys/fs/cgroup").iterdir()) if Path("/sys/fs/cgroup").is_dir() else [],
        "versions": {b: version(b) for b in RUNTIMES if shutil.which(b)}, "missing": missing,
        "load_before": os.getloadavg(), "command": COMMAND, "mode": mode,
        "unified_mounted": os.path.ismount("/sys/fs/cgroup/unified"),
    }
    try:
        work.mkdir(parents=True, exist_ok=True)
        layers = inputs.build_all((spec.TINY.name,))
        setup = LayerstoreSetup(store_url=store_url, layers=layers, environments=(spec.TINY.name,), work=work / "setup")
        setup.push_and_create()
        node = LayerstoreNode(work / "node", store_url=store_url, env_refs=setup.env_refs, eager=False,
                              layerctl=layerctl())
        shim = node.shim
        env_spec = shim.resolve(setup.env_refs[spec.TINY.name])
        runtimes = [r for r in RUNTIMES if shutil.which(r)]
        for rt in runtimes:  # warm: the layers in the node cache, each runtime's binary in the page cache
            one(shim, rt, f"rt-warm-{rt}", env_spec)
        rows: list[dict[str, Any]] = []
        for i in range(a.sandboxes):
            order = runtimes if i % 2 == 0 else runtimes[::-1]
            rows += [one(shim, rt, f"rt-seq-{rt}-{i}", env_spec) for rt in order]
        results["one_at_a_time"] = {rt: summary([r for r in rows if r["runtime"] == rt]) for rt in runtimes}
        bursts: list[dict[str, Any]] = []
        for r in range(a.rounds):
            order = runtimes if r % 2 == 0 else runtimes[::-1]
            bursts += [burst(shim, rt, a.burst, f"b{r}", env_spec) for rt in order]
        results["burst"] = {rt: {"rounds": [b for b in bursts if b["runtime"] == rt],
                                 "wall_s_median": round(statistics.median(b["wall_s"] for b in bursts
                                                                          if b["runtime"] == rt), 4)}
                            for rt in runtimes}
        seq = results["one_at_a_time"]
        if all(seq.get(rt, {}).get("total_s_median") for rt in RUNTIMES):
            results["crun_over_runc"] = {
                "one_at_a_time_total": round(seq["crun"]["total_s_median"] / seq["runc"]["total_s_median"], 3),
                "one_at_a_time_run": round(seq["crun"]["run_s_median"] / seq["runc"]["run_s_median"], 3),
                "burst_wall": round(results["burst"]["crun"]["wall_s_median"]
                                    / results["burst"]["runc"]["wall_s_median"], 3)}
        results["load_after"] = os.getloadavg()
    finally:
        if node is not None:
            node.teardown()
        sweep_mounts(work)
        shutil.rmtree(work, ignore_errors=True)
    a.output.parent.mkdir(parents=True, exist_ok=True)
    a.output.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps({k: results.get(k) for k in ("versions", "one_at_a_time", "crun_over_runc", "load_before",
                                                  "load_after")}, indent=1))
    failed = sum(v.get("failed", 0) for v in results.get("one_at_a_time", {}).values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
