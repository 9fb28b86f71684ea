"""`layerctl gc`, `lease`, `tag rm` and `env rm` as a user runs them; the retention policy's
rules as properties."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from layergc import RetentionPolicy, parse_duration
from layergc.retention import TagInfo
from testkit.cli_helpers import assert_clean_failure, layerctl


def _env(tmp_path: Path, store: str, name: str, size: int = 20000) -> str:
    layer = tmp_path / f"{name.replace('/', '_').replace(':', '_')}.bin"
    layer.write_bytes(os.urandom(size))
    blob = layerctl("store", "put-blob", "--store", store, "--json", str(layer)).json()["blob"]
    r = layerctl("env", "create", "--store", store, "--base", blob, "-t", name)
    assert r.code == 0, r
    return blob


def _age(store: Path) -> None:
    for dirpath, _dirs, files in os.walk(store):
        for f in files:
            os.utime(os.path.join(dirpath, f), (1, 1))


@pytest.mark.slow  # about 3-5 s: kept out of `make check`'s 2 minutes
def test_gc_cli_round_trip(tmp_path: Path) -> None:
    store = tmp_path / "store"
    assert layerctl("store", "init", "--store", str(store)).code == 0
    _env(tmp_path, str(store), "app:1")
    old = _env(tmp_path, str(store), "app:2")
    _env(tmp_path, str(store), "tool:1")
    _age(store)
    assert layerctl("tag", "rm", "--store", str(store), "app:2").code == 0
    assert layerctl("env", "rm", "--store", str(store), "tool").code == 0
    envs = layerctl("env", "ls", "--store", str(store), "--json")
    assert "app:1" in envs.out and "tool:1" not in envs.out

    dry = layerctl("gc", "--store", str(store), "--dry-run", "--grace", "0", "--json").json()
    assert dry["dry_run"] and dry["deleted"]["objects"] > 0
    assert layerctl("store", "get-blob", "--store", str(store), old, str(tmp_path / "out")).code == 0

    # An operator's lease keeps the old layer through a real run.
    r = layerctl("lease", "create", "--store", str(store), "keep-old", old, "--ttl", "1h")
    assert r.code == 0, r
    listed = layerctl("lease", "ls", "--store", str(store), "--json").json()
    assert [(x["id"], x["kind"], x["objects"], x["live"]) for x in listed] == [("keep-old", "operator", 1, True)]
    run = layerctl("gc", "--store", str(store), "--grace", "0", "--json").json()
    assert run["kept_lease"]["objects"] > 0
    assert layerctl("store", "get-blob", "--store", str(store), old, str(tmp_path / "out")).code == 0
    assert layerctl("lease", "rm", "--store", str(store), "keep-old").code == 0
    human = layerctl("gc", "--store", str(store), "--grace", "0")
    assert human.code == 0 and "deleted" in human.out and "phases" in human.out
    assert_clean_failure(layerctl("store", "get-blob", "--store", str(store), old, str(tmp_path / "out")), "not")
    again = layerctl("gc", "--store", str(store), "--grace", "0", "--json").json()
    assert again["deleted"]["objects"] == 0
    assert layerctl("store", "verify", "--store", str(store)).code == 0


@pytest.mark.slow  # about 3-5 s: kept out of `make check`'s 2 minutes
def test_gc_cli_retention_and_errors(tmp_path: Path) -> None:
    store = tmp_path / "store"
    layerctl("store", "init", "--store", str(store))
    for i in range(3):
        _env(tmp_path, str(store), f"app:v{i}", 5000)
    _env(tmp_path, str(store), "app:prod", 5000)
    r = layerctl("gc", "--store", str(store), "--keep-last", "1", "--keep", "app:prod", "--grace", "0", "--json")
    assert sorted(r.json()["tags_removed"]) == ["app:v0", "app:v1"]
    assert_clean_failure(layerctl("gc", "--store", str(store), "--grace", "soon"), "duration")
    assert_clean_failure(layerctl("lease", "create", "--store", str(store), "push-x", "app:prod"), "lease name")
    assert_clean_failure(layerctl("lease", "create", "--store", str(store), "x", "app:nope"), "not")
    assert_clean_failure(layerctl("lease", "rm", "--store", str(store), "nothing"), "no lease")
    assert_clean_failure(layerctl("env", "rm", "--store", str(store), "nothing"), "no environment")
    assert_clean_failure(layerctl("tag", "rm", "--store", str(store), "app:nope"), "not")


def test_durations() -> None:
    assert parse_duration("90") == 90 and parse_duration("15m") == 900 and parse_duration("1h30m") == 5400
    assert parse_duration("7d") == 7 * 86400 and parse_duration("0") == 0


_tags = st.lists(st.tuples(st.sampled_from(["a", "b", "c/d"]), st.text("xyz0129", min_size=1, max_size=4),
                           st.floats(0, 1000)), max_size=30, unique_by=lambda t: (t[0], t[1]))


@given(_tags, st.integers(0, 5) | st.none(), st.floats(0, 1000) | st.none(), st.booleans())
def test_retention_properties(raw: list[tuple[str, str, float]], keep_last: int | None, newer: float | None,
                              pin: bool) -> None:
    tags = [TagInfo(f"{n}:{t}", "b3:" + "0" * 64, m) for n, t, m in raw]
    pattern = ("a:x*",) if pin else ()
    policy = RetentionPolicy(keep_last, newer, pattern)
    removed = {t.ref for t in policy.to_remove(tags, now=1000.0)}
    if keep_last is None and newer is None:
        assert not removed
    for t in tags:
        if t.ref in removed:
            assert not policy.kept_forever(t.ref)
            assert newer is None or 1000.0 - t.mtime >= newer
            newer_same_name = [u for u in tags if u.name == t.name and not policy.kept_forever(u.ref)
                               and (u.mtime, u.ref) > (t.mtime, t.ref)]
            assert keep_last is None or len(newer_same_name) >= keep_last
        elif keep_last is not None or newer is not None:
            # kept: some rule keeps it
            newer_same_name = [u for u in tags if u.name == t.name and not policy.kept_forever(u.ref)
                               and (u.mtime, u.ref) > (t.mtime, t.ref)]
            assert (policy.kept_forever(t.ref) or (newer is not None and 1000.0 - t.mtime < newer)
                    or (keep_last is not None and len(newer_same_name) < keep_last))
