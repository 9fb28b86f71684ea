"""What the in-process A/B benchmarks (bench/fetch_cpu.py, bench/s3_get_cpu.py) share: the commit
a checkout is at, and the results file they write (the figures, the parameters, the run's load
and duration, the machine)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any


def commit_of(checkout: Path) -> str | None:
    """The commit a checkout is at (what the figures are of), if it is a git work tree."""
    r = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() or None


def write_results(out_path: Path, benchmark: str, params: dict[str, Any], results: dict[str, Any], *,
                  started: float, load_at_start: tuple[float, float, float]) -> None:
    """Write the results file (`started`: the run's `time.monotonic()` at its start) and print it."""
    doc = {"benchmark": benchmark, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "params": params,
           "duration_s": round(time.monotonic() - started, 1), "loadavg_at_start": load_at_start,
           "loadavg_at_end": os.getloadavg(), "machine": {"cpus": os.cpu_count()}, "results": results}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    print(json.dumps(results, indent=1, sort_keys=True))
    print(f"results written to {out_path}")
