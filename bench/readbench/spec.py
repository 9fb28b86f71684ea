"""What the read benchmark runs: sizes, contenders, the reference, goals. Data only, no I/O."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
MiB = 1 << 20
LAYERCTL = str(Path(sys.executable).with_name("layerctl"))
DAEMON_ARGS: list[str] = []  # --daemon-arg: extra `layerctl daemon` arguments for every daemon (set by main)
# --daemon-probe: a tool attached to the daemon for each timed FUSE run (its summary in the results)
DAEMON_PROBES: dict[str, list[str]] = {
    "strace": ["strace", "-c", "-f"],  # system calls, per call and in all
    "perf": ["perf", "stat", "-e", "task-clock,page-faults,major-faults,context-switches,cpu-migrations"],
}
DAEMON_PROBE: list[str] = []  # the chosen one's command (set by main); empty: none
SIZES: dict[str, dict[str, int | str | bool]] = {
    # quick: every contender and workload still against erofs_local in the same rounds, and the S3
    # pair over loopback and one shaped link, at the fewest rounds that give a paired median; the
    # all-in-page-cache section (`--hot`) only at full
    "quick": {"big_mib": 128, "reps": 2, "s3_mib": 64, "s3_rates": "1000", "hot": False},
    "full": {"big_mib": 1024, "reps": 7, "s3_mib": 512, "s3_rates": "1000,4000", "hot": True},
}
SMALL_SOURCE = Path(f"/usr/lib/python{sys.version_info.major}.{sys.version_info.minor}")
REFERENCE = "erofs_local"
UNAVAILABLE = {
    "erofsfuse": "not packaged in Debian 12 (erofs-utils 1.5 ships no erofsfuse binary); building it from a "
                 "fetched erofs-utils tree may not be committed, so it is not a contender here",
}
GOALS = {  # (workload or "s3", contender or S3 link, minimum ratio)
    "warm_seq": ("seq", "fuse_warm", 0.95),
    "warm_seq_dio": ("seq", "fuse_warm_dio", 0.95),
    "warm_seq_promoted": ("seq", "promoted", 0.95),
    "warm_small": ("walk_hash", "fuse_warm", 0.9),
    "warm_small_dio": ("walk_hash", "fuse_warm_dio", 0.9),
    "warm_small_promoted": ("walk_hash", "promoted", 0.9),
    "warm_seq_fanotify": ("seq", "fanotify_warm", 0.97),
    "warm_small_fanotify": ("walk_hash", "fanotify_warm", 0.97),
    "warm_seq_fanotify_partial": ("seq", "fanotify_partial", 0.97),
    "warm_small_fanotify_partial": ("walk_hash", "fanotify_partial", 0.97),
    "cold_s3_loopback": ("s3", "loopback", 0.8),
}
S3_GOAL = 0.8  # each shaped link's goal (cold_s3_<rate>mbit)
# The daemon's CPU per GB fetched on a cold read: fanotify at most this fraction of FUSE's (issue 18),
# from the local store (fuse_cold vs fanotify_cold, per workload) and from S3 (each link).
COLD_CPU_GOAL = 0.5
PIN_HOLDER = "bench-read"
CONTENDERS = ["source", "erofs_local", "erofs_local_dio", "fuse_warm", "fuse_warm_dio", "promoted", "fuse_cold",
              "fuse_cold_dio", "fanotify_warm", "fanotify_partial", "fanotify_cold"]
HOT_CONTENDERS = ["source", "erofs_local", "erofs_local_dio", "fuse_warm", "fuse_warm_dio", "promoted"]
HIT_PATH_KERNEL_BLOCKS = ((4096, 20000), (128 * 1024, 4000), (MiB, 1000))  # (read size, reads per pass)
HIT_PATH_HANDLER_BLOCKS = ((4096, 100000), (128 * 1024, 20000), (MiB, 3000))
HIT_PATH_SPAN = 256 * MiB  # the hit-path reads cycle over at most this much of the blob


def default_out(size: str) -> Path:
    return RESULTS / ("read.json" if size == "full" else f"read-{size}.json")


def default_size() -> str:
    return os.environ.get("BENCH_SIZE") or "full"
