"""Fixtures of the node cache tests: a local store whose backend counts (and can fail) loads."""

from __future__ import annotations

from pathlib import Path

import pytest
from testkit.fuse_helpers import CountingBackend
from testkit.nodecache_formats import cache_format  # noqa: F401  (a fixture: both cache formats)

from layerstore.backends.posix import PosixBackend
from layerstore.store import Store


@pytest.fixture
def backend(tmp_path: Path) -> CountingBackend:
    inner = PosixBackend(tmp_path / "store", fsync=False)
    inner.create()
    return CountingBackend(inner)


@pytest.fixture
def store(backend: CountingBackend) -> Store:
    s = Store(backend)
    s.init()
    return s
