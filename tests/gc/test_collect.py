"""The collector on one store, step by step: what it keeps (tags, leases, grace, young layers,
signatures), what it removes, retention, dry runs, reruns, its records; and the two protocol
races pinned down deterministically: a writer that deduplicates against a published candidate,
and a tag moved while the collector marks. A control run without the writer's half shows the
race is real."""

from __future__ import annotations

import json
import os
import random
import threading
import time
from pathlib import Path

import layergc
import pytest
from testkit.gc_race import blocks, check_reachable, content_keys, push_env, reachable_keys

from layerstore import keys, leases
from layerstore.backends.posix import PosixBackend
from layerstore.errors import NotFound, StoreUnavailable
from layerstore.store import Store
from manifest import environment as envmod
from manifest.signing import PrivateKey


@pytest.fixture
def store(tmp_path: Path) -> Store:
    s = Store(PosixBackend(tmp_path / "store", fsync=False))
    s.init()
    yield s
    s.close()


def _age(store: Store, seconds: float) -> None:
    """Make every content object look `seconds` old (the grace period judges by store mtime)."""
    root = Path(store.backend.root)  # type: ignore[attr-defined]
    t = time.time() - seconds
    for kind in ("chunks", "blobs", "manifests"):
        for dirpath, _dirs, files in os.walk(root / kind):
            for f in files:
                os.utime(os.path.join(dirpath, f), (t, t))


def _push(store: Store, tmp: Path, ref: str, seed: int, pool: list[bytes] | None = None) -> str:
    """Push an environment with its own lease (released at the end, like a CLI push), then age
    the store's content: file times tick coarsely, and an object of the collector's own tick
    counts as young even with grace 0."""
    with Store(store.backend) as s:
        manifest = push_env(s, tmp, pool or blocks(24, seed), random.Random(seed), ref)
    _age(store, 3600)
    return manifest


def test_tagged_kept_untagged_removed(store: Store, tmp_path: Path) -> None:
    keep = _push(store, tmp_path, "env/keep:1", 1)
    drop = _push(store, tmp_path, "env/drop:1", 2)
    store.delete_tag("env/drop:1")
    before = content_keys(store)
    report = layergc.collect(store, grace=0)
    after = content_keys(store)
    assert keys.object_key("manifests", keep) in after
    assert keys.object_key("manifests", drop) not in after
    assert after == reachable_keys(store) and not check_reachable(store)
    assert report.deleted.objects == len(before - after) > 0
    assert report.marked.objects == len(after)
    assert set(report.phases) >= {"list", "mark", "sweep", "housekeeping"}


def test_dry_run_changes_nothing_and_rerun_deletes_nothing(store: Store, tmp_path: Path) -> None:
    _push(store, tmp_path, "env/a:1", 1)
    _push(store, tmp_path, "env/b:1", 2)
    store.delete_tag("env/b:1")
    root = Path(store.backend.root)  # type: ignore[attr-defined]
    snapshot = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    dry = layergc.collect(store, grace=0, dry_run=True)
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == snapshot  # not even a run record
    assert dry.deleted.objects > 0
    real = layergc.collect(store, grace=0)
    assert real.deleted == dry.deleted
    again = layergc.collect(store, grace=0)
    assert again.deleted.objects == 0
    assert layergc.last_report(store)["run"] == again.run


def test_grace_keeps_young_objects_and_what_young_layers_name(store: Store, tmp_path: Path) -> None:
    pool = blocks(24, 5)
    _push(store, tmp_path, "env/old:1", 5, pool)
    store.delete_tag("env/old:1")
    _age(store, 7200)
    # A layer pushed just now, not yet in any environment, shares chunks with the old garbage.
    with Store(store.backend) as s:
        path = tmp_path / "young"
        path.write_bytes(b"".join(pool[:8]))
        young = s.put_blob(path, chunk_size=4096).blob
    report = layergc.collect(store, grace=3600)
    cm = store.get_chunk_map(young)  # the young layer is whole: its old chunks were kept with it
    assert all(store.has_chunk(d) for d in cm.unique_digests())
    assert report.kept_grace.objects > 0 and report.deleted.objects > 0
    # An environment made of it now still works.
    envmod.create_environment(store, envmod.build_manifest(store, base=young), "env/new:1")
    assert not check_reachable(store)


