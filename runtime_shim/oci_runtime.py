"""OCI runtime drivers: run a bundle in the foreground, streaming the container's stdio, and
delete what the runtime keeps about it. runc and crun behind one interface.

crun 1.8.1 refuses this machine's hybrid cgroup layout unless it runs in a private mount
namespace where /sys/fs/cgroup/unified is unmounted; the driver wraps it accordingly with
unshare(1). The sandbox's root is mounted before the wrap, so the private namespace sees it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
from pathlib import Path
from types import FrameType
from typing import IO, Protocol

from .errors import RuntimeNotAvailable

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


class OciRuntime(Protocol):
    name: str

    def run(self, bundle: Path, container_id: str, *, stdin: IO[bytes] | int | None = None,
            stdout: IO[bytes] | int | None = None, stderr: IO[bytes] | int | None = None) -> int:
        """Run to completion; the container's exit code (128+N if killed by signal N)."""
        ...

    def delete(self, container_id: str) -> None:
        ...

    def status(self, container_id: str) -> str | None:
        """"created", "running", "paused", "stopped"; None if the runtime does not know it."""
        ...


class _CliRuntime:
    name = "runc"
    binary = "runc"

    def __init__(self, state_root: Path) -> None:
        self.state_root = state_root
        found = shutil.which(self.binary)
        if found is None:
            raise RuntimeNotAvailable(f"{self.binary} is not installed")
        self.path = found

    def wrap(self, argv: list[str]) -> list[str]:
        return argv

    def base(self) -> list[str]:
        return [self.path, "--root", str(self.state_root)]

    def run(self, bundle: Path, container_id: str, *, stdin: IO[bytes] | int | None = None,
            stdout: IO[bytes] | int | None = None, stderr: IO[bytes] | int | None = None) -> int:
        self.state_root.mkdir(mode=0o700, parents=True, exist_ok=True)
        argv = self.wrap([*self.base(), "run", "--bundle", str(bundle), container_id])
        proc = subprocess.Popen(argv, stdin=stdin, stdout=stdout, stderr=stderr)
        # The runtime forwards signals to the container's init; pass ours on to it.
        old = {}

        def forward(signum: int, _frame: FrameType | None) -> None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signum)

        for s in FORWARDED:
            with contextlib.suppress(ValueError):  # not the main thread: no forwarding
                old[s] = signal.signal(s, forward)
        try:
            rc = proc.wait()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
        return 128 - rc if rc < 0 else rc

    def delete(self, container_id: str) -> None:
        argv = self.wrap([*self.base(), "delete", "--force", container_id])
        subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def status(self, container_id: str) -> str | None:
        argv = self.wrap([*self.base(), "state", container_id])
        p = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True)
        if p.returncode != 0:
            return None
        try:
            return str(json.loads(p.stdout)["status"])
        except (ValueError, KeyError, TypeError):
            return None


class Runc(_CliRuntime):
    name = "runc"
    binary = "runc"


class Crun(_CliRuntime):
    name = "crun"
    binary = "crun"

    def wrap(self, argv: list[str]) -> list[str]:
        unshare = shutil.which("unshare")
        if unshare is None:
            raise RuntimeNotAvailable("crun needs unshare(1) (util-linux) on this node")
        if not os.path.ismount("/sys/fs/cgroup/unified"):
            return argv
        script = 'umount -l /sys/fs/cgroup/unified 2>/dev/null; exec "$@"'
        return [unshare, "--mount", "--propagation", "private", "--", "/bin/sh", "-c", script, "crun-wrap", *argv]


RUNTIMES = {"runc": Runc, "crun": Crun}


def open_runtime(name: str, state_root: Path) -> OciRuntime:
    try:
        cls = RUNTIMES[name]
    except KeyError:
        raise RuntimeNotAvailable(f"unknown OCI runtime {name!r} (have: {', '.join(RUNTIMES)})") from None
    return cls(state_root / name)

