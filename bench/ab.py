"""The standing A/B: this checkout against another commit, the read, compose and fetch-CPU benches
interleaved round by round in the same minutes, each figure's ratio (this / base) with its spread.

    python bench/ab.py --base COMMIT [--this COMMIT] [--rounds N] [--size quick|full]
                       [--benches read,compose,fetch_cpu] [--read-contenders erofs_local,fuse_warm,promoted]
                       [--read-reps N] [--out FILE]
    make bench-ab BASE=<commit> [ROUNDS=5] [SIZE=quick] [BENCHES=read,compose,fetch_cpu]

The base is checked out (detached) in a git worktree under bench/.cache/ab-<commit> (made once, kept
for the next run; `git worktree remove` it to clean up) and its containerd stubs are generated. Each
round runs every bench once for each side, the side that goes first alternating round by round (the
one after a heavy run starts on a busier machine), so both see the same minutes of a shared machine.

What a side is, per bench:
- read (bench/read.py --reps 1 or `--read-reps`, the same --big-mib for both, no S3, hot or hit-path
  sections): each side's own bench in its own tree (store and chunk-map formats change between commits, so one
  side's harness cannot feed the other's daemon). Figures: each contender's ratio to EROFS on a
  local file in that round (bench/read.py's paired ratio), per workload: `read.<workload>.<contender>`;
  for FUSE contenders also the daemon's misses and CPU ms per FUSE request.
- compose (bench/compose.py): each side's own bench in its own tree. Figures: the shim's mount rate
  over the bare overlay's in the same run (`compose.<scale>.rate_vs_plain`), its CPU ms and p99 ms
  per mount.
- fetch_cpu (bench/fetch_cpu.py --peer BASE --rounds 1): one child per side, already interleaved
  by the bench. Figures: CPU per GB (big chunks) and per chunk (small) of each side.

Printed per figure: each side's median over the rounds with its range, and the median of the
same-round ratios this/base with their range (for read ratios higher is better; for CPU and ms
lower is better). Written to bench/results/ab-<size>-<this>-vs-<base>.json (or --out) with every
round's figures and the load averages. A side whose bench fails in a round (e.g. a base without
that bench or contender) is recorded as failed there and the run goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "bench" / ".cache"
RESULTS = ROOT / "bench" / "results"
BENCHES = ("read", "compose", "fetch_cpu")
READ_CONTENDERS = "erofs_local,fuse_warm,promoted"
READ_BIG_MIB = {"quick": 128, "full": 1024}  # bench/read.py --big-mib
REFERENCE = "erofs_local"


def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", "-C", str(cwd), *args], check=True, capture_output=True, text=True).stdout.strip()


def base_checkout(commit: str) -> Path:
    """A detached worktree of `commit` under bench/.cache (made once), its protobuf stubs generated."""
    sha = git("rev-parse", "--verify", f"{commit}^{{commit}}")
    tree = CACHE / f"ab-{sha[:12]}"
    if not (tree / ".git").exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        git("worktree", "add", "--detach", str(tree), sha)
    if (tree / "snapshotter" / "protoc.py").exists():
        subprocess.run([sys.executable, "-m", "snapshotter.protoc"], cwd=tree, env=side_env(tree), check=False,
                       capture_output=True)
    return tree


def side_env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{tree / 'tests' / 'support'}"}


def run_json(cmd: list[str], *, cwd: Path, env: dict[str, str], out: Path, log: Path) -> dict[str, Any]:
    """Run a bench that writes its results to `out`; its output goes to `log`."""
    with open(log, "ab") as f:
        f.write(f"\n$ {' '.join(cmd)}\n".encode())
        f.flush()
        r = subprocess.run(cmd, cwd=cwd, env=env, stdout=f, stderr=f)
    if r.returncode != 0:
        raise RuntimeError(f"{cmd[1]} exited with {r.returncode} (see {log})")
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def read_figures(tree: Path, args: argparse.Namespace, tmp: Path, log: Path) -> dict[str, float]:
    out = tmp / "read.json"
    script = tree / "bench" / "read.py"
    # the same data for both sides (the sizes' defaults moved), and no sections beside the rounds
    extra = ["--no-hit-path"] if "--hit-path" in script.read_text() else []
    doc = run_json([sys.executable, str(script), "--size", args.size, "--big-mib", str(READ_BIG_MIB[args.size]),
                    "--reps", str(args.read_reps), "--no-s3", "--no-hot", *extra, "--contenders", args.read_contenders,
                    "--out", str(out)], cwd=tree, env=side_env(tree), out=out, log=log)
    figs = {}
    for workload, per in doc["ratio_to_erofs_local"].items():
        for contender, r in per.items():
            if contender != REFERENCE:
                figs[f"read.{workload}.{contender}"] = r["paired_median"]
            fuse = doc["results"].get(workload, {}).get(contender, {}).get("fuse")
            if fuse and fuse.get("requests"):  # the daemon's side: misses, CPU per FUSE request
                figs[f"read.{workload}.{contender}.misses"] = fuse["misses"]
                figs[f"read.{workload}.{contender}.daemon_cpu_ms_per_request"] = round(
                    fuse["daemon_cpu_s"] / fuse["requests"] * 1e3, 3)
                # The same cost to the nanosecond (the trio thread's schedstat; the process CPU
                # above counts 10 ms ticks: 26 against 33 ticks is no difference), and the request
                # size (a change there is a kernel-option effect, not the daemon's).
                if (us := fuse.get("daemon_main_thread_us_per_request")) is not None:
                    figs[f"read.{workload}.{contender}.daemon_main_us_per_request"] = us
                if (faults := fuse.get("daemon_faults_per_request")) is not None:
                    figs[f"read.{workload}.{contender}.daemon_faults_per_request"] = faults
                if (kib := fuse.get("mean_request_KiB")) is not None:
                    figs[f"read.{workload}.{contender}.mean_request_KiB"] = kib
    return figs


def compose_figures(tree: Path, args: argparse.Namespace, tmp: Path, log: Path) -> dict[str, float]:
    out = tmp / "compose.json"
    doc = run_json([sys.executable, "bench/compose.py", "--size", args.size, "--out", str(out)],
                   cwd=tree, env=side_env(tree), out=out, log=log)
    res = doc["results"]
    figs = {}
    for key, per in res.items():
        if not key.startswith("layerstore-api/"):
            continue
        plain = res.get(key.replace("layerstore-api/", "plain-overlay/"), {})
        clients = key.split("=")[-1]
        for scale, r in per.items():
            m = r.get("mount", {})
            name = f"compose.c{clients}@{scale}"
            if m.get("rate_per_s") and plain.get(scale, {}).get("mount", {}).get("rate_per_s"):
                figs[f"{name}.rate_vs_plain"] = round(m["rate_per_s"] / plain[scale]["mount"]["rate_per_s"], 3)
            for k in ("cpu_ms", "p99_ms"):
                if k in m:
                    figs[f"{name}.{k}"] = m[k]
    return figs


def fetch_cpu_pair(this: Path, base: Path, args: argparse.Namespace, tmp: Path,
                   log: Path) -> dict[str, dict[str, float]]:
    """Both sides at once (the bench interleaves its own children): {"this": ..., "base": ...}."""
    out = tmp / "fetch_cpu.json"
    doc = run_json([sys.executable, str(this / "bench" / "fetch_cpu.py"), "--size", args.size, "--rounds", "1",
                    "--peer", str(base), "--out", str(out)], cwd=this, env=side_env(this), out=out, log=log)
    res = doc["results"]
    return {side: {"fetch_cpu.big.cpu_s_per_GB": res[key]["big"]["cpu_s_per_GB_median"],
                   "fetch_cpu.small.cpu_us_per_chunk": res[key]["small"]["cpu_us_per_chunk_median"]}
            for side, key in (("this", "this"), ("base", "peer"))}


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}]" if xs else "-"


def summary(rounds: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    names = sorted({n for r in rounds for side in ("this", "base") for n in r[side]})
    out = {}
    for n in names:
        a = [r["this"][n] for r in rounds if n in r["this"]]
        b = [r["base"][n] for r in rounds if n in r["base"]]
        ratios = [r["this"][n] / r["base"][n] for r in rounds if n in r["this"] and r["base"].get(n)]
        out[n] = {"this": a, "base": b, "this_median": statistics.median(a) if a else None,
                  "base_median": statistics.median(b) if b else None,
                  "ratio_paired": [round(x, 3) for x in ratios],
                  "ratio_paired_median": round(statistics.median(ratios), 3) if ratios else None}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the commit to compare against")
    ap.add_argument("--this", default=None, metavar="COMMIT",
                    help="compare this commit (checked out as the base is) instead of this checkout: a bisection step")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--size", choices=("quick", "full"), default=os.environ.get("BENCH_SIZE") or "quick")
    ap.add_argument("--benches", default=",".join(BENCHES))
    ap.add_argument("--read-contenders", default=READ_CONTENDERS,
                    help="bench/read.py contenders (erofs_local, the reference, is always added)")
    ap.add_argument("--read-reps", type=int, default=1,
                    help="bench/read.py rounds per A/B round (its paired median is the round's figure)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    benches = [b for b in args.benches.split(",") if b]
    if unknown := set(benches) - set(BENCHES):
        ap.error(f"unknown bench: {', '.join(sorted(unknown))} (known: {', '.join(BENCHES)})")
    if REFERENCE not in args.read_contenders.split(","):
        args.read_contenders = f"{REFERENCE},{args.read_contenders}"
    if os.geteuid() != 0 and ("read" in benches or "compose" in benches):
        print("needs root (the read and compose benches mount)", file=sys.stderr)
        return 2
    base = base_checkout(args.base)
    this = base_checkout(args.this) if args.this else ROOT
    this_commit = git("rev-parse", "--short", "HEAD", cwd=this)
    base_commit = git("rev-parse", "--short", "HEAD", cwd=base)
    dirty = bool(git("status", "--porcelain", "--untracked-files=no", cwd=this))
    out = args.out or RESULTS / f"ab-{args.size}-{this_commit}-vs-{base_commit}.json"
    log = CACHE / f"{out.stem}.log"  # (the benches' own output: bulky, not a result)
    print(f"A/B: this {this_commit}{' (uncommitted changes)' if dirty else ''} vs base {base_commit} ({base}); "
          f"{args.rounds} rounds of {','.join(benches)} at {args.size}; bench output in {log}", flush=True)
    rounds: list[dict[str, Any]] = []
    failures: list[str] = []
    t0 = time.monotonic()
    for rnd in range(args.rounds):
        order = [("this", this), ("base", base)] if rnd % 2 == 0 else [("base", base), ("this", this)]
        got: dict[str, Any] = {"this": {}, "base": {}, "load_start": os.getloadavg()}
        with tempfile.TemporaryDirectory(prefix="ab-", dir="/var/tmp") as tmp:
            for bench in benches:
                if bench == "fetch_cpu":
                    try:
                        for side, figs in fetch_cpu_pair(this, base, args, Path(tmp), log).items():
                            got[side].update(figs)
                    except (RuntimeError, KeyError, ValueError) as e:
                        failures.append(f"round {rnd} fetch_cpu: {e}")
                    continue
                fn = read_figures if bench == "read" else compose_figures
                for side, tree in order:
                    try:
                        got[side].update(fn(tree, args, Path(tmp), log))
                    except (RuntimeError, KeyError, ValueError) as e:
                        failures.append(f"round {rnd} {bench} {side}: {e}")
        got["load_end"] = os.getloadavg()
        rounds.append(got)
        print(f"round {rnd} (first: {order[0][0]}; load {got['load_start'][0]:.1f}-{got['load_end'][0]:.1f}): "
              + ", ".join(f"{n} {got['this'][n]:.3f}/{got['base'].get(n, float('nan')):.3f}"
                          for n in sorted(got["this"])), flush=True)
    figs = summary(rounds)
    print(f"\n{'figure':52s} {'this: median [range]':>24s} {'base: median [range]':>24s} {'this/base paired':>24s}")
    for n, f in figs.items():
        print(f"{n:52s} {spread(f['this']):>24s} {spread(f['base']):>24s} {spread(f['ratio_paired']):>24s}")
    for line in failures:
        print(f"failed: {line}")
    loads = [r["load_start"][0] for r in rounds] + [r["load_end"][0] for r in rounds]
    doc = {"benchmark": "ab", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "this": this_commit, "this_dirty": dirty, "base": base_commit,
           "params": {"rounds": args.rounds, "size": args.size, "benches": benches,
                      "read_contenders": args.read_contenders, "read_reps": args.read_reps},
           "load_1min": {"min": min(loads), "max": max(loads)}, "provisional": max(loads) > 4,
           "duration_s": round(time.monotonic() - t0, 1), "machine": {"cpus": os.cpu_count()},
           "figures": figs, "rounds": rounds, "failures": failures}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    print(f"load {min(loads):.1f}-{max(loads):.1f}{' (provisional: above 4)' if doc['provisional'] else ''}; "
          f"results written to {out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
