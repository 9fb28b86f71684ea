"""What a stored manifest-kind object refers to, for garbage collection (pure).

The store's `manifests/` namespace holds two kinds of object: environment manifests, which keep
their layer blobs alive, and detached signatures, which name the environment manifest they sign
(a signature is worth keeping only while that manifest is). Objects of a kind or version this
code does not know are reported as such, so a collector can keep them rather than guess.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from . import canonical
from .errors import InvalidManifest
from .schema import KIND as ENVIRONMENT
from .schema import Manifest
from .signing import SIG_KIND as SIGNATURE
from .signing import Signature

UNKNOWN = "unknown"


@dataclass(frozen=True)
class References:
    kind: str  # "environment", "signature" or "unknown"
    blobs: frozenset[str] = frozenset()
    manifests: frozenset[str] = frozenset()


def references(data: bytes) -> References:
    """Blobs and manifests that the stored (already verified) object `data` refers to."""
    try:
        obj = canonical.loads(data, "object")
    except InvalidManifest:
        return References(UNKNOWN)
    kind = obj.get("kind") if isinstance(obj, Mapping) else None
    try:
        if kind == ENVIRONMENT:
            return References(ENVIRONMENT, blobs=frozenset(Manifest.from_bytes(data).blobs))
        if kind == SIGNATURE:
            return References(SIGNATURE, manifests=frozenset({Signature.from_bytes(data).manifest}))
    except InvalidManifest:
        pass
    return References(UNKNOWN)
