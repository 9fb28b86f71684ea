"""Every name the composition benchmark takes from the project's packages, in one place: when one of
them moves, this is the only module to change. Imported lazily, as the benchmark always did: a
plain-overlay client and the outer process never load the runtime shim."""

from __future__ import annotations

from types import ModuleType
from typing import Any


def linux() -> ModuleType:
    from layerstore import linux

    return linux


def shim_class() -> Any:
    from runtime_shim.node.shim import Shim

    return Shim


def mount_request_class() -> Any:
    from runtime_shim.node.request import MountRequest

    return MountRequest


def node_state_class() -> Any:
    from runtime_shim.nodestate.state import NodeState

    return NodeState


def record_of(sandbox_dir: Any) -> bytes | None:
    from runtime_shim.nodestate import records

    return records.load(sandbox_dir)
