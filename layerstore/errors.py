"""The project's one exception family.

Every expected failure is a `LayerstoreError`. It is translated at exactly three edges: errno in
the FUSE operations, an HTTP status in the store service, and an exit code plus one clear line in
the CLI. Each class carries the value each edge needs, so the edges stay a table lookup.
"""

from __future__ import annotations

import errno


class LayerstoreError(Exception):
    """Base of every expected failure."""

    exit_code = 1
    http_status = 500
    errno = errno.EIO


class ConfigError(LayerstoreError):
    """Bad configuration or arguments: unknown URL scheme, malformed URL, bad option."""

    exit_code = 2
    http_status = 400
    errno = errno.EINVAL


class BadDigest(ConfigError):
    """A string that is not a `b3:` + 64 lowercase hex digest."""


class BadKey(ConfigError):
    """A backend key that is not in the store's key grammar."""


class BadInput(LayerstoreError):
    """Input the builder refuses: malformed archive, unsafe member, invalid tree."""

    exit_code = 2
    http_status = 400
    errno = errno.EINVAL


class NotFound(LayerstoreError):
    """A missing object, blob, manifest, tag, bucket or file."""

    exit_code = 3
    http_status = 404
    errno = errno.ENOENT


class CorruptObject(LayerstoreError):
    """Stored bytes that fail decoding or verification. Wrong bytes are never returned."""

    exit_code = 4
    http_status = 502
    errno = errno.EIO


class StoreUnavailable(LayerstoreError):
    """The backend cannot be reached or refused a request for a reason that may pass."""

    exit_code = 5
    http_status = 503
    errno = errno.EIO


class PermissionDenied(LayerstoreError):
    """The backend (or the local filesystem) refuses access."""

    exit_code = 6
    http_status = 403
    errno = errno.EACCES
