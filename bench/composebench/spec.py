"""What the composition benchmark runs: sizes, goals, the environment's tag and probe files. Data only."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "bench" / "results" / "compose.json"
SIZES: dict[str, dict[str, Any]] = {
    # quick: the shim against the bare overlay at 1,000 and 3,000 mounted (mounting and tearing down
    # 10,000 of each took ~5 minutes at load 8-15: unmounts slow down with every mount in the table)
    "quick": {"scales": [1000, 3000], "clients": [1], "cli": 5, "rounds": 1, "ab_blocks": 2, "vs_plain_blocks": 0},
    "full": {"scales": [1000, 10000], "clients": [1, 4], "cli": 50, "rounds": 2, "ab_blocks": 20,
             "vs_plain_blocks": 10},
    # issue 19: the shim against the bare overlay at 10,000 and 30,000 mounted, 1 client (~10-15 min)
    "mounted30k": {"scales": [10000, 30000], "clients": [1], "cli": 0, "rounds": 1, "ab_blocks": 0,
                   "vs_plain_blocks": 10},
}
GOALS = {"rate_per_s": 200, "p99_ms": 50, "mounted": 10000}
# issue 19: the shim API's mount rate against the bare overlay's in the same run, and its p99
GOALS_VS_PLAIN = {"rate_ratio": 0.6, "p99_ms": 5.0}
INNER_ENV = "LAYERSTORE_COMPOSE_INNER"  # set: this process is the run inside its own mount namespace
CGROUP_ENV = "LAYERSTORE_COMPOSE_CGROUP"  # the run's memory cgroup, made by the outer process
SETTLE_ENV = "LAYERSTORE_COMPOSE_SETTLE_S"
SETTLE_S = 6.0
ENV_TAG = "compose:1"
PROBES = ("etc/motd", "opt/toolkit/VERSION", "workspace/README.md")  # one file of each layer
APPLETS = ["sh", "echo", "cat", "ls", "mkdir", "rm", "touch", "test", "true", "false", "head", "env", "id"]
LAYERCTL = str(Path(sys.executable).with_name("layerctl"))
AB_BLOCK = 100  # sandboxes per block of the durability A/B
AB_BACKGROUND = 1000  # sandboxes kept mounted during the A/B
VS_PLAIN_BLOCK = 200  # sandboxes per block of the interleaved shim / plain overlay A/B
CONTENDERS = ("plain-overlay", "layerstore-api")  # each with every client count of the size


def log(msg: str) -> None:
    print(f"compose: {msg}", file=sys.stderr, flush=True)
