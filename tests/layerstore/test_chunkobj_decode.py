"""`chunkobj.decode` of zstd objects: one-shot with a decompression context per thread (the
fetch path's CPU, docs/benchmarks-fetch.md "CPU of the fetch path"), as strict as the streaming
decoder it replaced: a truncated frame, padding or a second frame is refused, the empty frame
included; contexts are never shared between threads."""

from __future__ import annotations

import os
import threading

import pytest
import zstandard

from layerstore import chunkobj, digest
from layerstore.errors import CorruptObject


def zstd_object(payload: bytes, body: bytes | None = None) -> bytes:
    if body is None:
        body = zstandard.ZstdCompressor(write_content_size=True).compress(payload)
    return chunkobj.HEADER.pack(chunkobj.MAGIC, chunkobj.VERSION, chunkobj.COMP_ZSTD, 0, len(payload)) + body


@pytest.mark.parametrize("payload", [b"", b"abc" * 5000], ids=["empty", "text"])
def test_decode_round_trip_and_refusals(payload: bytes) -> None:
    frame = zstandard.ZstdCompressor(write_content_size=True).compress(payload)
    d = digest.of(payload)
    assert chunkobj.decode(zstd_object(payload, frame), d) == payload
    for bad in (frame + b"\0", frame[:-2], frame + frame):
        with pytest.raises(CorruptObject):
            chunkobj.decode(zstd_object(payload, bad), d)


def test_decode_refuses_a_frame_that_decompresses_to_other_bytes() -> None:
    payload = b"x" * 100_000
    other = b"y" * 100_000
    with pytest.raises(CorruptObject, match="hashes to"):
        chunkobj.decode(zstd_object(other), digest.of(payload))


def test_decode_in_threads_each_with_its_own_context() -> None:
    payloads = [os.urandom(64) * (2000 + 100 * i) for i in range(8)]
    objects = [(zstd_object(p), digest.of(p), p) for p in payloads]
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(20):
                for obj, d, p in objects:
                    assert chunkobj.decode(obj, d) == p
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
