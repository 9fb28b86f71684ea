"""bench/daemon_restart.py --kill-all --keeper at its smallest size (docs/fanotify.md, "A keeper
without systemd"): on a node without systemd whose operator opted in to our keeper, the watch,
the daemon and the holder killed -9 at once on a cold mount with holes left, the keeper's copy
of the group keeps the marks and every read comes back right (the bench's own reads, compared
with the source: its JSON counts them). And the bench's classifier of wrong reads: a read that
differs only by zero pages is a hole read without a group, anything else is not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from testkit.fanotify_helpers import needs_fanotify

from bench.daemon_restart import main, zeros_where_wrong
from fuse_client.fanotify import keeper


def test_a_read_that_differs_only_by_zero_pages_is_a_hole_read() -> None:
    want = bytes(range(256)) * 64 + b"tail"  # (4 pages and a short one)
    holed = bytearray(want)
    holed[4096:8192] = bytes(4096)
    assert zeros_where_wrong(bytes(holed), want)
    holed[-4:] = bytes(4)  # (a short last page read as a hole)
    assert zeros_where_wrong(bytes(holed), want)
    other = bytearray(want)
    other[5000] ^= 0xFF  # (wrong, not zeros)
    assert not zeros_where_wrong(bytes(other), want)
    assert not zeros_where_wrong(want[:-4], want)  # (short: not a hole read)


@pytest.mark.root
@needs_fanotify
def test_with_the_keeper_spared_a_kill_of_everything_else_reads_no_wrong_byte(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """3 cycles, 2 readers (BENCH_SIZE=quick; about 10 s). The bench cleans up its node (keeper,
    watch, daemon, holder, mounts) in a `finally`; the variables it sets are put back here."""
    monkeypatch.setenv("BENCH_SIZE", "quick")
    for k in ("LAYERSTORE_DATA_PATH", keeper.OPT_IN_ENV):
        monkeypatch.setenv(k, "")  # (undone after the test, whatever the bench sets)
    for k in ("LAYERSTORE_DAEMON_WATCH", keeper.CGROUP_ENV):
        monkeypatch.delenv(k, raising=False)
    out = tmp_path / "keeper.json"
    rc = main(["--kill-all", "--keeper", "--restarts", "3", "--readers", "2", "--out", str(out)])
    doc = json.loads(out.read_text())
    summary = {k: v for k, v in doc.items() if k != "per_cycle"}
    assert doc["data_path"] == "fanotify" and "the keeper process" in doc["data_path_reason"], summary
    assert doc["cycles"] == 3 and doc["reads"] > 0 and not doc["keeper_killed"]
    assert doc["cycles_killed_with_holes"] >= 1, summary  # (reads needed the group across the kill)
    assert doc["wrong_reads"] == 0 and doc["wrong_zero_reads"] == 0 and doc["failed_reads"] == 0, summary
    assert doc["every_cycle_same_group"] and doc["every_cycle_keeper_kept_the_marks"], summary
    assert all(c["same_keeper"] for c in doc["per_cycle"]), summary
    assert doc["cycles_with_a_stuck_read"] == [] and rc == 0
