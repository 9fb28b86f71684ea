"""The fanotify event parser and responses (pure, no kernel): round trips and hostile buffers."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fuse_client.fanotify import abi

events = st.builds(
    abi.Event,
    mask=st.sampled_from([abi.FAN_PRE_ACCESS, abi.FAN_ACCESS_PERM, abi.FAN_OPEN_PERM, abi.FAN_Q_OVERFLOW,
                          abi.FAN_ACCESS]),
    fd=st.integers(-1, 1 << 20),
    pid=st.integers(0, 1 << 22),
    offset=st.none() | st.integers(0, (1 << 63) - 1),
    count=st.none(),
).map(lambda e: e if e.offset is None else abi.Event(e.mask, e.fd, e.pid, e.offset, e.offset % 1_000_000))


@settings(max_examples=40)
@given(st.lists(events, max_size=40))
def test_events_round_trip(evs: list[abi.Event]) -> None:
    buf = b"".join(abi.encode_event(e) for e in evs)
    assert abi.parse_events(buf) == evs


@settings(max_examples=40)
@given(st.lists(events, min_size=1, max_size=5), st.data())
def test_a_truncated_or_bent_buffer_is_a_parse_error_never_a_wrong_event(evs: list[abi.Event],
                                                                         data: st.DataObject) -> None:
    buf = bytearray(b"".join(abi.encode_event(e) for e in evs))
    cut = data.draw(st.integers(1, len(buf) - 1))
    truncated = bytes(buf[:cut])
    try:
        got = abi.parse_events(truncated)
    except abi.ParseError:
        return
    # A cut on an event boundary parses as the events before it, exactly.
    assert got == evs[:len(got)] and sum(len(abi.encode_event(e)) for e in got) == cut


@settings(max_examples=40)
@given(st.binary(max_size=300))
def test_garbage_parses_or_raises_parse_error(buf: bytes) -> None:
    try:
        got = abi.parse_events(buf)
    except abi.ParseError:
        return
    assert all(isinstance(e, abi.Event) for e in got)


def test_unknown_info_records_are_skipped_and_bad_lengths_refused() -> None:
    unknown = struct.pack("<BBH", 99, 0, 8) + b"\0" * 4
    rng = abi.RANGE.pack(abi.FAN_EVENT_INFO_TYPE_RANGE, 0, abi.RANGE.size, 0, 4096, 8192)
    body = unknown + rng
    buf = abi.METADATA.pack(abi.METADATA.size + len(body), 3, 0, abi.METADATA.size, abi.FAN_PRE_ACCESS, 7, 42) + body
    assert abi.parse_events(buf) == [abi.Event(abi.FAN_PRE_ACCESS, 7, 42, 4096, 8192)]
    zero_len = (abi.METADATA.pack(abi.METADATA.size + 4, 3, 0, abi.METADATA.size, 1, 7, 42)
                + struct.pack("<BBH", 6, 0, 0))
    with pytest.raises(abi.ParseError):
        abi.parse_events(zero_len)
    with pytest.raises(abi.ParseError):  # another ABI version
        abi.parse_events(abi.METADATA.pack(abi.METADATA.size, 4, 0, abi.METADATA.size, 1, 7, 42))
    short_range = abi.METADATA.pack(abi.METADATA.size + 8, 3, 0, abi.METADATA.size, 1, 7, 42) + struct.pack(
        "<BBHI", abi.FAN_EVENT_INFO_TYPE_RANGE, 0, 8, 0)
    with pytest.raises(abi.ParseError):
        abi.parse_events(short_range)


@settings(max_examples=40)
@given(st.integers(-(1 << 31), (1 << 31) - 1), st.booleans(), st.integers(0, 255))
def test_responses(fd: int, allow: bool, err: int) -> None:
    got = abi.decode_response(abi.response(fd, allow=allow, errno=err))
    assert got == (fd, allow, 0 if allow else err)


def test_deny_eio_is_fan_deny_errno() -> None:
    fd, resp = abi.RESPONSE.unpack(abi.response(5, allow=False, errno=5))
    assert resp == abi.FAN_DENY | (5 << 24)


@settings(max_examples=40)
@given(st.integers(0, 1 << 40), st.integers(0, 1 << 30), st.integers(0, 1 << 40))
def test_page_span_stays_inside_the_file(offset: int, count: int, size: int) -> None:
    span = abi.page_span(offset, count, size)
    if span is None:
        assert count == 0 or offset >= size
    else:
        assert 0 <= span[0] < span[1] <= size and span[0] == offset
