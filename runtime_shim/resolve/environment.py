"""What the shim needs of an environment: its manifest digest, its layers bottom first, and its
runtime config. Reading manifests is the `manifest` package's job; this module only adapts.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from layerstore.errors import LayerstoreError
from layerstore.store import Store

NODE_POLICY = "policy.json"  # NODE/policy.json: the node's trust policy, the floor for every caller
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
    # the manifest's prefetch hints: layer blob -> chunk indexes in first-access order
    prefetch: dict[str, tuple[int, ...]] = field(default_factory=dict)

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
    return EnvSpec(env.digest, layers, env.config.to_json(), ref, {b: tuple(i) for b, i in env.prefetch.items()})


class CachingResolver:
    """Resolution for a long-lived shim: one store client, and environments cached by manifest
    digest. A manifest is immutable (its digest is its content), so once parsed and accepted by
    the trust policy it need not be read again; a tag can move, so a tag costs one small read of
    the tag every time (a digest reference costs nothing). Refusals are not cached: a signature
    may be added later. Thread-safe."""

    def __init__(self, store: Store, policy: Any = None, *, capacity: int = 256) -> None:
        self.store = store
        self.policy = policy
        self.capacity = capacity
        self._cache: OrderedDict[str, EnvSpec] = OrderedDict()
        self._lock = threading.Lock()
        self._check_lock = threading.Lock()
        self._checked = False
        self.hits = self.misses = 0
        self._tags = TagVersions(store)

    def __call__(self, ref: str) -> EnvSpec:
        self.check()
        digest = self._tags.get(ref)
        if digest is None:
            from manifest.environment import resolve_ref

            digest = resolve_ref(self.store, ref)
        with self._lock:
            hit = self._cache.get(digest)
            if hit is not None:
                self._cache.move_to_end(digest)
                self.hits += 1
        if hit is not None:
            return hit if hit.ref == ref else replace(hit, ref=ref)
        spec = resolve(self.store, ref, self.policy)  # the tag is read again: it names what was resolved
        with self._lock:
            self.misses += 1
            self._cache[spec.manifest] = spec
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
        return spec

    def check(self) -> None:
        """Check the store once (and build its client): a node agent calls it before a burst;
        otherwise the first resolution does, once however many threads resolve at that moment."""
        if self._checked:
            return
        with self._check_lock:
            if not self._checked:
                self.store.check()
                self._checked = True

    def close(self) -> None:
        self.store.close()


class TagVersions:
    """Tags read once and then checked by their object's version (`Backend.version`: one stat(2)
    on a local or distributed POSIX store): a tag moved by any process on any host sharing the
    store is seen by the next resolution after the move. A backend without versions answers None
    and the caller reads the tag. Thread-safe (one dict operation per call)."""

    def __init__(self, store: Store, capacity: int = 1024) -> None:
        self.store = store
        self.capacity = capacity
        self._seen: dict[str, tuple[str, Hashable, str]] = {}  # ref -> (its key, version, digest)

    def get(self, ref: str) -> str | None:
        """The manifest digest `ref` (NAME:TAG) names now, None for a digest reference, an
        unreadable tag or a backend without versions (the caller reads it then, and gets the
        store's error)."""
        seen = self._seen.get(ref)
        key = seen[0] if seen is not None else _tag_key(ref)
        if key is None:
            return None
        backend = self.store.backend
        sig = backend.version(key)
        if sig is None:
            return None
        if seen is not None and seen[1] == sig:
            return seen[2]
        try:
            digest = self.store.get_tag(ref)
        except LayerstoreError:
            return None
        if backend.version(key) != sig:
            return digest  # moved while it was read: this answer is not remembered
        if len(self._seen) >= self.capacity:
            self._seen.clear()
        self._seen[ref] = (key, sig, digest)
        return digest


def _tag_key(ref: str) -> str | None:
    """The store key of a NAME:TAG reference; None for a digest reference or a malformed one."""
    from layerstore import keys
    from manifest.environment import is_digest_ref

    if is_digest_ref(ref):
        return None
    try:
        return keys.tag_key(ref)
    except (ValueError, LayerstoreError):
        return None


def node_policy(node_root: str | os.PathLike[str], caller: str | os.PathLike[str] | None) -> Any:
    """The trust policy a shim on the node at `node_root` applies: NODE/policy.json when present,
    combined with the caller's (`caller`, else $LAYERSTORE_TRUST_POLICY) so that a caller can
    only tighten it (see manifest.files.node_policy); None when neither exists."""
    from manifest import files

    return files.node_policy(Path(node_root) / NODE_POLICY, caller)


def node_floor(node_root: str | os.PathLike[str]) -> Any:
    """The node's own trust policy (NODE/policy.json), None when it has none."""
    from manifest import files

    return files.node_policy(Path(node_root) / NODE_POLICY, None, caller_env=False)
