"""Content digests: blake3, written `b3:` + 64 lowercase hex digits."""

from __future__ import annotations

import re

import blake3

from .errors import BadDigest

PREFIX = "b3:"
HEX_LEN = 64
_DIGEST_RE = re.compile(r"b3:[0-9a-f]{64}")
_HEX_RE = re.compile(r"[0-9a-f]{64}")

# blake3 releases the GIL for inputs above this size when asked to use threads.
_THREADED_MIN = 1 << 20


def parse(text: str) -> str:
    """Validate a digest string and return it unchanged; anything else is a `BadDigest`."""
    if not isinstance(text, str) or not _DIGEST_RE.fullmatch(text):
        raise BadDigest(f"not a digest (want 'b3:' + 64 lowercase hex digits): {text!r}")
    return text


def from_hex(hexdigest: str) -> str:
    if not _HEX_RE.fullmatch(hexdigest):
        raise BadDigest(f"not a blake3 hex digest: {hexdigest!r}")
    return PREFIX + hexdigest


def hex_of(digest: str) -> str:
    return parse(digest)[len(PREFIX) :]


def raw_of(digest: str) -> bytes:
    return bytes.fromhex(hex_of(digest))


def from_raw(raw: bytes) -> str:
    if len(raw) != 32:
        raise BadDigest(f"raw blake3 digest must be 32 bytes, got {len(raw)}")
    return PREFIX + raw.hex()


def of(data: bytes | bytearray | memoryview) -> str:
    """blake3 of `data`; large buffers are hashed with the GIL released."""
    h = blake3.blake3(max_threads=blake3.blake3.AUTO if len(data) >= _THREADED_MIN * 8 else 1)
    h.update(data)
    return PREFIX + h.hexdigest()


class Hasher:
    """Incremental blake3 for streams (files, images)."""

    def __init__(self) -> None:
        self._h = blake3.blake3()

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self._h.update(data)

    def digest(self) -> str:
        return PREFIX + self._h.hexdigest()
