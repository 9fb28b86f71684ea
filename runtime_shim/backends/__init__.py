"""Sandbox backends: what runs a workload on a mounted sandbox root (see `base`).

`REGISTRY` maps the names `layerctl run --runtime` takes to backends: "runc" and "crun" (the
container backend, `container`). MicroVM and VM backends are registered here too when they come,
as modules beside `container`.
"""

from __future__ import annotations

from ..paths import NodePaths
from .base import BackendRegistry, Execution, SandboxBackend
from .container import CrunBackend, RuncBackend

REGISTRY = BackendRegistry()
REGISTRY.register("runc", RuncBackend)
REGISTRY.register("crun", CrunBackend)


def open_backend(name: str, paths: NodePaths) -> SandboxBackend:
    """The named backend for this node, checked to be runnable here (`RuntimeNotAvailable`)."""
    return REGISTRY.open(name, paths)


def node_backends(paths: NodePaths) -> dict[str, SandboxBackend]:
    """One of every registered backend for this node, unchecked: for clean-up."""
    return REGISTRY.every(paths)


__all__ = ["REGISTRY", "BackendRegistry", "Execution", "SandboxBackend", "node_backends", "open_backend"]
