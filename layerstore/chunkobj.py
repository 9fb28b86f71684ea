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
import threading

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


def max_object_size(length: int) -> int:
    """The largest object a payload of up to `length` bytes can have: the header and zstd's
    worst case (ZSTD_COMPRESSBOUND; `pack` itself stores raw what zstd does not shrink, but an
    object encoded elsewhere may not). A store refuses a larger object before reading it."""
    return HEADER_SIZE + length + (length >> 8) + (((128 << 10) - length) >> 11 if length < (128 << 10) else 0)


MAX_OBJECT = max_object_size(MAX_CHUNK)


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
        packed = _compressor(level).compress(payload)
        if len(packed) < len(payload):
            comp, body = COMP_ZSTD, packed
    return HEADER.pack(MAGIC, VERSION, comp, 0, len(payload)) + body


try:
    # python-zstandard's cffi backend: the same zstd (bundled with the package), but its calls
    # release the GIL. The C backend (0.25) holds the GIL while it compresses a whole frame
    # (the one-shot and end-of-frame paths), so compressing in threads overlapped with nothing
    # else in the process; with this backend it does. Same frames (content size written, no
    # checksum); decoding keeps the default backend.
    from zstandard import backend_cffi as _zstd_threads
except ImportError:  # no cffi: the C backend, correct but holding the GIL
    _zstd_threads = None  # type: ignore[assignment]

_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    """A compressor per thread and level: a context is not thread-safe, and making one per
    chunk costs a few percent of compressing it."""
    cache: dict[int, zstandard.ZstdCompressor] | None = getattr(_local, "compressors", None)
    if cache is None:
        cache = _local.compressors = {}
    comp = cache.get(level)
    if comp is None:
        mod = _zstd_threads or zstandard
        comp = cache[level] = mod.ZstdCompressor(level=level, write_content_size=True)  # type: ignore[assignment]
    return comp


def _decompressor() -> zstandard.ZstdDecompressor:
    """One per thread: a decompression context is not thread-safe, and making one per chunk
    costs more than decompressing it."""
    d: zstandard.ZstdDecompressor | None = getattr(_local, "decompressor", None)
    if d is None:
        d = _local.decompressor = zstandard.ZstdDecompressor()
    return d


def _header(obj: bytes | memoryview, expected: str) -> tuple[int, int]:
    """(compression id, payload length) of a well-formed header; `CorruptObject` otherwise."""
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
    if comp not in (COMP_NONE, COMP_ZSTD):
        raise CorruptObject(f"chunk {expected}: unknown compression id {comp}")
    return comp, ulen


def check(obj: bytes | memoryview, expected: str, length: int | None = None) -> int:
    """Cheap checks of an object that a caller encoded (`pack`) for a payload whose blake3 it
    computed itself: the header, the payload length (against `length` when given), a zstd
    frame that declares exactly that length, and for a raw object the digest (its body is the
    payload). It does not decompress: a zstd body's digest is checked on every read (`decode`).
    Returns the payload length."""
    comp, ulen = _header(obj, expected)
    if length is not None and ulen != length:
        raise CorruptObject(f"chunk {expected}: header says {ulen} bytes, the payload has {length}")
    body = memoryview(obj)[HEADER_SIZE:]
    if comp == COMP_NONE:
        if len(body) != ulen:
            raise CorruptObject(f"chunk {expected}: raw body is {len(body)} bytes, header says {ulen}")
        if digestmod.of(body) != expected:
            raise CorruptObject(f"chunk {expected}: raw body hashes to {digestmod.of(body)}")
    else:
        try:
            declared = zstandard.frame_content_size(body)
        except zstandard.ZstdError as e:
            raise CorruptObject(f"chunk {expected}: zstd frame header is corrupt: {e}") from None
        if declared != ulen:
            raise CorruptObject(f"chunk {expected}: zstd frame declares {declared} bytes, header says {ulen}")
    return ulen


def decode(obj: bytes | memoryview, expected: str, max_length: int = MAX_CHUNK) -> bytes:
    """Verify and return the payload of a chunk object whose id should be `expected`; a payload
    longer than `max_length` is refused before it is decompressed."""
    comp, ulen = _header(obj, expected)
    if ulen > max_length:
        raise CorruptObject(f"chunk {expected}: {ulen} bytes, more than {max_length}")
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
            # One-shot into a buffer of the declared size, with the thread's own context: a
            # fresh context and a streaming decompressobj per chunk cost 3x the decompression
            # itself (measured: 1.8 against 0.6 s per GB; docs/benchmarks-fetch.md, "CPU of the
            # fetch path"). A truncated frame, a second frame or padding is refused (the
            # one-shot call checks nothing for an empty frame: that rare case streams).
            if ulen:
                payload = _decompressor().decompress(body, max_output_size=ulen, allow_extra_data=False)
            else:
                dobj = zstandard.ZstdDecompressor().decompressobj(read_across_frames=False)
                payload = dobj.decompress(body)
                if not dobj.eof or dobj.unused_data:
                    raise CorruptObject(f"chunk {expected}: zstd frame is truncated or padded")
        except zstandard.ZstdError as e:
            raise CorruptObject(f"chunk {expected}: zstd payload is corrupt: {e}") from None
    if len(payload) != ulen:
        raise CorruptObject(
            f"chunk {expected}: payload is {len(payload)} bytes, header says {ulen}"
        )
    actual = digestmod.of(payload)
    if actual != expected:
        raise CorruptObject(f"chunk {expected}: content hashes to {actual}")
    return payload
