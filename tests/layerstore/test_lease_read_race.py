"""`read_leases` never skips a live lease because a shard went between its listing and its read
(a node's rotation, `Lease.replace_keys`, writes the new head and then deletes the old shards): a
skipped lease would leave every key it holds to the collector. A store that cannot be read stops
the reader instead of dropping the lease."""

from __future__ import annotations

from pathlib import Path

import pytest

from layerstore import leases
from layerstore.backends import open_backend
from layerstore.errors import StoreUnavailable

A = "chunks/aa/" + "a" * 64
B = "chunks/bb/" + "b" * 64


class RotatingMidRead:
    """A backend that runs `replace_keys` on the lease the first time one of its shards is
    loaded, just before the load: the shard is gone by the time it is read."""

    def __init__(self, backend, lease: leases.Lease, new_keys: list[str]) -> None:
        self._b, self._lease, self._new, self.rotated = backend, lease, new_keys, 0

    def __getattr__(self, name: str):
        return getattr(self._b, name)

    def load(self, key: str, *args, **kw) -> bytes:
        if not self.rotated and "/s" in key:
            self.rotated += 1
            self._lease.replace_keys(self._new)
        return self._b.load(key, *args, **kw)


def test_a_shard_deleted_by_a_rotation_mid_read_keeps_the_lease(tmp_path: Path) -> None:
    backend = open_backend(str(tmp_path / "store"))
    backend.create()
    lease = leases.Lease(backend, kind="node", renew=False, ttl=600)
    lease.hold([A])
    racing = RotatingMidRead(backend, lease, [A, B])
    found = list(leases.read_leases(racing))
    assert racing.rotated == 1
    assert [x.id for x in found] == [lease.id]
    assert {A, B} <= found[0].keys  # the new head's set, read again after the shard went
    lease.release()


def test_an_unreadable_store_stops_the_reader(tmp_path: Path) -> None:
    backend = open_backend(str(tmp_path / "store"))
    backend.create()
    lease = leases.Lease(backend, kind="node", renew=False, ttl=600)
    lease.hold([A])

    class Down:
        def __getattr__(self, name: str):
            return getattr(backend, name)

        def load(self, key: str, *args, **kw) -> bytes:
            raise StoreUnavailable("store down")

    with pytest.raises(StoreUnavailable):
        list(leases.read_leases(Down()))
    lease.release()
