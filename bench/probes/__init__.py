"""Feasibility probes: small scripts that answer one question about the kernel or the machine
(not product code, not a benchmark of the project). Each module says what it asks and how to run it.

- fuse_passthrough.py: does FUSE passthrough (Linux 6.9+) carry our stack (file-backed EROFS on
  the FUSE file, overlayfs on EROFS), and what does it buy? Serves with rawfuse.py, a minimal
  FUSE server on /dev/fuse written for the probe.
"""
