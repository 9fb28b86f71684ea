"""The collector against concurrent pushers, tag moves, removals and other collectors, on every
backend; and killed with -9 at random points. After every round, everything reachable from every
tag and live lease is present and verifies (docs/gc.md has the argument these tests check).

`LAYERSTORE_LONG_RACE=1` runs 1,000 local and 100 distributed rounds (the suite: 600 and 64, to keep
`make test` under 15 minutes on 2 cores)."""

from __future__ import annotations

import contextlib
import functools
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import layergc
import pytest
from testkit.gc_race import JitterBackend, blocks, check_reachable, content_keys, push_env, reachable_keys, run_threads

from layerstore import leases
from layerstore.backends import Backend, open_backend
from layerstore.backends.posix import PosixBackend
from layerstore.errors import NotFound
from layerstore.store import Store

LONG = os.environ.get("LAYERSTORE_LONG_RACE") == "1"
LOCAL_ROUNDS = 1000 if LONG else 600
DISTRIBUTED_ROUNDS = 100 if LONG else 64  # lanes of 4: whole waves


def _push(store: Callable[[], Store], tmp: Path, pool: list[bytes], rng: random.Random, ref: str) -> None:
    with store() as s:
        push_env(s, tmp, pool, rng, ref)


def _remove(store: Callable[[], Store], ref: str) -> None:
    with store() as s, contextlib.suppress(NotFound):
        s.delete_tag(ref)


def _collect(store: Callable[[], Store], reports: list[layergc.Report]) -> None:
    with store() as s:
        reports.append(layergc.collect(s, grace=0))


def _rounds(store_for: Callable[[], Backend], tmp: Path, rounds: int, seed: int, jitter: float,
            lanes: int = 1) -> dict[str, int]:
    """`rounds` rounds, `lanes` of them at once (a wave), each round: one or two pushers moving
    tags onto layers that share most chunks with what was just let go, a tag removal now and
    then, and one or two collectors (grace 0). The invariant is checked after every wave."""
    rng = random.Random(seed)
    pool = blocks(24, seed)
    refs = ["env/a:1", "env/a:2", "env/b:1"]
    stats = {"rounds": 0, "deleted": 0, "rescued": 0}

    def store() -> Store:
        return Store(JitterBackend(store_for(), jitter, seed=rng.random()), workers=4)

    def push() -> functools.partial[None]:
        return functools.partial(_push, store, tmp, pool, random.Random(rng.random()), rng.choice(refs))

    for wave in range(rounds // lanes):
        reports: list[layergc.Report] = []
        work = []
        for lane in range(lanes):
            n = wave * lanes + lane
            work += [push(), functools.partial(_collect, store, reports)]
            if n % 3 == 0:
                work.append(push())
            if n % 4 == 1:
                work.append(functools.partial(_collect, store, reports))  # two collectors at once
            if n % 5 == 2:
                work.append(functools.partial(_remove, store, rng.choice(refs)))
        rng.shuffle(work)
        errors = run_threads(*work)
        assert not errors, f"wave {wave}: {errors!r}"
        with Store(JitterBackend(store_for(), 0.0)) as s:
            problems = check_reachable(s)
        assert not problems, f"wave {wave}: {problems[:5]}"
        stats["rounds"] += lanes
        stats["deleted"] += sum(r.deleted.objects for r in reports)
        stats["rescued"] += sum(r.rescued.objects for r in reports)
    return stats


@pytest.mark.slow
def test_local_races(tmp_path: Path) -> None:
    """1,000 push/collect interleavings on the local backend."""
    root = tmp_path / "store"
    Store(PosixBackend(root)).init()
    shared = PosixBackend(root, fsync=False)
    stats = _rounds(lambda: shared, tmp_path, rounds=LOCAL_ROUNDS, seed=1, jitter=0.0002, lanes=2)
    assert stats["rounds"] == LOCAL_ROUNDS
    assert stats["deleted"] > LOCAL_ROUNDS  # the collectors really had garbage to take, round after round
    with Store(PosixBackend(root)) as s:
        layergc.collect(s, grace=0)
        assert content_keys(s) == reachable_keys(s)  # a quiet run after all that leaves only what is reachable


@pytest.mark.ceph
@pytest.mark.parametrize("kind", ["cephfs", "s3"])
def test_distributed_races(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """100 interleavings each on CephFS and on S3 (radosgw)."""
    url = request.getfixturevalue(f"{kind}_store_url")
    with Store.open(url) as s:
        s.init()
    with contextlib.closing(open_backend(url)) as shared:
        stats = _rounds(lambda: shared, tmp_path, rounds=DISTRIBUTED_ROUNDS, seed=2, jitter=0.0005, lanes=4)
    assert stats["rounds"] == DISTRIBUTED_ROUNDS and stats["deleted"] > DISTRIBUTED_ROUNDS
    with Store.open(url) as s:
        layergc.collect(s, grace=0)
        assert content_keys(s) == reachable_keys(s)


_KILLED_COLLECTOR = """
import sys
from testkit.gc_race import JitterBackend
from layerstore.backends.posix import PosixBackend
from layerstore.store import Store
import layergc
store = Store(JitterBackend(PosixBackend(sys.argv[1], fsync=False), 0.004), workers=4)
print("ready", flush=True)
layergc.collect(store, grace=0, run_ttl=2.0)
print("finished", flush=True)
"""


@pytest.mark.slow
def test_kill_collector_at_random_points(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """kill -9 of a collector at random points while a pusher runs: what is reachable stays, and
    a rerun removes everything that is not."""
    monkeypatch.setattr(leases, "SKEW", 0.5)  # a dead run binds writers for run_ttl + SKEW
    root = tmp_path / "store"
    Store(PosixBackend(root)).init()
    rng = random.Random(3)
    pool = blocks(24, 3)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    phases_hit = set()
    for n in range(24):
        proc = subprocess.Popen([sys.executable, "-c", _KILLED_COLLECTOR, str(root)], stdout=subprocess.PIPE,
                                env=env, text=True)
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            pusher_rng = random.Random(rng.random())

            def push(r: random.Random = pusher_rng, ref: str = f"env/k:{n % 3}") -> None:
                with Store(JitterBackend(PosixBackend(root, fsync=False), 0.001)) as s:
                    push_env(s, tmp_path, pool, r, ref)

            pusher = threading.Thread(target=push)
            pusher.start()
            time.sleep(rng.random() * 0.4)
            os.kill(proc.pid, signal.SIGKILL)
            pusher.join()
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        with Store(PosixBackend(root)) as s:
            runs = list(leases.read_runs(s.backend))
            phases_hit.update(r.state for r in runs if r.state != "done")
            assert not check_reachable(s), f"kill {n}"
    assert "sweeping" in phases_hit  # some kills landed mid-sweep
    time.sleep(2.6)  # the dead runs' records expire
    with Store(PosixBackend(root)) as s:
        layergc.collect(s, grace=0)
        assert not check_reachable(s)
        assert content_keys(s) == reachable_keys(s)
