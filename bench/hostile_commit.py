"""The long commit race: tests/runtime_shim/test_hostile_commit.py's race, 30 s per mode.

A runc sandbox keeps swapping, in its upper, a directory for a symlink to a host directory holding
a secret and a file for a FIFO and a device node, while commits run back to back: frozen through
the backends (the container is paused while its upper is read) and live (the untrusted walker
alone). Every commit must end before a deadline and either succeed with sandbox content only or
fail with a clear `BadInput`; the test asserts that, this script keeps the figures (commits,
outcomes, the longest commit, the swaps the sandbox made meanwhile).

Needs root, runc and busybox-static. Writes bench/results/hostile-commit.json (full) or
hostile-commit-quick.json. Usage: python bench/hostile_commit.py [--size quick|full]; `--size`
defaults to $BENCH_SIZE (as `make bench` sets it), else full: 30 s per mode (`LAYERSTORE_LONG_RACE=1`);
quick: the suite's own race length (3 s per mode, a few dozen commits: the same checks, fewer swaps).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=["quick", "full"], default=os.environ.get("BENCH_SIZE") or "full")
    size = ap.parse_args().size
    out = RESULTS / ("hostile-commit.json" if size == "full" else f"hostile-commit-{size}.json")
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "race.jsonl"
        env = dict(os.environ, LAYERSTORE_RACE_REPORT=str(report), LAYERSTORE_LONG_RACE="1" if size == "full" else "")
        argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                "tests/runtime_shim/test_hostile_commit.py", "-k", "race"]
        rc = subprocess.run(argv, cwd=ROOT, env=env).returncode
        runs = [json.loads(line) for line in report.read_text().splitlines()] if report.exists() else []
    doc = {"size": size, "machine": {"kernel": platform.release(), "cpus": os.cpu_count()}, "passed": rc == 0,
           "runs": runs}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    for run in runs:
        mode = "frozen" if run["freeze"] else "live"
        print(f"{mode:6} {run['commits']:5} commits in {run['seconds']:.0f} s: {run['outcomes']}, "
              f"longest {run['longest_commit_s']} s, {run['swaps']} swaps by the sandbox")
    print(f"{'passed' if rc == 0 else 'FAILED'}; results in {out.relative_to(ROOT)}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
