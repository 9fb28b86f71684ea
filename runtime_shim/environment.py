"""What the shim needs of an environment: its manifest digest, its layers bottom first, and its
runtime config. Reading manifests is the `manifest` package's job; this module only adapts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from layerstore.store import Store

DEFAULT_CONFIG: dict[str, Any] = {"entrypoint": [], "cmd": ["/bin/sh"], "env": [], "workdir": "/", "user": ""}


@dataclass(frozen=True)
class LayerSpec:
    blob: str
    size: int
    role: str


@dataclass(frozen=True)
class EnvSpec:
    manifest: str  # "" for an environment that was never stored (tests, tools)
    layers: tuple[LayerSpec, ...]  # bottom first: base, toolkits, workspace
    config: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_CONFIG))
    ref: str = ""

    @property
    def blobs(self) -> list[str]:
        return [layer.blob for layer in self.layers]

    @property
    def size(self) -> int:
        return sum(layer.size for layer in self.layers)


def resolve(store: Store, ref: str, policy: Any = None) -> EnvSpec:
    """NAME:TAG or a manifest digest to an EnvSpec, through the manifest package, which also
    applies the trust policy (refusing an unsigned or untrusted manifest before anything is mounted)."""
    from manifest import resolve_environment

    env = resolve_environment(store, ref, policy)
    layers = tuple(LayerSpec(layer.blob, layer.size, layer.role) for layer in env.layers)
    return EnvSpec(env.digest, layers, env.config.to_json(), ref)


def read_policy(path: str | os.PathLike[str]) -> Any:
    from manifest import files

    return files.read_policy(Path(path))


def load_policy(path: str | os.PathLike[str] | None) -> Any:
    """`path`, else $LAYERSTORE_TRUST_POLICY, else None."""
    from manifest import files

    return files.load_policy(path)
