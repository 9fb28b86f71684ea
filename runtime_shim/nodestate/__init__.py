"""The node's on-disk state: its directory layout (`paths`), lock, state records, id-map slots and utab.
Below `supervise`, `backends` and `node`, which all read it; imports nothing of the shim but `errors`."""
