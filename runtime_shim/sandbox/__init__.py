"""Sandbox execution: the runner of `layerctl run` (mount, then a backend's prepare / start / wait /
delete, then teardown) and commit. The backends themselves, with the signal-forwarding and cgroup
helpers they use, live in `runtime_shim.backends` (the `SandboxBackend` seam) and `runtime_shim.vm`."""
