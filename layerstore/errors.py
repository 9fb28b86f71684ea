"""The project's one exception family, and the one registry of its classes.

Every expected failure is a `LayerstoreError`. It is translated at exactly three edges: errno in
the FUSE operations, an HTTP status in the store service and the daemon's control socket, and an
exit code plus one clear line in the CLI. Each class carries the value each edge needs, so the
edges stay a table lookup. Every subclass, in whatever package it is defined, registers itself
here by name: an error that crossed a socket (`to_wire`) comes back as the same class
(`from_wire`), so a client raises what the server raised and the CLI exits with its code.

Exit codes of `layerctl` and the mount helpers (this table is the one place they are written;
`tests/layerstore/test_errors.py` checks every class against it):

| code | meaning | classes |
|------|---------|---------|
| 0    | success | |
| 1    | an unexpected failure (a bug, or an error no class below describes) | `LayerstoreError`, `ShimError` |
| 2    | bad arguments, configuration or input | `ConfigError`, `BadInput`, `BlobPinned`, ... |
| 3    | not found | `NotFound`, `SandboxNotFound`, `BlobIncomplete` |
| 4    | corrupt data: stored bytes failed decoding or verification | `CorruptObject` |
| 5    | the store (or the node daemon's store) is unavailable; may pass | `StoreUnavailable`, `DaemonError` |
| 6    | permission denied, or an untrusted manifest | `PermissionDenied`, `UntrustedManifest` |
| 7    | the node daemon is not running, or another process holds its cache | `NodeUnavailable` |
| 130  | interrupted (SIGINT, SIGTERM, SIGHUP: the sandbox is stopped and removed) | |
| 141  | broken pipe (stdout closed early) | |
"""

from __future__ import annotations

import errno
from typing import Any

EXIT_CODES = {0: "success", 1: "unexpected failure", 2: "bad arguments, configuration or input", 3: "not found",
              4: "corrupt data", 5: "store unavailable", 6: "permission denied",
              7: "node daemon not running or its cache busy", 130: "interrupted", 141: "broken pipe"}

_REGISTRY: dict[str, type[LayerstoreError]] = {}


class LayerstoreError(Exception):
    """Base of every expected failure."""

    exit_code = 1
    http_status = 500
    errno = errno.EIO
    temporary = False  # may pass on its own: worth retrying (see layerstore.retry)

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        known = _REGISTRY.get(cls.__name__)
        if known is not None and known.__qualname__ != cls.__qualname__:
            raise TypeError(f"two error classes named {cls.__name__}: {known.__module__}, {cls.__module__}")
        _REGISTRY[cls.__name__] = cls

    def details(self) -> dict[str, Any]:
        """Fields beyond the message that cross a socket with the error (see `from_details`)."""
        return {}

    @classmethod
    def from_details(cls, message: str, details: dict[str, Any]) -> LayerstoreError:
        """The error rebuilt on the far side of a socket from its message and `details()`."""
        return cls(message)

    def to_wire(self) -> dict[str, Any]:
        return {"error": str(self), "kind": type(self).__name__, "exit_code": self.exit_code, **self.details()}


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
    temporary = True


class PermissionDenied(LayerstoreError):
    """The backend (or the local filesystem) refuses access."""

    exit_code = 6
    http_status = 403
    errno = errno.EACCES


class NodeUnavailable(LayerstoreError):
    """The node daemon is not running, or another process holds its cache."""

    exit_code = 7
    http_status = 503


_REGISTRY["LayerstoreError"] = LayerstoreError


def registered() -> dict[str, type[LayerstoreError]]:
    """Every error class loaded so far, by name."""
    return dict(_REGISTRY)


def error_class(kind: str) -> type[LayerstoreError] | None:
    """The registered class of that name (None if no loaded module defines one)."""
    return _REGISTRY.get(kind)


def from_wire(obj: object, fallback: str = "") -> LayerstoreError:
    """The error an answer carries (`to_wire`'s dict): the class of its name, else a plain
    `LayerstoreError` that keeps the exit code it was sent with."""
    if not isinstance(obj, dict):
        return LayerstoreError(fallback or "malformed error answer")
    msg = str(obj.get("error") or fallback)
    cls = error_class(str(obj.get("kind") or ""))
    if cls is not None:
        try:
            return cls.from_details(msg, obj)
        except Exception:  # a class whose constructor wants more than a message
            pass
    err = LayerstoreError(msg)
    code = obj.get("exit_code")
    if isinstance(code, int) and code in EXIT_CODES and code:
        err.exit_code = code
    return err
