"""fanotify's user ABI (include/uapi/linux/fanotify.h) and a pure parser of what `read(2)` on a
group returns. No I/O here: `kernel` does the system calls.

An event is `struct fanotify_event_metadata` (24 bytes: event_len u32, vers u8, reserved u8,
metadata_len u16, mask u64, fd s32, pid s32) followed by info records up to `event_len`, each
starting with `struct fanotify_event_info_header` (info_type u8, pad u8, len u16). Pre-content
events carry a range record (`FAN_EVENT_INFO_TYPE_RANGE`: header, pad u32, offset u64, count u64).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

# fanotify_init flags
FAN_CLOEXEC = 0x00000001
FAN_NONBLOCK = 0x00000002
FAN_CLASS_NOTIF = 0x00000000
FAN_CLASS_CONTENT = 0x00000004
FAN_CLASS_PRE_CONTENT = 0x00000008
FAN_UNLIMITED_QUEUE = 0x00000010
FAN_UNLIMITED_MARKS = 0x00000020

# event masks
FAN_ACCESS = 0x00000001
FAN_MODIFY = 0x00000002
FAN_Q_OVERFLOW = 0x00004000
FAN_OPEN_PERM = 0x00010000
FAN_ACCESS_PERM = 0x00020000
FAN_OPEN_EXEC_PERM = 0x00040000
FAN_PRE_ACCESS = 0x00100000
PERMISSION_EVENTS = FAN_OPEN_PERM | FAN_ACCESS_PERM | FAN_OPEN_EXEC_PERM | FAN_PRE_ACCESS

# fanotify_mark flags
FAN_MARK_ADD = 0x00000001
FAN_MARK_REMOVE = 0x00000002
FAN_MARK_DONT_FOLLOW = 0x00000004
FAN_MARK_FLUSH = 0x00000080
FAN_MARK_INODE = 0x00000000

# info records
FAN_EVENT_INFO_TYPE_FID = 1
FAN_EVENT_INFO_TYPE_DFID_NAME = 2
FAN_EVENT_INFO_TYPE_DFID = 3
FAN_EVENT_INFO_TYPE_PIDFD = 4
FAN_EVENT_INFO_TYPE_ERROR = 5
FAN_EVENT_INFO_TYPE_RANGE = 6

# responses
FAN_ALLOW = 0x01
FAN_DENY = 0x02
FAN_ERRNO_BITS = 8
FAN_ERRNO_SHIFT = 32 - FAN_ERRNO_BITS
FAN_ERRNO_MASK = (1 << FAN_ERRNO_BITS) - 1

FANOTIFY_METADATA_VERSION = 3
FAN_NOFD = -1

METADATA = struct.Struct("<IBBHQii")  # 24 bytes
INFO_HEADER = struct.Struct("<BBH")
RANGE = struct.Struct("<BBHIQQ")  # 24 bytes
RESPONSE = struct.Struct("<iI")


class ParseError(ValueError):
    """The buffer is not a well-formed sequence of events (a kernel/ABI mismatch)."""


@dataclass(frozen=True, slots=True)
class Event:
    mask: int
    fd: int  # FAN_NOFD for an overflow
    pid: int  # 0 when the accessing process is outside the listener's pid namespace
    offset: int | None = None  # the range of a pre-content event
    count: int | None = None

    @property
    def is_permission(self) -> bool:
        return bool(self.mask & PERMISSION_EVENTS)


def parse_events(buf: bytes | bytearray | memoryview) -> list[Event]:
    """Every event in one `read(2)` of a group. `ParseError` for a buffer that does not hold
    whole, well-formed events (version, lengths); unknown info records are skipped."""
    view = memoryview(buf)
    out: list[Event] = []
    pos, end = 0, len(view)
    while pos < end:
        if end - pos < METADATA.size:
            raise ParseError(f"truncated event header at {pos} ({end - pos} bytes left)")
        event_len, vers, _, meta_len, mask, fd, pid = METADATA.unpack_from(view, pos)
        if vers != FANOTIFY_METADATA_VERSION:
            raise ParseError(f"event metadata version {vers}, expected {FANOTIFY_METADATA_VERSION}")
        if meta_len < METADATA.size or event_len < meta_len or pos + event_len > end:
            raise ParseError(f"bad event lengths at {pos}: event_len={event_len} metadata_len={meta_len}")
        offset = count = None
        ipos, iend = pos + meta_len, pos + event_len
        while ipos < iend:
            if iend - ipos < INFO_HEADER.size:
                raise ParseError(f"truncated info record at {ipos}")
            itype, _, ilen = INFO_HEADER.unpack_from(view, ipos)
            if ilen < INFO_HEADER.size or ipos + ilen > iend:
                raise ParseError(f"bad info record length {ilen} at {ipos}")
            if itype == FAN_EVENT_INFO_TYPE_RANGE:
                if ilen < RANGE.size:
                    raise ParseError(f"short range record ({ilen} bytes)")
                _, _, _, _, offset, count = RANGE.unpack_from(view, ipos)
            ipos += ilen
        out.append(Event(mask, fd, pid, offset, count))
        pos += event_len
    return out


def encode_event(ev: Event) -> bytes:
    """The bytes the kernel would give for `ev` (tests, and the journal's format)."""
    info = b""
    if ev.offset is not None:
        info = RANGE.pack(FAN_EVENT_INFO_TYPE_RANGE, 0, RANGE.size, 0, ev.offset, ev.count or 0)
    return METADATA.pack(METADATA.size + len(info), FANOTIFY_METADATA_VERSION, 0, METADATA.size, ev.mask, ev.fd,
                         ev.pid) + info


def response(fd: int, *, allow: bool, errno: int = 0) -> bytes:
    """`struct fanotify_response` for the event `fd`: FAN_ALLOW, or FAN_DENY with an errno
    (FAN_DENY_ERRNO: the reader's read fails with it; 0: EPERM)."""
    if allow:
        return RESPONSE.pack(fd, FAN_ALLOW)
    return RESPONSE.pack(fd, FAN_DENY | ((errno & FAN_ERRNO_MASK) << FAN_ERRNO_SHIFT))


def decode_response(data: bytes) -> tuple[int, bool, int]:
    fd, resp = RESPONSE.unpack(data)
    return fd, bool(resp & FAN_ALLOW), (resp >> FAN_ERRNO_SHIFT) & FAN_ERRNO_MASK


def page_span(offset: int, count: int, size: int) -> tuple[int, int] | None:
    """The byte range [lo, hi) of a file of `size` bytes an access of (offset, count) touches,
    or None if nothing (past the end, or an empty access)."""
    if count <= 0 or offset >= size:
        return None
    return offset, min(size, offset + count)


# fd numbers of the events of one read(2): the kernel gives each event fd the lowest free number
# of the reader's table, so they are the lowest free numbers at the time of the read.

def events_per_read(read_size: int) -> int:
    """At most how many events one `read(2)` of `read_size` bytes returns."""
    return max(1, read_size // METADATA.size)


def unknown_fd_bound(high: int, open_fds: int, read_size: int) -> int:
    """An upper bound of the fd number any event of the next `read(2)` of `read_size` bytes can
    get, with `open_fds` fds open in the reader: at least `events_per_read` numbers are free
    below `open_fds + events_per_read`, and each event gets the lowest free one. `high`: a bound
    promised already (not lowered by this)."""
    return max(high, open_fds + events_per_read(read_size))


def count_marks(fdinfo: bytes) -> int:
    """The marks of a fanotify group, from its /proc/PID/fdinfo/FD text (one `fanotify ino:`,
    `fanotify mnt_id:` or `fanotify sdev:` line each)."""
    return sum(1 for line in fdinfo.splitlines()
               if line.startswith((b"fanotify ino:", b"fanotify mnt_id:", b"fanotify sdev:")))
