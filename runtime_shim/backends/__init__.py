"""Sandbox backends: what runs a workload on a mounted sandbox root (see `base`).

`REGISTRY` maps names to backends: "runc" and "crun" (the container backend, `container`; what
`layerctl run --runtime` picks), "microvm" (`microvm`: a QEMU microvm whose guest composes the root
from a drive per layer) and "vm" (`vm`: a full q35 VM on one flattened root device), which
`layerctl run --backend` picks.
"""

from __future__ import annotations

from ..nodestate.paths import NodePaths
from .base import BackendRegistry, Execution, SandboxBackend
from .container import CrunBackend, RuncBackend
from .microvm import MicrovmBackend
from .vm import VmBackend

REGISTRY = BackendRegistry()
REGISTRY.register("runc", RuncBackend)
REGISTRY.register("crun", CrunBackend)
REGISTRY.register("microvm", MicrovmBackend)
REGISTRY.register("vm", VmBackend)


def open_backend(name: str, paths: NodePaths) -> SandboxBackend:
    """The named backend for this node, checked to be runnable here (`RuntimeNotAvailable`)."""
    return REGISTRY.open(name, paths)


def node_backends(paths: NodePaths) -> dict[str, SandboxBackend]:
    """One of every registered backend for this node, unchecked: for clean-up."""
    return REGISTRY.every(paths)


__all__ = ["REGISTRY", "BackendRegistry", "Execution", "SandboxBackend", "node_backends", "open_backend"]
