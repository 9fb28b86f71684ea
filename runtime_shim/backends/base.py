"""The seam between a mounted sandbox and what runs in it: `SandboxBackend`, and a registry of
backends by name.

The shim composes a sandbox's root filesystem (an overlay of shared EROFS layer mounts over a
private upper) and hands it to a backend, which runs a workload on it: the container backend
(`container`: an OCI bundle run by runc or crun) today; microVM backends (per-layer read-only
drives and guest-side composition: Firecracker, Cloud Hypervisor, QEMU microvm) and full VM
backends (one flattened device) are to be siblings in this package, registered by name in
`runtime_shim.backends`.

A backend runs one workload per sandbox, identified by the sandbox id, in five steps:

    prepare  write what the backend needs to start (a bundle, a VM config), from the sandbox's
             root and runtime config; nothing runs yet
    start    start the workload, attached to the caller's stdio; returns an `Execution`
    wait     wait for it to end; its exit code (128+N when it died of signal N). Signals the
             caller receives meanwhile (SIGTERM, SIGINT, SIGHUP, SIGQUIT) are passed on to it
    stop     send a signal to a started workload
    delete   forget (killing it if it still runs) everything the backend keeps for the sandbox;
             idempotent: a sandbox it knows nothing of is a no-op

and, for clean-up by a teardown and by recovery, which need no `Execution` (the process that
started the workload may be dead): `has` (O(1): does the backend keep state for this sandbox?),
`leftovers` (the sandboxes it keeps state for on this node) and `status`. `check` says whether the
backend can run on this node at all (`RuntimeNotAvailable` if not); constructing a backend
touches nothing, so the shim holds one of each registered backend for clean-up on any node.

Each backend keeps its own state under NODE/<something of its own> (the container backend:
NODE/oci/<runtime>/ and NODE/sandboxes/<id>/bundle/) and never touches the shim's (the state
database, the sandbox's mounts, upper and record).
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, Protocol

from ..errors import RuntimeNotAvailable
from ..nodestate.paths import NodePaths
from ..nodestate.state import Sandbox

Stdio = IO[bytes] | int | None


@dataclass(frozen=True)
class Confinement:
    """What a sandbox's workload may do and use: least privilege, every measure on by default,
    each relaxed only by an explicit choice of the caller (`layerctl run` options). A backend
    applies every measure it knows of; limits set to None are not applied.

    seccomp          the default syscall profile (`backends.seccomp`); off = unconfined
    ptrace           allow ptrace and its relatives (debuggers, strace) through the profile
    new_privileges   allow gaining privileges at exec (setuid binaries, file capabilities):
                     no_new_privileges off (the shim also mounts the root without nosuid)
    system_paths     leave /proc and /sys paths unmasked and writable (runc's masked and
                     read-only lists)
    pids             at most this many tasks (a fork bomb stays inside)
    memory           bytes of memory (the page cache and tmpfs pages it writes included)
    cpus             CPU time, in CPUs (1.5 = one and a half CPUs' worth per period)
    init             a container's PID 1 is a minimal init (`pid1`: tini), the workload its child;
                     off = the workload is PID 1 itself (an image with an init of its own:
                     systemd, s6, dumb-init). A VM's guest init always runs the workload as its
                     child: the VM backends refuse it off
    """

    seccomp: bool = True
    ptrace: bool = False
    new_privileges: bool = False
    system_paths: bool = False
    pids: int | None = None
    memory: int | None = None
    cpus: float | None = None
    init: bool = True


@dataclass
class Execution:
    """A started workload: the sandbox it runs in and the process the caller waits for (for the
    container backend the runtime's foreground process; for a VM backend, its monitor)."""

    sandbox: str
    process: subprocess.Popen[bytes]


class SandboxBackend(Protocol):
    name: str

    def check(self) -> None:
        """Raise `RuntimeNotAvailable` unless the backend can run on this node."""
        ...

    def prepare(self, sb: Sandbox, command: Sequence[str] | None, *, extra_env: Sequence[str] = (),
                confinement: Confinement | None = None) -> None:
        """Write what `start` needs to run `command` (else the environment's default) in the
        mounted sandbox `sb`, confined as `confinement` says (None: the defaults).
        `extra_env` may hold secrets: it never reaches a command line, a log or an error message."""
        ...

    def start(self, sandbox: str, *, stdin: Stdio = None, stdout: Stdio = None, stderr: Stdio = None) -> Execution:
        """Start the prepared workload with the given stdio."""
        ...

    def wait(self, execution: Execution) -> int:
        """Wait for the workload to end, passing on the caller's signals meanwhile; its exit code
        (128+N if it died of signal N)."""
        ...

    def stop(self, execution: Execution, signum: int = signal.SIGTERM) -> None:
        """Send `signum` to a started workload."""
        ...

    def delete(self, sandbox: str) -> None:
        """Forget the sandbox's workload, killing it if it runs (idempotent)."""
        ...

    def status(self, sandbox: str) -> str | None:
        """"created", "running", "paused", "stopped"; None if the backend does not know it."""
        ...

    def has(self, sandbox: str) -> bool:
        """Does the backend keep state for this sandbox on this node? O(1), no process run."""
        ...

    def leftovers(self) -> list[str]:
        """The sandboxes the backend keeps state for on this node (sorted)."""
        ...

    def pause(self, sandbox: str) -> bool:
        """Freeze the sandbox's workload (every process of it stopped where it is, e.g. by the
        cgroup freezer) so that nothing of it runs until `resume`: what a commit reading the
        sandbox's files needs. True if this call froze it (the caller then resumes it); False if
        nothing of it runs (none, stopped, or paused already: not this caller's to resume).
        `ShimError` if it runs and could not be frozen."""
        ...

    def resume(self, sandbox: str) -> None:
        """Thaw a workload `pause` froze."""
        ...


BackendFactory = Callable[[NodePaths], SandboxBackend]


class BackendRegistry:
    """Backends by name (the name `layerctl run --runtime` takes), in registration order."""

    def __init__(self) -> None:
        self.factories: dict[str, BackendFactory] = {}

    def register(self, name: str, factory: BackendFactory) -> None:
        if name in self.factories:
            raise ValueError(f"sandbox backend {name!r} is registered already")
        self.factories[name] = factory

    def names(self) -> list[str]:
        return list(self.factories)

    def create(self, name: str, paths: NodePaths) -> SandboxBackend:
        """The named backend for this node, unchecked (construction touches nothing)."""
        try:
            factory = self.factories[name]
        except KeyError:
            raise RuntimeNotAvailable(f"unknown sandbox backend {name!r} (have: {', '.join(self.factories)})") from None
        return factory(paths)

    def open(self, name: str, paths: NodePaths) -> SandboxBackend:
        """The named backend for this node, checked to be runnable here."""
        backend = self.create(name, paths)
        backend.check()
        return backend

    def every(self, paths: NodePaths) -> dict[str, SandboxBackend]:
        """One of each backend for this node, unchecked: what clean-up looks through."""
        return {name: factory(paths) for name, factory in self.factories.items()}
