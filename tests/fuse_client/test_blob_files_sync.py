"""`BlobFiles.sync_all`: one journal batch's data files made durable together (writeback of all
started first, then each fdatasync'ed). What it saves on the disk is measured by the node disk
write figures (docs/benchmarks-cache.md, "Node disk writes"); here: it syncs what exists, skips what
does not, leaves no descriptor open, and reports a failure."""

from __future__ import annotations

import os

import pytest

from fuse_client.nodecache.files import BlobFiles
from layerstore import digest as digestmod
from layerstore import linux


def _blob(n: int) -> str:
    return digestmod.of(str(n).encode())


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_sync_all_syncs_each_existing_file_once_and_closes_them(tmp_path, monkeypatch):
    files = BlobFiles(tmp_path)
    present = [_blob(i) for i in range(3)]
    for b in present:
        p = files.path(b)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"x" * 8192)
    events: list[tuple[str, int]] = []
    real_start, real_sync = linux.start_writeback, os.fdatasync
    monkeypatch.setattr(linux, "start_writeback",
                        lambda fd: (events.append(("start", os.fstat(fd).st_ino)), real_start(fd)))
    monkeypatch.setattr(os, "fdatasync", lambda fd: (events.append(("sync", os.fstat(fd).st_ino)), real_sync(fd)))
    before = _open_fds()
    files.sync_all([*present, _blob(99)])  # (the last one has no file: skipped)
    inodes = sorted(files.path(b).stat().st_ino for b in present)
    assert sorted(i for kind, i in events if kind == "start") == inodes
    assert sorted(i for kind, i in events if kind == "sync") == inodes
    assert [kind for kind, _ in events] == ["start"] * 3 + ["sync"] * 3, "every writeback starts before any sync"
    assert _open_fds() == before
    events.clear()
    files.sync_all([present[0]])  # one file: nothing to group, straight to fdatasync
    assert events == [("sync", files.path(present[0]).stat().st_ino)]

def test_a_failed_sync_is_raised_and_leaks_nothing(tmp_path, monkeypatch):
    files = BlobFiles(tmp_path)
    b = _blob(1)
    files.path(b).parent.mkdir(parents=True, exist_ok=True)
    files.path(b).write_bytes(b"y")

    def eio(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", eio)
    before = _open_fds()
    with pytest.raises(OSError):
        files.sync_all([b, b])
    assert _open_fds() == before
