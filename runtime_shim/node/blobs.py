"""Where a layer's EROFS image file comes from: the seam between the shim and the node daemon.

In production every blob is the read-only file NODE/fuse/blobs/<digest> served lazily by the
node daemon (`DaemonBlobs`); tests and tools can serve a directory of image files (`DirBlobs`).
`generation` names the thing that serves the files: EROFS mounts made from one generation's files
must be remounted when it changes (a restarted daemon is a new FUSE mount). On the fanotify data
path (docs/fanotify.md) a layer is mounted directly on the node cache's file (`attach`) and the
generation is the fanotify group's (`fanotify:<id>`), which outlives daemon restarts: only a new
group (every holder of the old one died) makes those mounts stale.
"""

from __future__ import annotations

import os
import select
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Protocol

from layerstore import digest as digestmod
from layerstore import linux
from layerstore.errors import LayerstoreError

from ..errors import DaemonError
from ..nodestate.lock import BlobLock
from ..nodestate.paths import NodePaths
from ..nodestate.state import NodeState, group_generation
from ..supervise.daemon import DaemonCommand, DaemonSupervisor, default_command, is_alive, proc_start_time


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

    def prefetch(self, blob: str, chunks: list[int]) -> None:
        """Ask for these chunks in the background (prefetch hints); returns once they are queued."""
        ...

    def pin(self, blob: str, holder: str) -> Path | None:
        """If the blob is complete on the node: pin it for `holder` and return a local image file
        that stays unmodified until `unpin` (a direct mount reads it). None: not complete (or the
        source has no such files)."""
        ...

    def unpin(self, blob: str, holder: str) -> None:
        ...

    def pins(self, prefix: str) -> list[tuple[str, str]]:
        """(blob, holder) of the pins whose holder starts with `prefix` ([] if unknown)."""
        ...

    def clear_dead(self) -> list[str]:
        """Caller holds the node lock. Detach the source's mount if whatever served it died (a
        dead FUSE mount: ENOTCONN), without starting anything; returns the mountpoints cleared."""
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

    def prefetch(self, blob: str, chunks: list[int]) -> None:
        pass

    def pin(self, blob: str, holder: str) -> Path | None:
        return None  # the files are local already

    def unpin(self, blob: str, holder: str) -> None:
        pass

    def pins(self, prefix: str) -> list[tuple[str, str]]:
        return []

    def clear_dead(self) -> list[str]:
        return []  # (local files)

    def attach(self, blob: str, holder: str) -> tuple[Path, str] | None:
        return None  # (local files already)

    def detach(self, blob: str, holder: str) -> None:
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
        self._mu = threading.Lock()
        self._fetching: dict[str, Future[None]] = {}
        self._seen: _SeenDaemon | None = None  # the daemon last found healthy (see `ensure`)

    def ensure(self) -> str:
        """Caller holds the node lock. Every mount calls it: once the daemon was found healthy,
        later calls only ask whether that very process still runs (a pidfd, no pid reuse), its
        FUSE mount is still the one seen then (the mountpoint's device) and the fanotify holder's
        identity file is still absent (the FUSE data path): about 10 us instead of ~90 (reading
        its record, /proc, two lstats and a stat, the identity file). With a holder's identity
        file (the fanotify data path) the generation is also read again (whether that holder
        still runs is part of it). Only the process that stops a daemon records
        another one, and it stops the old one first: a live verified daemon is still the recorded
        one. Anything else (it died, its mount went, the holder changed) takes the full check."""
        seen = self._seen
        if seen is not None:
            if seen.still_healthy():
                if seen.ident is None:  # (FUSE: no fanotify holder)
                    return seen.generation
                # a holder's identity: whether that holder still runs is its generation's to say
                if self._gen(seen.pid, seen.start_time) == seen.generation:
                    return seen.generation
            self._forget_seen()
        with self.state.read() as t:
            rec = t.daemon()
        if rec is not None and rec.store != self.store and is_alive(rec):
            raise DaemonError(f"the node daemon serves store {rec.store}, not {self.store} "
                              f"(one store per node; stop it or use another --node-dir)")
        if rec is None or not self.supervisor.health(rec).healthy:
            self.supervisor.stop(rec)  # a live process whose mount died is of no use
            rec = self.supervisor.start(self.store)
            with self.state.write() as t:
                t.put_daemon(rec)
        ident = _identity(_identity_file(self.paths))  # (before the generation: a change in between is seen next time)
        gen = self._gen(rec.pid, rec.start_time)
        self._seen = _SeenDaemon.take(rec.pid, rec.start_time, gen, self.paths, ident)
        return gen

    def _forget_seen(self) -> None:
        seen, self._seen = self._seen, None
        if seen is not None:
            seen.close()

    def generation(self) -> str | None:
        with self.state.read() as t:
            rec = t.daemon()
        if rec is None or not self.supervisor.health(rec).healthy:
            return None
        return self._gen(rec.pid, rec.start_time)

    def _gen(self, pid: int, start_time: int) -> str:
        """The daemon's generation, with the fanotify group's before it while a holder keeps one
        (`state.group_generation`: attached layers follow the group, FUSE-mounted ones the daemon)."""
        from fuse_client.fanotify.handover import holder_generation

        group = holder_generation(self.paths.cache)
        return group_generation(group, _gen(pid, start_time)) if group else _gen(pid, start_time)

    def attach(self, blob: str, holder: str) -> tuple[Path, str] | None:
        """(the blob's cache file, the group's generation) once the daemon marked it and filled
        its metadata, for a direct EROFS mount on the fanotify data path; None when the daemon
        serves FUSE only."""
        from fuse_client import control

        got = control.attach(self.paths.cache, blob, holder, timeout=None)
        if got is None:
            return None
        return Path(got["path"]), str(got["generation"])

    def detach(self, blob: str, holder: str) -> None:
        from fuse_client import control

        control.detach(self.paths.cache, blob, holder)

    def path(self, blob: str) -> Path:
        return self.paths.fuse / "blobs" / digestmod.parse(blob)

    def fetch_all(self, blob: str) -> None:
        """Every chunk of the blob into the node cache, through the daemon's control socket,
        waited for. One fetch per blob at a time in this process (concurrent callers wait for it
        and share its outcome). Nothing is remembered after it: the daemon may evict chunks of a
        blob that was complete, and a complete blob costs one request that fetches nothing.
        Across processes the daemon shares the fetches of chunks already in flight."""
        with self._mu:
            flight = self._fetching.get(blob)
            mine = flight is None
            if mine:
                flight = self._fetching[blob] = Future()
        assert flight is not None
        if not mine:
            error = flight.exception()
            if error is not None:
                raise DaemonError(str(error))
            return
        lock = BlobLock(self.paths.fetch_lock(blob))
        try:
            from fuse_client.control import request_json

            lock.hold()  # one eager fetch of a blob at a time on the node, across processes too
            try:
                res = request_json(self.paths.cache, "POST", "/prefetch", {"blob": blob, "all": True, "wait": True},
                                   timeout=None)
            except LayerstoreError as e:
                raise DaemonError(f"eager fetch of {blob} failed: {e}") from None
            if res.get("failed"):
                raise DaemonError(f"eager fetch of {blob} failed: {res['failed']} chunk(s) could not be fetched "
                                  f"(see {self.paths.daemon_log})")
            flight.set_result(None)
        except BaseException as e:
            flight.set_exception(e)
            raise
        finally:
            lock.release()
            with self._mu:
                self._fetching.pop(blob, None)

    def prefetch(self, blob: str, chunks: list[int]) -> None:
        from fuse_client.control import request_json

        request_json(self.paths.cache, "POST", "/prefetch", {"blob": blob, "chunks": chunks, "wait": False})

    def pin(self, blob: str, holder: str) -> Path | None:
        from fuse_client import control

        return control.pin(self.paths.cache, blob, holder)

    def unpin(self, blob: str, holder: str) -> None:
        from fuse_client import control

        control.unpin(self.paths.cache, blob, holder)

    def pins(self, prefix: str) -> list[tuple[str, str]]:
        if self.generation() is None:
            return []  # (no daemon: the next recovery with one reconciles)
        from fuse_client.control import request_json

        try:
            pins = request_json(self.paths.cache, "GET", "/cache").get("pins", [])
        except (LayerstoreError, OSError):
            return []
        return [(p["blob"], p["holder"]) for p in pins if str(p.get("holder", "")).startswith(prefix)]

    def clear_dead(self) -> list[str]:
        """The FUSE mount of a daemon that died answers ENOTCONN: detach it (a recorded process
        that still runs without its mount is stopped: it can serve nothing). The daemon record
        stays: the watch, if one runs, starts the next daemon; else the next `ensure` does."""
        fuse = self.paths.fuse
        if not linux.is_mount(fuse):
            return []
        try:  # (statfs reaches the daemon: a stat of the mountpoint may be answered from cached attributes)
            if not linux.clear_dead_fuse(fuse):
                return []
        except linux.MountError:
            return []  # a live mount
        self._forget_seen()
        with self.state.read() as t:
            rec = t.daemon()
        self.supervisor.stop(rec, watch=False)
        return [str(fuse)]

    def stop(self) -> None:
        self._forget_seen()
        with self.state.read() as t:
            rec = t.daemon()
        self.supervisor.stop(rec)
        with self.state.write() as t:
            t.put_daemon(None)


