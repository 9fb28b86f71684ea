"""What the shim needs of an environment: its manifest digest, its layers bottom first, and its
runtime config. Reading manifests is the `manifest` package's job; this module only adapts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from layerstore import digest as digestmod
from layerstore.errors import BadInput, LayerstoreError
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
    """NAME:TAG or a manifest digest to an EnvSpec, through the manifest package (which also
    applies the trust policy, before anything is mounted)."""
    try:
        from manifest import resolve_environment  # type: ignore[attr-defined]
    except ImportError:
        return _resolve_minimal(store, ref)
    env = resolve_environment(store, ref, policy=policy)
    return from_manifest(env.manifest if hasattr(env, "manifest") else env, ref)


def from_manifest(m: Any, ref: str, digest: str | None = None) -> EnvSpec:
    """An EnvSpec from a `manifest.Manifest` (or an object with the same fields)."""
    layers = tuple(LayerSpec(layer.blob, layer.size, layer.role) for layer in m.layers)
    config = m.config.to_json() if hasattr(m.config, "to_json") else dict(m.config)
    return EnvSpec(digest or (m.digest() if hasattr(m, "digest") else ""), layers, config, ref)


def _resolve_minimal(store: Store, ref: str) -> EnvSpec:
    try:
        digest = digestmod.parse(ref)
    except LayerstoreError:
        digest = store.get_tag(ref)
    try:
        obj = json.loads(store.get_manifest(digest))
        layers = tuple(LayerSpec(digestmod.parse(x["blob"]), int(x["size"]), str(x["role"])) for x in obj["layers"])
        config = {**DEFAULT_CONFIG, **obj.get("config", {})}
    except (ValueError, KeyError, TypeError) as e:
        raise BadInput(f"manifest {digest}: not an environment manifest ({e})") from None
    if not layers:
        raise BadInput(f"manifest {digest}: no layers")
    return EnvSpec(digest, layers, config, ref)
