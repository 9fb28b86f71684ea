"""Where a layer's EROFS image file comes from: the seam between the shim and the node daemon.

In production every blob is the read-only file NODE/fuse/blobs/<digest> served lazily by the
node daemon (`DaemonBlobs`); tests and tools can serve a directory of image files (`DirBlobs`).
`generation` names the thing that serves the files: EROFS mounts made from one generation's files
must be remounted when it changes (a restarted daemon is a new FUSE mount).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Protocol

from layerstore import digest as digestmod

from .daemon import DaemonCommand, DaemonSupervisor, default_command, is_alive, layerctl_argv
from .errors import DaemonError
from .paths import NodePaths
from .state import NodeState


class BlobSource(Protocol):
    # Mount options for EROFS images from this source.
    erofs_options: str

    def ensure(self) -> str:
        """Make blob files readable (start the daemon if needed); return the current generation."""
        ...

    def generation(self) -> str | None:
        """The current generation if the source is healthy, else None. Never starts anything."""
        ...

    def path(self, blob: str) -> Path:
        ...

    def fetch_all(self, blob: str) -> None:
        """Bring every chunk of the blob to the node (eager mode)."""
        ...


class DirBlobs:
    """Blob image files in a directory, named by digest."""

    # Local files: buffered reads keep the image file's readahead (directio measured 0.4-0.6x).
    erofs_options = ""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)

    def ensure(self) -> str:
        return "dir"

    def generation(self) -> str | None:
        return "dir"

    def path(self, blob: str) -> Path:
        return self.directory / digestmod.parse(blob)

    def fetch_all(self, blob: str) -> None:
        pass


class DaemonBlobs:
    """Blob files served by the node daemon, which is started on first use and reused after."""

    # EROFS reads the FUSE file with direct I/O: no second copy of every layer byte in the FUSE
    # file's page cache, and sequential reads measured as fast or faster (docs/benchmarks-read.md).
    erofs_options = "directio"

    def __init__(self, paths: NodePaths, state: NodeState, store: str,
                 command: DaemonCommand = default_command) -> None:
        self.paths = paths
        self.state = state
        self.store = store
        self.supervisor = DaemonSupervisor(paths, command)

    def ensure(self) -> str:
        """Caller holds the node lock."""
        with self.state.read() as t:
            rec = t.daemon()
        if rec is not None and rec.store != self.store and is_alive(rec):
            raise DaemonError(f"the node daemon serves store {rec.store}, not {self.store} "
                              f"(one store per node; stop it or use another --node-dir)")
        if rec is not None and self.supervisor.health(rec).healthy:
            return _gen(rec.pid, rec.start_time)
        self.supervisor.stop(rec)  # a live process whose mount died is of no use
        rec = self.supervisor.start(self.store)
        with self.state.write() as t:
            t.put_daemon(rec)
        return _gen(rec.pid, rec.start_time)

    def generation(self) -> str | None:
        with self.state.read() as t:
            rec = t.daemon()
        if rec is None or not self.supervisor.health(rec).healthy:
            return None
        return _gen(rec.pid, rec.start_time)

    def path(self, blob: str) -> Path:
        return self.paths.fuse / "blobs" / digestmod.parse(blob)

    def fetch_all(self, blob: str) -> None:
        argv = [*layerctl_argv(), "prefetch", "--cache", str(self.paths.cache), blob, "--all", "--wait", "--json"]
        p = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True)
        if p.returncode != 0:
            msg = (p.stderr.strip().splitlines() or ["no message"])[-1]
            raise DaemonError(f"eager fetch of {blob} failed: {msg}")

    def stop(self) -> None:
        with self.state.read() as t:
            rec = t.daemon()
        self.supervisor.stop(rec)
        with self.state.write() as t:
            t.put_daemon(None)


def _gen(pid: int, start_time: int) -> str:
    return f"daemon:{pid}:{start_time}"
