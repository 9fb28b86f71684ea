"""Pure units of the watch's care of the fanotify keeper (runtime_shim/supervise/keeper_watch.py;
docs/fanotify.md, "A keeper without systemd"): when a missing keeper is started again, the back-off
of one that keeps dying, and that a tick costs no start while the keeper lives or where the
operator did not opt in (keeper.running and keeper.ensure replaced: no process, no root). And the
pure cgroup helpers the keeper leaves its cgroup with."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from fuse_client.fanotify import keeper
from layerstore.linux import cgroup
from runtime_shim.supervise import keeper_watch
from runtime_shim.supervise.keeper_watch import BACKOFF_MAX, STABLE, KeeperStarts, KeeperWatch, backoff, restart_after


def test_the_first_missing_keeper_is_started_at_once() -> None:
    assert restart_after(KeeperStarts(), 5.0, None) == KeeperStarts(5.0, 0)
    assert restart_after(KeeperStarts(), 5.0, 4.0) == KeeperStarts(5.0, 0)


def test_a_keeper_that_keeps_dying_is_started_again_ever_later_up_to_a_cap() -> None:
    starts, now, at = KeeperStarts(), 0.0, []
    while now < 2000:
        nxt = restart_after(starts, now, None)  # (never seen alive: it dies at once)
        if nxt is not None:
            starts = nxt
            at.append(now)
        now += 1.0  # (the watch's tick)
    gaps = [b - a for a, b in zip(at, at[1:], strict=False)]
    assert gaps[:6] == [2, 4, 8, 16, 32, 64]
    assert max(gaps) == BACKOFF_MAX and gaps[-1] == BACKOFF_MAX
    assert len(at) < 20  # (not a tight loop: 2000 ticks, a handful of starts)


def test_a_keeper_that_lived_is_started_again_at_once_and_the_back_off_forgotten() -> None:
    quick = KeeperStarts(100.0, 5)
    assert restart_after(quick, 101.0, 100.5) is None  # (died soon after its start: back off)
    assert restart_after(quick, 100.0 + backoff(6), 100.5) == KeeperStarts(100.0 + backoff(6), 6)
    assert restart_after(quick, 100.0 + STABLE + 1, 100.0 + STABLE) == KeeperStarts(100.0 + STABLE + 1, 0)
    assert backoff(0) == 0 and backoff(1) == 2 and backoff(100) == BACKOFF_MAX


class FakeKeeper:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.pid: int | None = None
        self.starts = 0
        self.survives = False  # a started keeper lives on
        self.looks = 0
        monkeypatch.setattr(keeper, "running", self.running)
        monkeypatch.setattr(keeper, "ensure", self.ensure)

    def running(self, cache: Path) -> int | None:
        self.looks += 1
        return self.pid

    def ensure(self, cache: Path, env: object) -> int | None:
        self.starts += 1
        if self.survives:
            self.pid = 1000 + self.starts
        return self.pid


def _tick(kw: KeeperWatch, now: float) -> None:
    kw.tick(now)
    if kw.thread is not None:
        kw.thread.join(5)


def test_the_watch_starts_a_keeper_that_died_alone_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = FakeKeeper(monkeypatch)
    fake.pid = os.getpid()  # (a live pid that is no child of this process)
    kw = KeeperWatch(tmp_path, {keeper.OPT_IN_ENV: "1"})
    for t in range(5):
        _tick(kw, float(t))
    assert fake.starts == 0 and fake.looks == 5  # alive: one look per tick, no start
    fake.pid, fake.survives = None, True  # killed; the next one lives
    _tick(kw, 5.0)
    assert fake.starts == 1 and fake.pid == 1001
    for t in range(6, 10):
        _tick(kw, float(t))
    assert fake.starts == 1


def test_the_watch_backs_off_a_keeper_that_dies_at_once_and_logs_it(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeKeeper(monkeypatch)  # (every start fails: ensure returns None)
    kw = KeeperWatch(tmp_path, {keeper.OPT_IN_ENV: "1"})
    with caplog.at_level("WARNING", logger=keeper_watch.log.name):
        for t in range(40):
            _tick(kw, float(t))
    assert fake.starts == 5  # at 0, 2, 6, 14, 30
    said = [r.getMessage() for r in caplog.records if "in a row" in r.getMessage()]
    assert len(said) == 5 and "the next start in 2 s" in said[0] and "in 32 s" in said[-1], said  # (once a wait)


def test_no_keeper_work_where_the_operator_did_not_opt_in(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = FakeKeeper(monkeypatch)
    kw = KeeperWatch(tmp_path, {})
    for t in range(3):
        _tick(kw, float(t))
    assert fake.looks == 0 and fake.starts == 0


def test_a_start_under_way_is_not_doubled(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = FakeKeeper(monkeypatch)
    gate = threading.Event()

    def slow_ensure(cache: Path, env: object) -> int | None:
        fake.starts += 1
        gate.wait(5)
        return None

    monkeypatch.setattr(keeper, "ensure", slow_ensure)
    kw = KeeperWatch(tmp_path, {keeper.OPT_IN_ENV: "1"})
    kw.tick(0.0)
    kw.tick(100.0)  # (the first start still runs: no look, no second start)
    assert kw.busy() and fake.starts == 1 and fake.looks == 1
    gate.set()
    assert kw.thread is not None
    kw.thread.join(5)


def test_a_cgroup_is_left_for_its_parent_and_the_root_is_never_removed(tmp_path: Path) -> None:
    assert cgroup.parent("/a/b/layerstore-keeper") == "/a/b"
    assert cgroup.parent("/layerstore-keeper") == "/" and cgroup.parent("/") == "/"
    assert cgroup.sibling("/a/b", "k") == "/a/k"
    (tmp_path / "x").mkdir()
    assert not cgroup.remove_if_empty("/", tmp_path) and not cgroup.remove_if_empty("/x/../..", tmp_path)
    assert cgroup.remove_if_empty("/x", tmp_path) and not (tmp_path / "x").exists()
    assert cgroup.remove_if_empty("/x", tmp_path)  # (gone already)
