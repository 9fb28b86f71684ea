"""The runtime shim's members of the project's exception family (layerstore.errors)."""

from __future__ import annotations

import errno

from layerstore.errors import ConfigError, LayerstoreError, NotFound, StoreUnavailable


class ShimError(LayerstoreError):
    """A mount, overlay, bundle or runtime step failed on this node."""


class SandboxExists(ConfigError):
    """A sandbox id (or its upper directory) is already taken on this node."""


class NodeFull(ConfigError):
    """The node's disk cannot hold what was asked for (a kept upper larger than its free space,
    counting what the other kept uppers may still take)."""

    errno = errno.ENOSPC


class SandboxNotFound(NotFound):
    """No sandbox of that id (or mounted at that target) on this node."""


class DaemonError(StoreUnavailable):
    """The node daemon could not be started, or serves another store than the one asked for."""


class RuntimeNotAvailable(ShimError):
    """The OCI runtime (runc, crun) is not installed or cannot run on this node."""
