"""Shared test fixtures. Ceph fixtures live in `tests/fixtures_ceph.py`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest_plugins = ["tests.fixtures_ceph"]


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Path]:
    """A node directory for the runtime shim; its mounts and processes are torn down afterwards."""
    from tests.test_shim_support import cleanup_node

    n = tmp_path / "node"
    try:
        yield n
    finally:
        cleanup_node(n, tmp_path)
