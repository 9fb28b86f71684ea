"""Chunk objects: a versioned 16-byte header followed by the (usually zstd-compressed) payload.

    offset size field
    0      4    magic  b"LSCK"
    4      1    format version (1)
    5      1    compression id (0 = none, 1 = zstd)
    6      2    reserved, zero
    8      8    uncompressed payload length, little-endian

The object's id is the blake3 of the uncompressed payload, so identical content anywhere gives one
object. Decoding checks every field, the lengths and the digest, and raises `CorruptObject` for
malformed input of any kind: callers never see bytes that do not match their id.
"""

from __future__ import annotations

import struct

import zstandard

from . import digest as digestmod
from .errors import CorruptObject

MAGIC = b"LSCK"
VERSION = 1
COMP_NONE = 0
COMP_ZSTD = 1
HEADER = struct.Struct("<4sBBHQ")
HEADER_SIZE = HEADER.size  # 16
# A chunk larger than this is refused on decode: it guards the decompressor against bombs.
MAX_CHUNK = 64 << 20
DEFAULT_LEVEL = 3


def encode(payload: bytes | memoryview, level: int = DEFAULT_LEVEL) -> tuple[str, bytes]:
    """Return (id, object bytes)."""
    return digestmod.of(payload), pack(payload, level)


def pack(payload: bytes | memoryview, level: int = DEFAULT_LEVEL) -> bytes:
    """The object bytes for a payload whose id the caller already has.
    Incompressible payloads are stored raw."""
    if len(payload) > MAX_CHUNK:
        raise ValueError(f"chunk of {len(payload)} bytes exceeds {MAX_CHUNK}")
    comp = COMP_NONE
    body = payload
    if payload:
        packed = zstandard.ZstdCompressor(level=level, write_content_size=True).compress(payload)
        if len(packed) < len(payload):
            comp, body = COMP_ZSTD, packed
    return HEADER.pack(MAGIC, VERSION, comp, 0, len(payload)) + body


def decode(obj: bytes | memoryview, expected: str) -> bytes:
    """Verify and return the payload of a chunk object whose id should be `expected`."""
    try:
        magic, version, comp, reserved, ulen = HEADER.unpack_from(obj, 0)
    except struct.error:
        raise CorruptObject(f"chunk {expected}: truncated header ({len(obj)} bytes)") from None
    if magic != MAGIC:
        raise CorruptObject(f"chunk {expected}: bad magic {magic!r}")
    if version != VERSION:
        raise CorruptObject(f"chunk {expected}: unknown format version {version}")
    if reserved != 0:
        raise CorruptObject(f"chunk {expected}: reserved header bits set")
    if ulen > MAX_CHUNK:
        raise CorruptObject(f"chunk {expected}: absurd length {ulen}")
    body = memoryview(obj)[HEADER_SIZE:]
    if comp == COMP_NONE:
        payload = bytes(body)
    elif comp == COMP_ZSTD:
        try:
            # The frame declares its size; checking it first keeps a forged frame from
            # inflating past the header's length.
            declared = zstandard.frame_content_size(body)
            if declared != ulen:
                raise CorruptObject(f"chunk {expected}: zstd frame declares {declared} bytes")
            dobj = zstandard.ZstdDecompressor().decompressobj(read_across_frames=False)
            payload = dobj.decompress(body)
            if not dobj.eof or dobj.unused_data:
                raise CorruptObject(f"chunk {expected}: zstd frame is truncated or padded")
        except zstandard.ZstdError as e:
            raise CorruptObject(f"chunk {expected}: zstd payload is corrupt: {e}") from None
    else:
        raise CorruptObject(f"chunk {expected}: unknown compression id {comp}")
    if len(payload) != ulen:
        raise CorruptObject(
            f"chunk {expected}: payload is {len(payload)} bytes, header says {ulen}"
        )
    actual = digestmod.of(payload)
    if actual != expected:
        raise CorruptObject(f"chunk {expected}: content hashes to {actual}")
    return payload
