"""Node composition: the node directory, its persisted state and locks, layer and overlay mounts,
idmapped lowers, records, recovery, and the `Shim` that composes them (mount / check / unmount /
recover). Its seam to the rest of the project is `shim.Shim`."""
