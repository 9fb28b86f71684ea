"""layerstore: the content-addressed store of chunks, chunk maps, manifests and tags."""

from __future__ import annotations

__version__ = "0.1.0"