def _gen(pid: int, start_time: int) -> str:
    return f"daemon:{pid}:{start_time}"


def _identity_file(paths: NodePaths) -> str:
    from fuse_client.fanotify.handover import identity_path

    return str(identity_path(paths.cache))


def _identity(path: str) -> tuple[int, int, int] | None:
    """(inode, size, mtime) of the fanotify holder's identity file (`_identity_file`), None if absent."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


class _SeenDaemon:
    """A daemon found healthy: its process (a pidfd: readable once it exits), its FUSE mount (the
    mountpoint's device then), the holder identity file then, and the generation they gave."""

    def __init__(self, pid: int, start_time: int, pidfd: int, fuse_dev: int, ident: tuple[int, int, int] | None,
                 generation: str, paths: NodePaths) -> None:
        self.pid, self.start_time = pid, start_time
        self.pidfd, self.fuse_dev, self.ident, self.generation = pidfd, fuse_dev, ident, generation
        self.fuse, self.identity = str(paths.fuse), _identity_file(paths)  # (strings: checked at every mount)
        self.poll = select.poll()
        self.poll.register(pidfd, select.POLLIN)

    @classmethod
    def take(cls, pid: int, start_time: int, generation: str, paths: NodePaths,
             ident: tuple[int, int, int] | None) -> _SeenDaemon | None:
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            return None
        try:
            # the pid could have been reused between the health check and pidfd_open
            if proc_start_time(pid) != start_time:
                os.close(pidfd)
                return None
            dev = os.lstat(paths.fuse).st_dev
        except OSError:
            os.close(pidfd)
            return None
        return cls(pid, start_time, pidfd, dev, ident, generation, paths)

    def still_healthy(self) -> bool:
        if self.pidfd < 0 or self.poll.poll(0):  # readable: the process exited
            return False
        try:
            if os.lstat(self.fuse).st_dev != self.fuse_dev:  # another mount there, or none
                return False
        except OSError:  # ENOTCONN: a dead FUSE mount
            return False
        return _identity(self.identity) == self.ident

    def close(self) -> None:
        fd, self.pidfd = self.pidfd, -1
        if fd >= 0:
            os.close(fd)

    def __del__(self) -> None:
        self.close()
