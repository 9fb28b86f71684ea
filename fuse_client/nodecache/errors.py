"""The node cache's errors, in one place. Each registers itself with `layerstore.errors` by name,
so an error that crossed the control socket comes back as the same class (`from_wire`).

Importing this module imports no trio: the blocking control client needs these classes.
"""

from __future__ import annotations

from typing import Any

from layerstore.errors import LayerstoreError, NodeUnavailable


class BlobIncomplete(LayerstoreError):
    """A pin was asked for a blob whose chunks are not all committed in the node cache."""

    exit_code = 3
    http_status = 409

    def __init__(self, message: str, missing_bytes: int | None = None) -> None:
        super().__init__(message)
        self.missing_bytes = missing_bytes

    def details(self) -> dict[str, Any]:
        return {"complete": False, "missing_bytes": self.missing_bytes}

    @classmethod
    def from_details(cls, message: str, details: dict[str, Any]) -> BlobIncomplete:
        missing = details.get("missing_bytes")
        return cls(message, missing if isinstance(missing, int) else None)


class BlobPinned(LayerstoreError):
    """An explicit eviction of a blob that a holder has pinned (its data file is in use as an image)."""

    exit_code = 2
    http_status = 409


class NoPlainImage(LayerstoreError):
    """A pin (a direct mount) of a blob in a zstd node cache: its data file holds compressed
    chunks, not the image; the blob is read through the daemon's file instead."""

    exit_code = 3
    http_status = 409


class CacheIOError(LayerstoreError):
    """The node cache's own disk failed (not the store); `errno_value` is the OS error's errno
    when there was one (ENOSPC: the disk is full)."""

    def __init__(self, message: str, errno_value: int | None = None) -> None:
        super().__init__(message)
        self.errno_value = errno_value


class CacheBusy(NodeUnavailable):
    """Another process (a daemon, or an offline cache command) holds the cache directory."""
