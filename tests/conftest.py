"""Shared test fixtures. Ceph fixtures live in `tests/fixtures_ceph.py`."""

from __future__ import annotations

pytest_plugins = ["tests.fixtures_ceph"]
