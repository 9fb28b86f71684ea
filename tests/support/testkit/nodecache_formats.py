"""Node cache tests over both cache formats (`fuse_client.nodecache.frames`): a fixture that makes
every cache created in the test `plain` or `zstd`, and blob bytes that zstd compresses about two
to one (random bytes would be stored raw by the store and by a zstd cache alike)."""

from __future__ import annotations

import random

import pytest

from fuse_client.nodecache.cachedir import FORMAT_ENV


def compressible(seed: int, size: int) -> bytes:
    """`size` bytes: runs of 1 KiB random bytes and 1 KiB of one repeated byte."""
    rng = random.Random(seed)
    out = bytearray()
    while len(out) < size:
        out += rng.randbytes(1024)
        out += bytes([rng.randrange(256)]) * 1024
    return bytes(out[:size])


@pytest.fixture(params=["plain", "zstd"])
def cache_format(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Caches created in this test get this format (through $LAYERSTORE_CACHE_FORMAT)."""
    monkeypatch.setenv(FORMAT_ENV, request.param)
    return str(request.param)
