"""Sandbox execution: the runner of `layerctl run` (mount, then a backend's prepare / start / wait /
delete, then teardown), commit, signal forwarding and cgroup helpers. The backends themselves
live in `runtime_shim.backends` (the `SandboxBackend` seam) and `runtime_shim.vm`."""
