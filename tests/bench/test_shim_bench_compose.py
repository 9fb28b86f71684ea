"""bench/compose.py at a tiny size: it runs end to end on its default node disk (a fresh journaled
ext4 on a loop device), writes its JSON with every contender and measurement, and leaves nothing
behind, the loop device included (it checks that itself, from outside its namespace)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from testkit.shim_support import needs_busybox, needs_root

pytestmark = [needs_root, needs_busybox]
ROOT = Path(__file__).resolve().parents[2]  # the repository (this file is tests/bench/...)


def test_compose_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "compose.json"
    env = {**os.environ, "LAYERSTORE_COMPOSE_SETTLE_S": "0"}
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "compose.py"), "--scales", "20,50", "--clients", "1,2",
                        "--cli", "2", "--ab-blocks", "2", "--rounds", "1", "--out", str(out)],
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["leftovers"]["clean"], doc["leftovers"]
    assert not doc["leftovers"]["loop_devices"] and not doc["leftovers"]["mounts"]
    disk = doc["node_disk"]
    assert disk["kind"] == "loop-ext4-journal" and disk["journal"] is True, disk
    assert "has_journal" in disk["features"] and disk["mountpoint"].startswith(doc["workdir"] + "/")
    assert set(doc["results"]) == {"plain-overlay/clients=1", "plain-overlay/clients=2", "layerstore-api/clients=1",
                                   "layerstore-api/clients=2"}
    for per in doc["results"].values():
        assert set(per) == {"20", "50"}
        for r in per.values():
            assert r["mount"]["n"] in (20, 30) and r["mount"]["p99_ms"] > 0 and r["unmount"]["n"] in (20, 30)
            assert "cgroup_kmem_bytes" in r["memory_per_sandbox"] or not Path("/sys/fs/cgroup/memory").exists()
    api = doc["results"]["layerstore-api/clients=1"]["50"]
    assert api["lock_hold_per_mount"]["n"] == 30 and api["state"]["lmdb_used_bytes_per_sandbox"] > 0
    assert api["full_recover_changed"] is False and api["cli"]["mount"]["n"] == 2
    assert doc["durability_ab"]["fsync"]["mount"]["n"] == 100 == doc["durability_ab"]["nosync"]["mount"]["n"]
    assert not os.path.exists(doc["workdir"])
