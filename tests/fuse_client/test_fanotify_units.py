"""The fanotify front end's guards without a kernel group (docs/fanotify.md): the bound of the fd
numbers a successor reserves, events beyond it denied with EIO at once (never held), a group's
marks counted from its fdinfo, the holder's idle exit rule, a sequential miss continuing the
library's stream. A pipe stands in for the group: the answers the front end writes are read back."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from testkit.fanotify_helpers import front_on_a_pipe, pipe_answers

from fuse_client.fanotify import abi, fdstore, holder
from fuse_client.fanotify.frontend import RESERVE_MARGIN


@settings(max_examples=60)
@given(st.sets(st.integers(0, 600), max_size=400), st.sampled_from([24, 48, 4096, 65536]))
def test_the_events_of_one_read_get_numbers_below_the_bound(used: set[int], read_size: int) -> None:
    """The kernel gives each event fd the lowest free number: with `len(used)` fds open, the
    numbers of every event one read can return are below the bound."""
    used |= {0, 1, 2}
    bound = abi.unknown_fd_bound(0, len(used), read_size)
    n, got = 0, []
    while len(got) < abi.events_per_read(read_size):
        if n not in used:
            got.append(n)
        n += 1
    assert max(got) <= bound
    assert abi.unknown_fd_bound(bound + 7, len(used), read_size) == bound + 7  # a promise is never lowered


def test_marks_counted_from_fdinfo() -> None:
    info = (b"pos:\t0\nflags:\t02000002\nmnt_id:\t17\nino:\t1038\nfanotify flags:39 event-flags:88000\n"
            b"fanotify ino:ea2017 sdev:fe00000 mflags:0 mask:100000 ignored_mask:0 fhandle-bytes:8\n"
            b"fanotify ino:ea2018 sdev:fe00000 mflags:0 mask:100000 ignored_mask:0 fhandle-bytes:8\n")
    assert abi.count_marks(info) == 2
    assert abi.count_marks(info.split(b"fanotify ino:")[0]) == 0


def test_the_holder_exits_only_unclaimed_idle_markless_and_with_nothing_attached() -> None:
    assert holder.useless(0, 0.0, 31.0, 0, 0, idle_exit=30)
    assert not holder.useless(1, 0.0, 31.0, 0, 0, idle_exit=30)  # a daemon claims it
    assert not holder.useless(0, 0.0, 29.0, 0, 0, idle_exit=30)  # not idle long enough
    assert not holder.useless(0, 0.0, 31.0, 1, 0, idle_exit=30)  # a mark: reads would see zeros
    assert not holder.useless(0, 0.0, 31.0, 0, 1, idle_exit=30)  # a layer mounted on the group


@pytest.fixture
def front(tmp_path: Path):  # type: ignore[no-untyped-def]
    with front_on_a_pipe(tmp_path) as got:
        yield got


def test_an_event_fd_beyond_the_bound_is_denied_eio_and_closed(front) -> None:  # type: ignore[no-untyped-def]
    fe, r = front
    fe.promise_bound()
    limit = fe.fd_bound + RESERVE_MARGIN
    beyond = limit + 5
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        os.dup2(null, beyond)
        inside = os.dup(null)  # a low number: within the bound (an inode nobody attached)
    finally:
        os.close(null)
    buf = b"".join(abi.encode_event(abi.Event(abi.FAN_PRE_ACCESS, fd, 1, 0, 4096)) for fd in (beyond, inside))
    fe.journal.begin_batch(fe.fd_bound)
    slow = fe.process_batch(buf)
    assert pipe_answers(r) == [(beyond, False, errno.EIO)]
    with pytest.raises(OSError):
        os.fstat(beyond)  # closed: never held
    assert fe.stats.fd_bound_denied == 1
    # The one within the bound is journalled and handed on (the trio side answers it).
    assert [x[0] for x in slow] == [inside]
    assert [p.fd for p in fe.journal.pending()] == [inside]
    in_batch, high = fe.journal.header()
    assert not in_batch and high == fe.fd_bound
    os.close(inside)


def test_the_journal_is_never_asked_for_a_slot_it_lacks(front) -> None:  # type: ignore[no-untyped-def]
    fe, r = front
    fe.journal.end_batch(10 ** 6)  # a predecessor promised a bound beyond the journal
    fe.open_group(fe.group, "g", False)  # (taken over: its bound is this one's floor)
    assert fe.fd_limit() == fe.journal.slots - 1


def test_a_garbage_batch_leaves_the_batch_flag_for_a_successor(front) -> None:  # type: ignore[no-untyped-def]
    fe, r = front
    fe.journal.begin_batch(99)
    assert fe.process_batch(b"\x01" * 30) == []
    assert fe.journal.header() == (True, 99)
    assert pipe_answers(r) == []


def test_the_fd_store_names_and_addresses() -> None:
    env = {"LISTEN_PID": "42", "LISTEN_FDS": "3", "LISTEN_FDNAMES": "other:fanotify-ab12:fanotify-"}
    assert fdstore.listened(env, 42) == [(4, "ab12")]  # fd 3 + index; an empty id is no group
    assert fdstore.listened(env, 43) == []  # passed to another process
    assert fdstore.listened({**env, "LISTEN_FDS": "x"}, 42) == []
    assert fdstore.notify_address("@sd") == b"\0sd"
    assert fdstore.notify_address("/run/systemd/notify") == "/run/systemd/notify"
    assert fdstore.notify_address("") is None and fdstore.notify_address("vsock:2:3") is None


def test_the_fd_store_message_carries_the_group(tmp_path: Path) -> None:
    import array
    import socket

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "n"))
    r, w = os.pipe()
    try:
        assert fdstore.store(r, "cafe", env={"NOTIFY_SOCKET": str(tmp_path / "n")})
        fds = array.array("i")
        msg, anc, _, _ = sock.recvmsg(256, socket.CMSG_SPACE(fds.itemsize))
        fds.frombytes(anc[0][2])
        assert msg == b"FDSTORE=1\nFDNAME=fanotify-cafe\n"
        assert os.fstat(fds[0]).st_ino == os.fstat(r).st_ino  # the same open file
        os.close(fds[0])
        assert not fdstore.store(r, "cafe", env={})  # no manager: nothing sent
    finally:
        sock.close()
        os.close(r)
        os.close(w)
