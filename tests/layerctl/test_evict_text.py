"""`layerctl cache evict`'s text answer says what it could not evict: bytes held by attached
blobs (fanotify: never punched while mounted) and why a named blob was skipped."""

from __future__ import annotations

from click.testing import CliRunner

from layerctl import cmd_daemon
from layerctl.main import cli


def _evict(monkeypatch, tmp_path, answer, *args):
    monkeypatch.setattr(cmd_daemon, "_with_daemon_or_offline", lambda *a: answer)
    return CliRunner().invoke(cli, ["cache", "evict", "--cache", str(tmp_path), *args])


def test_protected_bytes_and_a_skipped_blob_are_said(monkeypatch, tmp_path):
    r = _evict(monkeypatch, tmp_path, {"evicted_chunks": 0, "evicted_bytes": 0, "used_bytes": 3 << 20,
                                       "pinned_bytes": 0, "protected_bytes": 2 << 20,
                                       "skipped": "protected: its data file is mounted directly"},
               "--blob", "b3:" + "ab" * 32)
    assert r.exit_code == 0, r.output
    assert "evicted 0 chunk(s)" in r.output
    assert "of it in attached blobs, not evictable while mounted" in r.output
    assert "skipped: protected: its data file is mounted directly" in r.output


def test_nothing_extra_without_protection(monkeypatch, tmp_path):
    r = _evict(monkeypatch, tmp_path, {"evicted_chunks": 4, "evicted_bytes": 4 << 20, "used_bytes": 0,
                                       "pinned_bytes": 0, "protected_bytes": 0}, "--all")
    assert r.exit_code == 0, r.output
    assert "attached" not in r.output and "skipped" not in r.output
