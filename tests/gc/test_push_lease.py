"""A push's layers survive garbage collection until an environment names them: `build --push`
leaves a `push-kept-` lease, `env create` releases it once its tag keeps the layers (docs/gc.md,
"A push's layers until an environment names them"). Checked through the CLI, as the README's
flow runs, beside a collector looping with grace 0 on the local, CephFS and S3 backends.
`LAYERSTORE_LONG_RACE=1` runs 20 flows per backend (the suite: 10, each two CLI processes)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import layergc
import pytest
from testkit.cli_helpers import layerctl
from testkit.gc_race import JitterBackend, check_reachable, content_keys, reachable_keys

from layerstore import keys, leases
from layerstore.backends.posix import PosixBackend
from layerstore.errors import NotFound
from layerstore.store import Store

FLOWS = 20 if os.environ.get("LAYERSTORE_LONG_RACE") == "1" else 10


def _tree(root: Path, i: int) -> Path:
    """A small tree of its own (no chunk shared with another flow's, so each layer is garbage
    the moment nothing holds it)."""
    root.mkdir(parents=True)
    (root / "data").write_bytes(f"flow {i}\n".encode() * 2000 + os.urandom(8192))
    (root / "sub").mkdir()
    (root / "sub" / "small").write_bytes(os.urandom(300))
    return root


def _build(url: str, src: Path) -> dict[str, object]:
    r = layerctl("build", str(src), "--push", "--store", url, "--json")
    assert r.code == 0, r.err
    out = r.json()
    assert isinstance(out, dict)
    return out


def _live_kept(url: str) -> list[str]:
    with Store.open(url) as s:
        now = time.time()
        return [x.id for x in leases.read_leases(s.backend) if x.live(now) and x.id.startswith(leases.PUSH_KEPT)]


def test_gc_between_build_and_env_create_keeps_the_layer(tmp_path: Path) -> None:
    """The failure of issue 30, made certain: a collector with grace 0 runs after `build --push`
    and before `env create`. Without the push's lease it deletes the layer and env create fails
    ("layer blob ... is not in store")."""
    url = str(tmp_path / "store")
    with Store.open(url) as s:
        s.init()
    built = _build(url, _tree(tmp_path / "src", 0))
    blob = str(built["blob"])
    with Store.open(url) as s:
        report = layergc.collect(s, grace=0)
        assert s.backend.exists(keys.object_key("blobs", blob))
    r = layerctl("env", "create", "--store", url, "--base", blob, "-t", "app:1", "--json")
    assert r.code == 0, r.err
    assert report.kept_lease.objects >= 2  # the chunk map and its chunks
    lease_id = str(built["lease"])
    assert lease_id.startswith("push-kept-") and float(built["lease_expires"]) > time.time() + 3000  # 1 h default
    assert r.json()["released_leases"] == [lease_id]
    assert _live_kept(url) == []
    with Store.open(url) as s:
        assert layergc.collect(s, grace=0).deleted.objects == 0  # the tag keeps it now
        assert check_reachable(s) == []
        s.delete_tag("app:1")
        assert layergc.collect(s, grace=0).deleted.objects > 0
        assert content_keys(s) == set()


@pytest.mark.slow  # about 3-5 s: kept out of `make check`'s 2 minutes
def test_an_unreleased_lease_expires_and_env_create_leaves_others(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                  ) -> None:
    """A build whose `env create` never comes keeps its layer only for --lease-ttl; an
    environment that names only one of two pushes' layers releases only that push's lease."""
    url = str(tmp_path / "store")
    with Store.open(url) as s:
        s.init()
    short = layerctl("build", str(_tree(tmp_path / "a", 1)), "--push", "--store", url, "--json", "--lease-ttl", "1s")
    assert short.code == 0, short.err
    other = _build(url, _tree(tmp_path / "b", 2))
    r = layerctl("env", "create", "--store", url, "--base", str(short.json()["blob"]), "-t", "a:1", "--json")
    assert r.code == 0, r.err
    assert r.json()["released_leases"] == [short.json()["lease"]]
    assert _live_kept(url) == [other["lease"]]
    bad = layerctl("build", str(tmp_path / "a"), "--push", "--store", url, "--lease-ttl", "0s")
    assert bad.code != 0 and "--lease-ttl" in bad.err

    expiring = layerctl("build", str(_tree(tmp_path / "c", 3)), "--push", "--store", url, "--json",
                        "--lease-ttl", "1s").json()
    time.sleep(1.2)
    monkeypatch.setattr(leases, "SKEW", 0.0)  # this test's one clock: no skew to allow for
    with Store.open(url) as s:
        layergc.collect(s, grace=0)
        with pytest.raises(NotFound):
            s.get_chunk_map(str(expiring["blob"]))
        s.get_chunk_map(str(other["blob"]))  # still held by its 1 h lease
        layergc.collect(s, grace=0)  # housekeeping took the expired lease
        assert [x.id for x in leases.read_leases(s.backend)] == [other["lease"]]


class _PausedAfterLeaseRead(JitterBackend):
    """The collector's backend: its first read of the leases (step 4) is answered from before a
    pause, so the push that runs during the pause is unknown to its mark."""

    def __init__(self, inner: PosixBackend) -> None:
        super().__init__(inner, 0.0)
        self.reading, self.go = threading.Event(), threading.Event()

    def list(self, prefix: str = "") -> Iterator[str]:
        found = list(self.inner.list(prefix))
        if prefix.startswith(leases.LEASES) and not self.reading.is_set():
            self.reading.set()
            assert self.go.wait(120)
        return iter(found)


def test_gc_whose_mark_began_before_the_push(tmp_path: Path) -> None:
    """A collector reads the leases, then `build --push` deduplicates an old, unreferenced file's
    chunks and exits, then the collector goes on: the chunks are its candidates, and its re-read
    (step 7) rescues them; a second run before `env create` keeps them by the kept lease, so
    `env create` afterwards finds them all."""
    url = str(tmp_path / "store")
    shared = os.urandom(256 * 1024)
    old = _tree(tmp_path / "old", 0)
    (old / "shared").write_bytes(shared)
    with Store.open(url) as s:
        s.init()
    first = _build(url, old)
    with Store.open(url) as s:
        s.backend.delete_many(list(s.backend.list(leases.LEASES)))  # let the old layer go
        for key in content_keys(s):
            os.utime(Path(url) / key, (1, 1))  # and age it past any grace
    new = _tree(tmp_path / "new", 1)
    (new / "shared").write_bytes(shared)
    paused = _PausedAfterLeaseRead(PosixBackend(url))
    reports: list[layergc.Report] = []
    collector = threading.Thread(target=lambda: reports.append(layergc.collect(Store(paused), grace=0)))
    collector.start()
    try:
        assert paused.reading.wait(120)
        built = _build(url, new)
    finally:
        paused.go.set()
        collector.join(timeout=120)
    assert reports and reports[0].deleted.objects > 0  # the old layer's own objects went
    assert reports[0].rescued.objects > 0  # the shared chunks were candidates until the re-read
    with Store.open(url) as s:  # and a run that starts now, with the layer old enough, keeps it too
        os.utime(Path(url) / keys.object_key("blobs", str(built["blob"])), (1, 1))
        assert layergc.collect(s, grace=0).kept_lease.objects > 0
    r = layerctl("env", "create", "--store", url, "--base", str(built["blob"]), "-t", "new:1", "--json")
    assert r.code == 0, r.err
    with Store.open(url) as s:
        assert check_reachable(s) == []
        s.get_chunk_map(str(built["blob"]))
        with pytest.raises(NotFound):
            s.get_chunk_map(str(first["blob"]))


def _flows_beside_a_collector(url: str, tmp: Path) -> None:
    """FLOWS times `build --push` then `env create`, while a collector (grace 0) runs in a loop;
    every second environment's tag is removed afterwards, so the collector has garbage to take."""
    with Store.open(url) as s:
        s.init()
    stop = threading.Event()
    reports: list[layergc.Report] = []
    errors: list[BaseException] = []

    def loop() -> None:
        with Store.open(url) as s:
            while not stop.is_set():
                try:
                    reports.append(layergc.collect(s, grace=0))
                    stop.wait(0.02)  # the flows' processes get the CPU between rounds (2 cores)
                except BaseException as e:  # reported by the test, not lost in the thread
                    errors.append(e)
                    return

    collector = threading.Thread(target=loop, name="gc-loop")
    collector.start()
    failures = []
    try:
        for i in range(FLOWS):
            built = _build(url, _tree(tmp / f"src{i}", i))
            r = layerctl("env", "create", "--store", url, "--base", str(built["blob"]), "-t", f"flow/{i}:1", "--json")
            if r.code != 0:
                failures.append((i, r.err.strip()))
                continue
            assert r.json()["released_leases"] == [built["lease"]]
            if i % 2:
                with Store.open(url) as s:
                    s.delete_tag(f"flow/{i}:1")
    finally:
        stop.set()
        collector.join(timeout=300)
    assert not collector.is_alive()
    assert not errors, errors
    assert failures == []
    assert len(reports) >= 2 and sum(r.deleted.objects for r in reports) > 0  # it really collected meanwhile
    with Store.open(url) as s:
        assert check_reachable(s) == []
        assert sorted(s.tags()) == sorted(f"flow/{i}:1" for i in range(0, FLOWS, 2))
        layergc.collect(s, grace=0)
        assert content_keys(s) == reachable_keys(s)
        assert not [x for x in leases.read_leases(s.backend) if x.id.startswith(leases.PUSH_KEPT)]


@pytest.mark.slow
def test_flows_beside_a_looping_collector_local(tmp_path: Path) -> None:
    _flows_beside_a_collector(str(tmp_path / "store"), tmp_path)


@pytest.mark.ceph
@pytest.mark.parametrize("kind", ["cephfs", "s3"])
def test_flows_beside_a_looping_collector_distributed(kind: str, request: pytest.FixtureRequest,
                                                      tmp_path: Path) -> None:
    _flows_beside_a_collector(request.getfixturevalue(f"{kind}_store_url"), tmp_path)


@pytest.mark.slow
def test_flows_beside_a_looping_collector_http(tmp_path: Path) -> None:
    """The same through the project's HTTP service (leases travel as its mutable keys)."""
    from testkit.store_service import threaded_service

    with threaded_service(str(tmp_path / "store")) as url:
        _flows_beside_a_collector(url, tmp_path)
