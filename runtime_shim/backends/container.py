"""The container backend: an OCI bundle (`bundle`) run by runc or crun in the foreground,
streaming the container's stdio, and deleted afterwards. One `SandboxBackend` per OCI runtime,
registered as "runc" and "crun".

State: the bundle at NODE/sandboxes/<id>/bundle/config.json (written by `prepare`, deleted with the
sandbox's directory), and the runtime's own state under NODE/oci/<runtime>/<id> (`--root`),
which `delete` (`runtime delete --force`: also kills the container and removes its cgroup)
removes.

The container's PID 1 is a minimal init (`pid1`: tini, bound read-only at /dev/init) with the
workload as its child: signals reach the workload, its exit code (128+N for death by signal N) is
the container's, and orphans are reaped, as in the microVM and VM backends. Unless the caller
turns it off (`Confinement.init`, `layerctl run --no-init`: an image with an init of its own):
then the workload is PID 1 and no init is bound in. The init is looked up (`pid1.find_init`) by
`prepare`, when a sandbox needs it, not by `check`: a node that runs only such images needs no tini.

crun 1.8.1 refuses this machine's hybrid cgroup layout unless it runs in a private mount
namespace where /sys/fs/cgroup/unified is unmounted; the backend wraps it accordingly with
unshare(1). The sandbox's root is mounted before the wrap, so the private namespace sees it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from ..errors import RuntimeNotAvailable, ShimError
from ..nodestate.paths import NodePaths
from ..nodestate.state import Sandbox
from . import cgroups, signals
from .base import Confinement, Execution, Stdio
from .bundle import write_bundle
from .pid1 import find_init

PID_FILE = "pid"  # BUNDLE/pid: written by the runtime once the container has started
POLL = 0.05  # seconds between looks at a starting or stopping container
REAP_TIMEOUT = 10.0  # seconds for a killed runtime process to be reaped


def start_timeout() -> float:
    """Seconds the runtime has to create and start a container (LAYERSTORE_RUNTIME_START_TIMEOUT)."""
    return signals.env_seconds("LAYERSTORE_RUNTIME_START_TIMEOUT", 30.0)


# A sandbox with a user namespace: its root user (an unprivileged uid on the host) must be able to
# look up the root's path, and the node directory (and what holds it) is 0700. The runtime runs in
# a private mount namespace where the root is bound at this fixed, world-searchable, empty
# directory (each runtime in its own namespace: one path serves every sandbox).
USERNS_ROOTFS = Path("/run/layerstore/rootfs")
USERNS_SOURCE = "rootfs.source"  # BUNDLE/rootfs.source: the root's real path, for `start`


def userns_wrap(rootfs: str, argv: list[str]) -> list[str]:
    """argv run in a private mount namespace with `rootfs` bound at USERNS_ROOTFS."""
    unshare = shutil.which("unshare")
    if unshare is None:
        raise RuntimeNotAvailable("a sandbox with a user namespace needs unshare(1) (util-linux) on this node")
    for d in (USERNS_ROOTFS.parent, USERNS_ROOTFS):
        d.mkdir(mode=0o755, exist_ok=True)
        os.chmod(d, 0o755)
    script = 'mount --bind -- "$1" "$2" || exit 125; shift 2; exec "$@"'
    return [unshare, "--mount", "--propagation", "private", "--", "/bin/sh", "-c", script, "userns-wrap",
            rootfs, str(USERNS_ROOTFS), *argv]


class ContainerBackend:
    """An OCI runtime's command line (`binary --root NODE/oci/<name> ...`)."""

    name = "runc"
    binary = "runc"

    def __init__(self, paths: NodePaths) -> None:
        self.paths = paths
        self.state_root = paths.root / "oci" / self.name
        self.found: str | None = None

    @property
    def path(self) -> str:
        if self.found is None:
            found = shutil.which(self.binary)
            if found is None:
                raise RuntimeNotAvailable(f"{self.binary} is not installed")
            self.found = found
        return self.found

    def check(self) -> None:
        self.path  # noqa: B018 - resolving it is the check (the init: `prepare`, if the sandbox has one)

    def wrap(self, argv: list[str]) -> list[str]:
        return argv

    def base(self) -> list[str]:
        return [self.path, "--root", str(self.state_root)]

    def bundle(self, sandbox: str) -> Path:
        return self.paths.bundle(sandbox)

    # -- the steps -------------------------------------------------------------------------------
    def prepare(self, sb: Sandbox, command: Sequence[str] | None, *, extra_env: Sequence[str] = (),
                confinement: Confinement | None = None) -> None:
        # the environment reaches the runtime through config.json only (0600 in a 0700 bundle):
        # never its command line
        bundle = self.bundle(sb.id)
        init = find_init() if (confinement or Confinement()).init else None  # (None: the workload is PID 1)
        write_bundle(bundle, sb.target, sb.config, command, sandbox=sb.id, extra_env=extra_env,
                     cgroups_path=cgroups.sandbox_path(sb.id), confinement=confinement, userns=sb.userns,
                     root_path=str(USERNS_ROOTFS) if sb.userns is not None else None, init=init)
        source = bundle / USERNS_SOURCE
        if sb.userns is not None:
            source.write_text(sb.target)
        else:
            source.unlink(missing_ok=True)

    def start(self, sandbox: str, *, stdin: Stdio = None, stdout: Stdio = None, stderr: Stdio = None) -> Execution:
        """`runtime run` in the foreground: the container's stdio is the caller's. The runtime
        writes BUNDLE/pid once the container has started (`wait` gives it until a deadline)."""
        start_timeout(), signals.stop_grace()  # (a bad setting is refused before anything runs)
        self.state_root.mkdir(mode=0o700, parents=True, exist_ok=True)
        pid_file = self.bundle(sandbox) / PID_FILE
        pid_file.unlink(missing_ok=True)
        argv = [*self.base(), "run", "--pid-file", str(pid_file), "--bundle", str(self.bundle(sandbox)), sandbox]
        source = self.bundle(sandbox) / USERNS_SOURCE
        argv = self.wrap(userns_wrap(source.read_text(), argv) if source.exists() else argv)
        return Execution(sandbox, subprocess.Popen(argv, stdin=stdin, stdout=stdout, stderr=stderr))

    def wait(self, execution: Execution) -> int:
        """The container's exit code. The runtime has until `start_timeout()` to create and start
        it (a root that blocks the runtime, a runtime that hangs); a stop signal (`signals`) is
        passed on to the container, which has `stop_grace()` seconds to end (a second signal cuts
        that short); SIGQUIT is only passed on. On a deadline, a signal or any other failure the
        container's processes are killed (the runtime's own foreground process and everything in
        the sandbox's cgroup) before this raises; `delete` then removes the rest."""
        deadline = time.monotonic() + start_timeout()
        started = False

        def forward(signum: int, _frame: FrameType | None) -> None:
            self.stop(execution, signum)

        with contextlib.ExitStack() as stack:
            stack.enter_context(signals.stopping())
            with contextlib.suppress(ValueError):  # not the main thread: no forwarding
                old = signal.signal(signal.SIGQUIT, forward)
                stack.callback(signal.signal, signal.SIGQUIT, old)
            try:
                started = self._await_start(execution, deadline)
                rc = execution.process.wait()
            except BaseException as e:
                with signals.shielded():
                    self._end(execution, e if isinstance(e, signals.Stopped) else None, started)
                if isinstance(e, signals.Stopped):
                    raise signals.Stopped(e.signum, f"the workload of sandbox {execution.sandbox} was ended") from None
                raise
        return 128 - rc if rc < 0 else rc

    def _await_start(self, execution: Execution, deadline: float) -> bool:
        """Until the runtime has written the pid file (the container started: True) or has exited
        (it failed, or the container ran and ended already: False); `ShimError` at the deadline."""
        pid_file = self.bundle(execution.sandbox) / PID_FILE
        while True:
            if pid_file.exists():
                return True
            if execution.process.poll() is not None:
                return False
            if time.monotonic() >= deadline:
                raise ShimError(f"{self.name} did not start sandbox {execution.sandbox} within {start_timeout():g} s "
                                f"(LAYERSTORE_RUNTIME_START_TIMEOUT): its processes were killed")
            with contextlib.suppress(subprocess.TimeoutExpired):  # (returns as soon as the runtime exits)
                execution.process.wait(POLL)

    def _end(self, execution: Execution, stopped: signals.Stopped | None, started: bool) -> None:
        """Kill the container (after `stop_grace()` for a started one told to stop) and reap the
        runtime's foreground process."""
        proc = execution.process
        started = started or (self.bundle(execution.sandbox) / PID_FILE).exists()  # (a signal mid-look)
        if stopped is not None and started:
            self.stop(execution, stopped.signum)
            signals.await_end(lambda: proc.poll() is not None, signals.stop_grace())
        self.kill(execution)

    def kill(self, execution: Execution) -> None:
        """SIGKILL the runtime's foreground process (first: it starts nothing more), then every
        process in the sandbox's cgroup (the container's init, pid 1 of its namespace, and all
        its descendants: none can leave the cgroup); reap the runtime's process."""
        with contextlib.suppress(ProcessLookupError):
            execution.process.kill()
        cgroups.kill(execution.sandbox)
        with contextlib.suppress(subprocess.TimeoutExpired):
            execution.process.wait(REAP_TIMEOUT)

    def stop(self, execution: Execution, signum: int = signal.SIGTERM) -> None:
        """To the foreground runtime process, which passes it on to the container's init."""
        with contextlib.suppress(ProcessLookupError):
            execution.process.send_signal(signum)

    def delete(self, sandbox: str) -> None:
        """`runtime delete --force` (kills the container, removes its state and cgroup), then
        whatever a runtime that died or was killed mid-way left: its state directory (no
        state.json yet: the runtime does not see it) and the sandbox's cgroup with the processes
        still in it."""
        argv = self.wrap([*self.base(), "delete", "--force", sandbox])
        try:
            subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except subprocess.SubprocessError as e:
            raise ShimError(f"{self.name} delete {sandbox}: {e}") from None
        left = cgroups.remove(sandbox)
        shutil.rmtree(self.state_root / sandbox, ignore_errors=True)
        if left:
            raise ShimError(f"{self.name} delete {sandbox}: its cgroup could not be removed "
                            f"({', '.join(map(str, left))}: processes in it did not end)")

    # -- freezing (commit) ------------------------------------------------------------------------
    def pause(self, sandbox: str) -> bool:
        """`runtime pause` (the cgroup freezer) if the container is created or running; checked
        to have taken (status "paused") before it returns True."""
        if self.status(sandbox) not in ("created", "running"):
            return False
        argv = self.wrap([*self.base(), "pause", sandbox])
        p = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True)
        now = self.status(sandbox)
        if p.returncode == 0 and now == "paused":
            return True
        if now in (None, "stopped"):
            return False  # it ended meanwhile: nothing runs
        if p.returncode == 0:  # frozen by the call but not seen so: do not leave it half done
            self.resume(sandbox)
        why = p.stderr.strip().splitlines()[-1:] or [f"status {now}"]
        raise ShimError(f"{self.name} pause {sandbox}: the container could not be frozen ({why[0]})")

    def resume(self, sandbox: str) -> None:
        argv = self.wrap([*self.base(), "resume", sandbox])
        p = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True)
        if p.returncode != 0 and self.status(sandbox) == "paused":
            raise ShimError(f"{self.name} resume {sandbox}: {p.stderr.strip() or 'failed'}")

    # -- clean-up ----------------------------------------------------------------------------------
    def status(self, sandbox: str) -> str | None:
        argv = self.wrap([*self.base(), "state", sandbox])
        p = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True)
        if p.returncode != 0:
            return None
        try:
            return str(json.loads(p.stdout)["status"])
        except (ValueError, KeyError, TypeError):
            return None

    def has(self, sandbox: str) -> bool:
        return (self.state_root / sandbox).exists()

    def leftovers(self) -> list[str]:
        try:
            return sorted(os.listdir(self.state_root))
        except FileNotFoundError:
            return []


class RuncBackend(ContainerBackend):
    name = "runc"
    binary = "runc"


class CrunBackend(ContainerBackend):
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
