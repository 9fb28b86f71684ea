"""Decompressed input streams, the codec chosen by magic bytes: none, gzip, zstd, xz, bzip2.

Used by the tar reader and the OCI/docker-archive sources. Every stream is read to its end by
its consumer, so gzip CRCs and zstd frame ends are verified; a zstd stream cut off inside a
frame is an error (the library's own stream reader would report a clean end). `DECODE_ERRORS`
are the exceptions a corrupt stream raises while it is read.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import zlib
from typing import Protocol

import zstandard

READ_SIZE = 1 << 20
_ZSTD_FEED = 4096  # small input pieces bound the output of one zstd call (decompression bombs)
DECODE_ERRORS: tuple[type[BaseException], ...] = (OSError, EOFError, zlib.error, lzma.LZMAError,
                                                  zstandard.ZstdError, ValueError)


class Reader(Protocol):
    def read(self, n: int = -1, /) -> bytes: ...


class _Prefixed:
    """`raw` with bytes already read for sniffing put back in front."""

    def __init__(self, head: bytes, raw: Reader) -> None:
        self._head, self._raw = head, raw

    def read(self, n: int = -1, /) -> bytes:
        if self._head:
            out = self._head if n < 0 else self._head[:n]
            self._head = self._head[len(out):]
            return out
        return self._raw.read(n)


class _ZstdReader:
    """zstd frames in sequence, with truncation detected (the library's stream reader reports a
    cut-off frame as a clean end of stream)."""

    def __init__(self, raw: Reader) -> None:
        self._raw = raw
        self._dctx = zstandard.ZstdDecompressor()
        self._obj = self._dctx.decompressobj()
        self._in_frame = False
        self._pending = b""
        self._buf = bytearray()
        self._eof = False

    def read(self, n: int = -1, /) -> bytes:
        want = READ_SIZE if n < 0 else n
        while len(self._buf) < want and not self._eof:
            if not self._pending:
                self._pending = self._raw.read(64 << 10)
                if not self._pending:
                    if self._in_frame:
                        raise zstandard.ZstdError("stream ends inside a frame")
                    self._eof = True
                    break
            piece, self._pending = self._pending[:_ZSTD_FEED], self._pending[_ZSTD_FEED:]
            while piece:
                self._in_frame = True
                self._buf += self._obj.decompress(piece)
                if self._obj.eof:
                    piece = self._obj.unused_data
                    self._obj = self._dctx.decompressobj()
                    self._in_frame = False
                else:
                    piece = b""
        out = bytes(self._buf[:want])
        del self._buf[:want]
        return out


def open_decompressed(stream: Reader, *, name: str) -> tuple[Reader, str]:
    """The decompressed content of `stream` and the codec's name, chosen by magic bytes."""
    head = b""
    while len(head) < 6:
        more = stream.read(6 - len(head))
        if not more:
            break
        head += more
    src = _Prefixed(head, stream)
    if head.startswith(b"\x1f\x8b"):
        return gzip.GzipFile(fileobj=src, mode="rb"), "gzip"  # type: ignore[arg-type]
    if head.startswith(b"\x28\xb5\x2f\xfd"):
        return _ZstdReader(src), "zstd"
    if head.startswith(b"\xfd7zXZ\x00"):
        return lzma.LZMAFile(src), "xz"  # type: ignore[arg-type]
    if head.startswith(b"BZh"):
        return bz2.BZ2File(src), "bzip2"  # type: ignore[arg-type]
    return src, "tar"
