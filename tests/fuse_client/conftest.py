"""Fixtures of the node cache tests: a local store whose backend counts (and can fail) loads, and
a layer of the module's `src` tree built and pushed to it."""

from __future__ import annotations

from pathlib import Path

import pytest
from testkit.fuse_helpers import CountingBackend, build_and_push
from testkit.nodecache_formats import cache_format  # noqa: F401  (a fixture: both cache formats)

from erofs_builder.build import BuiltLayer
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


@pytest.fixture
def layer(store: Store, src: Path, tmp_path: Path) -> BuiltLayer:
    """`src` (each module's own tree) built and pushed."""
    return build_and_push(store, src, tmp_path / "image.erofs")
