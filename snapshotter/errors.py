"""The snapshotter's errors (in the project's one family); `server` maps each to the gRPC status
containerd's errdefs expects."""

from __future__ import annotations

from layerstore.errors import ConfigError, LayerstoreError, NotFound


class SnapshotNotFound(NotFound):
    """No snapshot with that key (gRPC NOT_FOUND)."""


class SnapshotExists(ConfigError):
    """The key or name is taken (gRPC ALREADY_EXISTS); also the answer to a remote layer's
    Prepare: the snapshot exists, committed, under the target's name."""


class SnapshotPrecondition(ConfigError):
    """The snapshot is not in a state that allows the call: removing a parent, committing or
    mounting a committed snapshot (gRPC FAILED_PRECONDITION)."""


class SnapshotterBusy(LayerstoreError):
    """Another snapshotter process serves this snapshot root."""

    exit_code = 7
