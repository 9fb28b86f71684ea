"""The manifest package's members of the project's exception family (layerstore.errors)."""

from __future__ import annotations

from layerstore.errors import BadInput, PermissionDenied


class InvalidManifest(BadInput):
    """A manifest, runtime config, prefetch trace, signature object or trust policy that breaks its schema."""


class UntrustedManifest(PermissionDenied):
    """A trust policy refuses the manifest: unsigned, or not signed by a trusted key."""
