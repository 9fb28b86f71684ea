"""The project's one binding to Linux (libc through ctypes, raw system calls, /proc and /sys).

The bottom of the import graph with the rest of `layerstore`: every package that needs a Linux
call (the node daemon, the shim, the service, the snapshotter, the builder) imports it from here.
"""

from .mounts import *  # noqa: F403
