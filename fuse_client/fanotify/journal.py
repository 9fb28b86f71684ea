"""The in-flight journal: events a daemon has read but not answered yet, in a shared mapping
(`CACHE/fanotify.inflight`) that outlives the daemon's process (page cache; not a reboot, which
leaves nothing pending anyway). A restarted daemon fills and answers what its predecessor left
(docs/fanotify.md, "Restart and upgrade").

Slot i belongs to event fd number i: numbers are unique among the event fds one process holds
open, and the daemon closes an event fd only after it answered the event and cleared its slot.
An fd number beyond the journal is not journalled (logged once).

Slot 0 (fd 0 is never an event's) is the header: `in_batch` is set before each `read(2)` of
events and cleared once all its events are journalled (a daemon killed in between may have left
events nobody knows of), `high` is the highest event fd number seen (what a successor reserves).
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("layerstore.fanotify")

SLOT = struct.Struct("<IiQQQQ")  # used, fd, dev, ino, offset, count
SLOTS = 1 << 16
USED = 0x464E4F54  # a recognisable marker ("TONF"): anything else is a free slot
HEADER = 0x52444848  # slot 0


@dataclass(frozen=True)
class Pending:
    fd: int
    dev: int
    ino: int
    offset: int
    count: int


class InflightJournal:
    def __init__(self, path: Path, slots: int = SLOTS) -> None:
        self.path = Path(path)
        self.slots = slots
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            size = slots * SLOT.size
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self._warned = False

    def header(self) -> tuple[bool, int]:
        """(a batch was being read, highest event fd number seen)."""
        used, in_batch, high, _, _, _ = SLOT.unpack_from(self._map, 0)
        if used != HEADER:
            return False, 0
        return bool(in_batch), high

    def begin_batch(self, high: int) -> None:
        SLOT.pack_into(self._map, 0, HEADER, 1, high, 0, 0, 0)

    def end_batch(self, high: int) -> None:
        SLOT.pack_into(self._map, 0, HEADER, 0, high, 0, 0, 0)

    def record(self, fd: int, dev: int, ino: int, offset: int, count: int) -> None:
        if not 0 < fd < self.slots:
            if not self._warned:
                self._warned = True
                log.warning("event fd %d beyond the in-flight journal (%d slots): not journalled", fd, self.slots)
            return
        SLOT.pack_into(self._map, fd * SLOT.size, USED, fd, dev, ino, offset, count)

    def clear(self, fd: int) -> None:
        if 0 < fd < self.slots:
            SLOT.pack_into(self._map, fd * SLOT.size, 0, 0, 0, 0, 0, 0)

    def pending(self) -> list[Pending]:
        """The events recorded and not cleared (what a dead daemon left)."""
        out = []
        m = self._map
        for off in range(SLOT.size, self.slots * SLOT.size, SLOT.size):
            if m[off:off + 4] != b"\x54\x4f\x4e\x46":
                continue
            used, fd, dev, ino, offset, count = SLOT.unpack_from(m, off)
            if used == USED and fd == off // SLOT.size:
                out.append(Pending(fd, dev, ino, offset, count))
        return out

    def reset(self) -> None:
        self._map[:] = bytes(len(self._map))

    def close(self) -> None:
        self._map.close()
