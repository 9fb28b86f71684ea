"""The containerd proxy snapshotter (see docs/snapshotter.md)."""
