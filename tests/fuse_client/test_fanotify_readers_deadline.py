"""The deadline of the reads in a child (testkit.fanotify_readers), which the kill and upgrade tests
use so that a read that never returns fails the test instead of hanging the suite: a permission
event nobody answers (a real group of this process, a FAN_ACCESS_PERM mark on a file of a tmpfs
mounted for the test) keeps the child's readers in the kernel; the deadline passes, the test gets
a one-line diagnosis naming where they wait, the mount is detached lazily; closing the group
(every pending event allowed) lets the child go."""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

import pytest
from testkit.fanotify_readers import StuckReads, reading_in_child, verify_in_child

from fuse_client.fanotify import abi
from layerstore.linux import MountError, mount, umount
from layerstore.linux.fanotify import fanotify_init, fanotify_mark

pytestmark = pytest.mark.root


@pytest.fixture
def unanswered(tmp_path: Path):  # type: ignore[no-untyped-def]
    """(tmpfs mount, src dir, [file]): reads of the file on the mount wait for an answer."""
    mnt, src = tmp_path / "mnt", tmp_path / "src"
    mnt.mkdir()
    src.mkdir()
    mount("tmpfs", mnt, "tmpfs", 0, "size=1m")
    (mnt / "f").write_bytes(b"x" * 8192)
    (src / "f").write_bytes(b"x" * 8192)
    group = fanotify_init(abi.FAN_CLASS_CONTENT | abi.FAN_CLOEXEC, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fanotify_mark(group, abi.FAN_MARK_ADD, abi.FAN_ACCESS_PERM, mnt / "f", "mark")
        yield mnt, src, [Path("f")]
    finally:
        os.close(group)  # (every pending event allowed: the child's readers return)
        with contextlib.suppress(MountError):  # (detached by the deadline already)
            umount(mnt, lazy=True)


def test_stuck_readers_fail_with_their_stacks_and_the_mount_detached(unanswered) -> None:  # type: ignore[no-untyped-def]
    mnt, src, files = unanswered
    with pytest.raises(StuckReads) as info, reading_in_child(mnt, src, files, n=4, deadline=8) as readers:
        readers.wait_reads(1)
    msg = str(info.value)
    assert "\n" not in msg
    assert re.search(r"\b[1-4]x fanotify_handle_event<-", msg), msg  # (all 4 unless the machine is slow)
    assert str(mnt) in msg and not os.path.ismount(mnt)


def test_a_stuck_verification_fails_with_its_stack(unanswered) -> None:  # type: ignore[no-untyped-def]
    mnt, src, files = unanswered
    with pytest.raises(StuckReads, match=r"verification reads stuck after 8 s .*: 1x fanotify_handle_event<-"):
        verify_in_child(mnt, src, files, deadline=8)
    assert not os.path.ismount(mnt)


def test_reads_that_return_pass(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"abc")
    with reading_in_child(tmp_path, tmp_path, [Path("a")], n=2, deadline=30) as readers:
        readers.wait_reads(10)
    assert not readers.errors
    verify_in_child(tmp_path, tmp_path, [Path("a")], deadline=30)
