"""Environment manifests: ordered layers (one base, toolkits, at most one workspace), runtime
config, prefetch hints and annotations, in canonical JSON addressed by blake3, named by tags,
optionally signed (ed25519) and checked against a trust policy. See docs/manifests.md.

Pure modules: `canonical`, `config`, `schema`, `trace`, `signing`, `refs` (for gc). I/O: `environment` (the
store), `files` (local files).
"""

from __future__ import annotations

from .config import RuntimeConfig
from .environment import Environment, resolve_environment
from .errors import InvalidManifest, UntrustedManifest
from .schema import SCHEMA_VERSION, Layer, Manifest
from .signing import PublicKey, TrustPolicy

__all__ = [
    "SCHEMA_VERSION", "Environment", "InvalidManifest", "Layer", "Manifest", "PublicKey", "RuntimeConfig",
    "TrustPolicy", "UntrustedManifest", "resolve_environment",
]
