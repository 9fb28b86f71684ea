"""pytest fixtures for the real single-node Ceph (filled by the Ceph harness work)."""
