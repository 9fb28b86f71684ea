"""Manifest resolution and trust: an environment reference to its verified layers, under the node's
trust policy (used by the shim and by the snapshotter)."""
