"""Hostile chunk maps (issue 27): well-formed, hashing to their blob id, but with far more entries
than their blob's size allows (`layerstore.chunkmap.max_entries`)."""

from __future__ import annotations

import struct

import blake3

from layerstore import chunkmap
from layerstore import digest as digestmod

ONE_BYTE = b"x"


def one_byte_map(entries: int) -> tuple[str, bytes]:
    """(blob id, encoded map) of a blob of `entries` bytes cut into 1-byte chunks, every one the
    chunk b"x": 48 bytes of map per byte of blob. The issue's map had 4,194,304 entries (192 MiB)."""
    raw = digestmod.raw_of(digestmod.of(ONE_BYTE))
    tail = struct.pack("<II32s", 1, 0, raw)
    body = b"".join(struct.pack("<Q", i) + tail for i in range(entries))
    h = blake3.blake3(chunkmap.ID_DOMAIN)
    h.update(struct.pack("<QQ", entries, entries))
    h.update(body)
    blob = digestmod.PREFIX + h.hexdigest()
    head = struct.pack("<4sB3sIQ", chunkmap.MAGIC, chunkmap.VERSION, bytes(3), entries, entries)
    return blob, head + body
