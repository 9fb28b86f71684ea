"""bench/gc.py at a tiny size on the local backend: it runs end to end (two rounds, so the
garbage is written back and collected again) and writes its JSON; and its check of what a
collection left catches a live object gone or corrupt."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.gcbench import fill, measure
from layerstore.backends.posix import PosixBackend
from layerstore.store import Store

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gc_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "gc.json"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "gc.py"), "--backends", "local", "--chunks", "400",
                        "--per-blob", "100", "--shared", "10", "--rounds", "2", "--workdir", str(tmp_path),
                        "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads(out.read_text())
    local = doc["results"]["local"]
    assert local["garbage_objects"] == 200 + 2 + 1  # chunks, chunk maps, one untagged environment
    assert local["live_objects"] == 200 + 2 + 2
    for r in local["rounds"]:
        assert r["gc"]["deleted"] == r["bare_delete"]["objects"] == local["garbage_objects"]
        assert r["gc"]["marked"] == local["live_objects"] and r["gc"]["missing"] == 0
        assert r["ratio"] > 0 and set(r["gc"]["phases"]) >= {"list", "mark", "sweep"}
    assert local["rounds"][0]["check"]["left"] == local["live_objects"]
    assert list(tmp_path.iterdir()) == [out]  # the work directory is gone


def test_check_catches_a_lost_live_chunk(tmp_path: Path) -> None:
    plan = fill.Plan(chunks=400, per_blob=100, shared=10)
    with Store(PosixBackend(tmp_path / "s", fsync=False)) as s:
        fill.fill(s, plan, 4, lambda msg: None)
    time.sleep(0.1)  # grace 0 keeps what is not older than the run, by the file system's coarse clock
    with Store.open(str(tmp_path / "s")) as store:
        gc, _ = measure.collect(store)
        measure.check(store, plan, gc)
        # present but not what its key names (the sample covers every live chunk at this size)
        store.backend.replace(plan.chunk_key(1), store.backend.load(plan.chunk_key(2)))
        with pytest.raises(SystemExit, match="does not read back"):
            measure.check(store, plan, gc)
        store.backend.delete(plan.chunk_key(0))  # shared with a garbage chunk map: marking must keep it
        with pytest.raises(SystemExit, match="live objects gone"):
            measure.check(store, plan, gc)
