"""Layers held ahead of their Prepare (`Snapshotter._hold_ahead`): containerd 1.6 Prepares a pull's
layers one by one, each inside its metadata lock, so the first Prepare of an environment's layer
holds the environment's other layers in parallel; their own Prepares then find them mounted.

Pure logic against a fake layer source (no mounts, no root): the holds taken, once per blob; the
trust check before any hold; at most AHEAD_PARALLEL at once; a Cleanup meanwhile keeps a layer
held ahead; one whose Prepare never comes is released at its deadline (one sweeper thread for
every deadline); a failed hold ahead leaves nothing and the layer's own Prepare fails loudly; a
restart releases what was held ahead and not recorded. The real path (EROFS mounts,
containerd's CRI plugin) is tests/snapshotter/test_cri.py's."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from testkit.fuse_helpers import wait_until

from layerstore.errors import PermissionDenied, StoreUnavailable
from snapshotter import snapshots as snapmod
from snapshotter.errors import SnapshotExists
from snapshotter.snapshots import LABEL_BLOB, LABEL_ENV, LABEL_REF, REMOTE_PREFIX, Snapshotter

ENV = "b3:" + "e" * 64
BASE, TOOL, WORK = ("b3:" + c * 64 for c in "123")


class FakeLayers:
    """RemoteLayers' surface as the Snapshotter uses it; holds are a set. `slow`: seconds a hold
    takes; `fail`: blobs whose hold fails; `untrusted`: the policy refuses the environment."""

    def __init__(self, slow: float = 0.0) -> None:
        self.slow = slow
        self.fail: set[str] = set()
        self.untrusted = False
        self.holds: set[str] = set()
        self.taken: list[str] = []
        self.mu = threading.Lock()
        self.layers = [BASE, TOOL, WORK]  # the environment's, bottom first
        self.active = self.peak = 0  # holds in progress now, and at most

    def check(self, blob: str, environment: str) -> tuple[int, ...]:
        if self.untrusted:
            raise PermissionDenied(f"environment {environment} is not signed by a trusted key")
        return ()

    def prewarm(self) -> None:
        pass

    def others(self, environment: str, blob: str) -> list[str]:
        return [b for b in self.layers if b != blob] if environment else []

    def usable(self, blob: str) -> bool:
        return blob in self.holds

    def hold(self, blob: str, hints: tuple[int, ...] = (), environment: str = "") -> None:
        if blob in self.holds:
            return
        with self.mu:
            self.active += 1
            self.peak = max(self.peak, self.active)
        try:
            time.sleep(self.slow)
            if blob in self.fail:
                raise StoreUnavailable(f"the store does not answer for {blob}")
            with self.mu:
                self.holds.add(blob)
                self.taken.append(blob)
        finally:
            with self.mu:
                self.active -= 1

    def release(self, blob: str) -> None:
        self.holds.discard(blob)

    def held(self) -> dict[str, str]:
        return {b: "ctrd." + b for b in self.holds}

    def mountpoint(self, blob: str) -> str:
        return "/nonexistent/" + blob

    def drop_legacy(self) -> list[str]:
        return []

    def close(self) -> None:
        pass


def labels(blob: str, chain: str) -> dict[str, str]:
    return {LABEL_REF: chain, LABEL_BLOB: blob, LABEL_ENV: ENV}


def pull(sn: Snapshotter, blobs: list[str]) -> None:
    """What containerd's unpacker does: each layer's chain on its parent, bottom first."""
    parent = ""
    for i, blob in enumerate(blobs):
        chain = f"sha256:chain{i}"
        with pytest.raises(SnapshotExists):
            sn.prepare(f"extract-{i}", REMOTE_PREFIX + parent if parent else "", labels(blob, chain))
        parent = chain


def test_the_first_prepare_holds_the_other_layers_ahead_in_parallel(tmp_path: Path) -> None:
    fake = FakeLayers(slow=0.3)
    sn = Snapshotter(tmp_path / "snap", fake)  # type: ignore[arg-type]
    try:
        t = time.monotonic()
        pull(sn, [BASE, TOOL, WORK])
        took = time.monotonic() - t
        assert took < 0.75, took  # three holds of 0.3 s at once, not one after another (0.9 s)
        assert sorted(fake.taken) == sorted([BASE, TOOL, WORK])  # each blob held once
        recs = {s.key: s.blob for s in sn.walk() if s.blob}
        assert set(recs.values()) == {BASE, TOOL, WORK}
        assert sn._ahead == {}  # every layer held ahead was recorded
    finally:
        sn.close()


def test_at_most_ahead_parallel_layers_are_held_ahead_at_once(tmp_path: Path) -> None:
    fake = FakeLayers(slow=0.1)
    fake.layers = ["b3:" + f"{i:064x}" for i in range(1, 13)]  # (an image of 12 layers)
    sn = Snapshotter(tmp_path / "snap", fake)  # type: ignore[arg-type]
    try:
        pull(sn, fake.layers)
        assert sorted(fake.taken) == sorted(fake.layers)  # each blob held once
        assert 2 <= fake.peak <= snapmod.AHEAD_PARALLEL + 1  # (the slots, plus a Prepare's own hold)
        assert {s.blob for s in sn.walk() if s.blob} == set(fake.layers) and sn._ahead == {}
    finally:
        sn.close()


def test_an_untrusted_environment_holds_nothing_ahead(tmp_path: Path) -> None:
    fake = FakeLayers()
    fake.untrusted = True
    sn = Snapshotter(tmp_path / "snap", fake)  # type: ignore[arg-type]
    try:
        with pytest.raises(PermissionDenied):
            sn.prepare("extract-0", "", labels(BASE, "sha256:chain0"))
        time.sleep(0.1)
        assert fake.holds == set() and fake.taken == [] and list(sn.walk()) == []
    finally:
        sn.close()


def test_cleanup_keeps_a_layer_held_ahead_until_its_deadline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(snapmod, "PREHOLD_TTL", 0.5)
    fake = FakeLayers()
    sn = Snapshotter(tmp_path / "snap", fake)  # type: ignore[arg-type]
    try:
        with pytest.raises(SnapshotExists):
            sn.prepare("extract-0", "", labels(BASE, "sha256:chain0"))
        wait_until(lambda: fake.holds == {BASE, TOOL, WORK} and float("inf") not in sn._ahead.values(), 10,
                   "every layer held ahead")
        assert sn.cleanup().layer_mounts == []  # (a Cleanup while the pull goes on: nothing released)
        assert fake.holds == {BASE, TOOL, WORK}
        sweeps = [t for t in threading.enumerate() if t.name == "snapshotter-ahead-sweep"]
        assert len(sweeps) == 1 and not any(isinstance(t, threading.Timer) for t in threading.enumerate())
        # the pull is given up: the layers held ahead go at their deadline, the recorded one stays
        wait_until(lambda: fake.holds == {BASE}, 5, "the holds ahead released")
        assert sn._ahead == {}
    finally:
        sn.close()


def test_a_failed_hold_ahead_leaves_nothing_and_its_prepare_fails_loudly(tmp_path: Path) -> None:
    fake = FakeLayers()
    fake.fail = {TOOL}
    sn = Snapshotter(tmp_path / "snap", fake)  # type: ignore[arg-type]
    try:
        with pytest.raises(SnapshotExists):
            sn.prepare("extract-0", "", labels(BASE, "sha256:chain0"))
        wait_until(lambda: TOOL not in sn._ahead and WORK in fake.holds, 10, "the failed hold rolled back")
        assert TOOL not in fake.holds
        with pytest.raises(StoreUnavailable):  # its own Prepare tries again and reports the error
            sn.prepare("extract-1", REMOTE_PREFIX + "sha256:chain0", labels(TOOL, "sha256:chain1"))
        assert {s.blob for s in sn.walk() if s.blob} == {BASE}
    finally:
        sn.close()


def test_a_restart_releases_what_was_held_ahead_and_not_recorded(tmp_path: Path) -> None:
    fake = FakeLayers()
    sn = Snapshotter(tmp_path / "snap", fake)  # type: ignore[arg-type]
    with pytest.raises(SnapshotExists):
        sn.prepare("extract-0", "", labels(BASE, "sha256:chain0"))
    wait_until(lambda: fake.holds == {BASE, TOOL, WORK}, 10, "every layer held")
    sn.close()  # (as a kill -9 would leave it: the holds on the node, the in-memory deadlines gone)
    sn2 = Snapshotter(tmp_path / "snap", fake)  # type: ignore[arg-type]
    try:
        assert fake.holds == {BASE}
        assert sorted(sn2.last_reconcile.layer_mounts) == sorted(fake.mountpoint(b) for b in (TOOL, WORK))
    finally:
        sn2.close()