def test_leases_keep_objects_until_they_expire_or_go(store: Store, tmp_path: Path) -> None:
    m = _push(store, tmp_path, "env/l:1", 7)
    store.delete_tag("env/l:1")
    lease = leases.Lease(store.backend, kind="operator", name="hold", lease_id="hold", ttl=1.0, renew=False)
    lease.open([keys.object_key("manifests", m)])
    report = layergc.collect(store, grace=0)
    assert store.backend.exists(keys.object_key("manifests", m))
    assert report.kept_lease.objects > 0 and report.deleted.objects == 0
    lease.release()
    layergc.collect(store, grace=0)
    assert not store.backend.exists(keys.object_key("manifests", m))


def test_expired_lease_binds_nothing(store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(leases, "SKEW", 0.0)
    m = _push(store, tmp_path, "env/e:1", 8)
    store.delete_tag("env/e:1")
    leases.Lease(store.backend, kind="operator", name="short", lease_id="short", ttl=0.05, renew=False).open(
        [keys.object_key("manifests", m)])
    time.sleep(0.1)
    report = layergc.collect(store, grace=0)
    assert not store.backend.exists(keys.object_key("manifests", m))
    assert report.housekeeping["leases"] >= 1  # the expired lease itself is gone too
    assert not list(store.backend.list(leases.LEASES))


def test_signatures_follow_their_manifest(store: Store, tmp_path: Path) -> None:
    key = PrivateKey.generate()
    m = _push(store, tmp_path, "env/s:1", 9)
    with Store(store.backend) as signer:
        envmod.put_signature(signer, envmod.sign_manifest(m, key))
    assert envmod.verified_signers(store, m)
    layergc.collect(store, grace=0)
    assert envmod.verified_signers(store, m)  # kept while the environment is
    store.delete_tag("env/s:1")
    layergc.collect(store, grace=0)  # the manifest goes, and the tag of its signature
    assert not list(store.backend.list("tags/"))
    layergc.collect(store, grace=0)  # then the signature object, which nothing names any more
    assert content_keys(store) == set()


def test_retention_policy(store: Store, tmp_path: Path) -> None:
    for i in range(4):
        _push(store, tmp_path, f"env/r:v{i}", 20 + i)
        time.sleep(0.02)  # distinct tag write times
    _push(store, tmp_path, "env/r:stable", 30)
    _push(store, tmp_path, "env/other:v0", 31)
    policy = layergc.RetentionPolicy(keep_last=2, keep_patterns=("env/r:stable",))
    dry = layergc.collect(store, grace=0, dry_run=True, policy=policy)
    assert sorted(store.tags()) == ["env/other:v0", "env/r:stable", "env/r:v0", "env/r:v1", "env/r:v2", "env/r:v3"]
    report = layergc.collect(store, grace=0, policy=policy)
    assert report.tags_removed == dry.tags_removed == ["env/r:v0", "env/r:v1"]
    assert sorted(store.tags()) == ["env/other:v0", "env/r:stable", "env/r:v2", "env/r:v3"]
    assert content_keys(store) == reachable_keys(store) and not check_reachable(store)


def test_dead_run_records_are_cleared_and_history_is_kept(store: Store, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(leases, "SKEW", 0.0)
    dead = {"state": "sweeping", "started": time.time() - 100, "expires": time.time() - 50, "holder": "x:1"}
    store.backend.replace(leases.run_key("gc-dead"), json.dumps(dead).encode())
    store.backend.store_once(leases.candidates_key("gc-dead"), leases.encode_candidates(["chunks/x"]))
    report = layergc.collect(store, grace=0)
    assert list(store.backend.list(leases.RUNS)) == []
    assert list(store.backend.list(leases.CANDIDATES)) == []
    assert report.housekeeping["runs"] >= 1
    history = list(store.backend.list("gc/history/"))
    assert history == [f"gc/history/{report.run}"]


def _pause_at(monkeypatch: pytest.MonkeyPatch, name: str, call: int) -> tuple[threading.Event, threading.Event]:
    """Stop a collector when it calls its step `name` for the `call`-th time (1-based)."""
    import layergc.collector as collector

    reached, go_on = threading.Event(), threading.Event()
    real = getattr(collector, name)
    calls = []

    def step(*args: object) -> object:
        calls.append(1)
        if len(calls) == call:
            reached.set()
            assert go_on.wait(30)
        return real(*args)

    monkeypatch.setattr(collector, name, step)
    return reached, go_on


def _dedup_race(store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                protected: bool = True) -> tuple[str, dict[str, object]]:
    """A pusher that reuses the chunks of a removed environment while the collector that
    judged them garbage has published them and re-read the roots, and is about to delete."""
    pool = blocks(24, 40)
    _push(store, tmp_path, "env/old:1", 40, pool)
    store.delete_tag("env/old:1")
    published, go_on = _pause_at(monkeypatch, "_sweep", 1)
    result: dict[str, object] = {}
    gc = threading.Thread(target=lambda: result.update(report=layergc.collect(store, grace=0)))
    gc.start()
    assert published.wait(30)
    pushed: dict[str, str] = {}

    def push() -> None:
        pushed["m"] = _push(store, tmp_path, "env/new:1", 41, pool)

    pusher = threading.Thread(target=push)
    pusher.start()
    # Protected, the pusher must still be waiting for the sweep after a while; unprotected, it
    # runs to its end while the collector stands before its deletions.
    pusher.join(timeout=2.0 if protected else 60)
    waited = pusher.is_alive()
    go_on.set()
    gc.join(30)
    pusher.join(30)
    assert not gc.is_alive() and not pusher.is_alive()
    result["waited"] = waited
    return pushed["m"], result  # type: ignore[return-value]


@pytest.mark.slow  # about 2-3 s: kept out of `make check`'s 2 minutes
def test_dedup_against_a_published_candidate_waits_and_stays_whole(store: Store, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    manifest, result = _dedup_race(store, tmp_path, monkeypatch)
    assert result["waited"]  # the pusher saw the sweep and waited for it
    assert not check_reachable(store)
    assert store.tags()["env/new:1"] == manifest


def test_control_without_the_writers_half_the_race_loses_chunks(store: Store, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The same race with `protect` switched off: the pusher deduplicates against chunks the
    collector then deletes, and the new environment points at missing chunks. This is what the
    protocol prevents (and shows the check above can fail)."""
    monkeypatch.setattr(Store, "protect", lambda self, kind, digests: None)
    monkeypatch.setattr(leases, "protect", lambda lease, keys, deadline=None: None)
    _manifest, result = _dedup_race(store, tmp_path, monkeypatch, protected=False)
    problems = check_reachable(store)
    assert any("missing" in p for p in problems), (result, problems)


def test_tag_moved_while_marking_is_rescued(store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tag moved (back) onto an old, unreferenced manifest after the collector read the tags:
    the re-read after publishing the candidates finds it."""
    old = _push(store, tmp_path, "env/t:1", 50)
    _push(store, tmp_path, "env/t:1", 51)  # the tag moves on; `old` is garbage
    published, go_on = _pause_at(monkeypatch, "_held", 2)  # the re-read (the first is in _roots)
    result: dict[str, layergc.Report] = {}
    gc = threading.Thread(target=lambda: result.update(r=layergc.collect(store, grace=0)))
    gc.start()
    assert published.wait(30)
    # A raw tag write that skips the writer's half, so it does not wait: only the re-read saves it.
    store.backend.replace(keys.tag_key("env/t:1"), (old + "\n").encode())
    go_on.set()
    gc.join(30)
    assert result["r"].rescued.objects > 0
    assert not check_reachable(store)


def test_writer_refuses_to_go_on_with_a_lapsed_lease(store: Store) -> None:
    lease = leases.Lease(store.backend, kind="push").open()
    lease.release()
    with pytest.raises(StoreUnavailable):
        lease.hold(["chunks/00/00/" + "0" * 64])


def test_environment_of_a_collected_layer_is_refused(store: Store, tmp_path: Path) -> None:
    with Store(store.backend) as s:
        path = tmp_path / "l"
        path.write_bytes(os.urandom(10000))
        blob = s.put_blob(path, chunk_size=4096).blob
    _age(store, 3600)
    layergc.collect(store, grace=0)
    with pytest.raises(NotFound):
        envmod.build_manifest(store, base=blob)


def test_stale_temporaries_are_swept_once_a_day(store: Store) -> None:
    root = Path(store.backend.root)  # type: ignore[attr-defined]
    (root / "chunks").mkdir(exist_ok=True)
    stale = root / "chunks" / ".tmp-dead-writer"
    stale.write_bytes(b"x")
    os.utime(stale, (1, 1))
    first = layergc.collect(store, grace=0)
    assert first.housekeeping["temporaries"] == 1 and not stale.exists()
    stale.write_bytes(b"x")
    os.utime(stale, (1, 1))
    second = layergc.collect(store, grace=0)  # the whole-store walk is not repeated within a day
    assert second.housekeeping["temporaries"] == 0 and stale.exists()
