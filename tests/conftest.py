"""Shared test fixtures (the Ceph ones live in the development kit, `testkit.fixtures_ceph`) and
the one place that decides what a test marked `root` does without root: it is skipped."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest_plugins = ["testkit.fixtures_ceph"]


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Path]:
    """A node directory for the runtime shim; its mounts and processes are torn down afterwards."""
    from testkit.shim_support import cleanup_node

    n = tmp_path / "node"
    try:
        yield n
    finally:
        cleanup_node(n, tmp_path)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.geteuid() == 0:
        return
    skip = pytest.mark.skip(reason="needs root (mounts)")
    for item in items:
        if item.get_closest_marker("root") is not None:
            item.add_marker(skip)
