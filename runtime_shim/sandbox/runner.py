"""`layerctl run`: create a sandbox, mount its root, run one command in it with a sandbox backend
(runc or crun today), stream its output, tear the sandbox down (unless kept) and hand back the
command's exit code. Any backend is driven the same way, through the `SandboxBackend` steps:
prepare, start, wait, and delete (always, also when the run failed).

Least privilege by default: the workload is confined as `Confinement` says (seccomp, masked
paths, no new privileges, limits), it runs in a user namespace with an id range of its own where
the node supports it (`idmap`), its root is mounted nosuid and nodev, and the upper of a
sandbox that is not kept lives on a size-limited tmpfs of its own (a kept one's on a size-limited
sparse image on the node disk, which survives a reboot). Limits come from the caller,
else from the node's defaults (`NodeDefaults`: NODE/limits.json, else built in).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from layerstore.errors import ConfigError

from ..backends import signals
from ..backends.base import Confinement, Stdio
from ..errors import ShimError
from ..node.request import MountRequest
from ..node.shim import Shim
from ..nodestate import idmap
from ..nodestate.paths import NodePaths
from ..nodestate.state import Sandbox
from ..resolve.environment import EnvSpec

LIMITS_FILE = "limits.json"


@dataclass(frozen=True)
class NodeDefaults:
    """The limits a sandbox gets when its caller names none. NODE/limits.json may override each
    (a JSON object with these keys; null = no limit)."""

    pids: int | None = 1024
    memory: int | None = 4 << 30
    cpus: float | None = 2.0
    upper_size: int | None = 1 << 30  # (a tmpfs: memory, charged to the sandbox's memory limit)
    kept_upper_size: int | None = 10 << 30  # a kept (or `layerctl mount`ed) sandbox's: a sparse image on disk

    @classmethod
    def load(cls, paths: NodePaths) -> NodeDefaults:
        path = paths.root / LIMITS_FILE
        try:
            raw: Any = json.loads(path.read_text())
        except FileNotFoundError:
            return cls()
        except (OSError, ValueError) as e:
            raise ConfigError(f"{path}: {e}") from None
        known = {f.name for f in fields(cls)}
        if not isinstance(raw, dict) or set(raw) - known:
            raise ConfigError(f"{path}: want an object with keys among {', '.join(sorted(known))}")
        for key, value in raw.items():
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or value <= 0):
                raise ConfigError(f"{path}: {key}: want a positive number or null")
        return replace(cls(), **raw)

    def confinement(self) -> Confinement:
        """Every measure on, with these limits."""
        return Confinement(pids=self.pids, memory=self.memory, cpus=self.cpus)


def kept_upper_image(paths: NodePaths, given: int | None = None) -> int | None:
    """The size of a kept sandbox's upper image: `given` (0: none, unlimited on the node disk),
    else the node's default (`NodeDefaults.kept_upper_size`; null: none)."""
    size = NodeDefaults.load(paths).kept_upper_size if given is None else given
    return int(size) if size else None


@dataclass
class RunResult:
    sandbox: str
    exit_code: int
    kept: bool
    lost: str = ""  # why the sandbox's data path died under a workload that failed ("" if it did not)


def run(shim: Shim, env: str | EnvSpec, command: Sequence[str] | None, *, sandbox: str | None = None,
        eager: bool = False, keep: bool = False, runtime: str = "runc", extra_env: Sequence[str] = (),
        confinement: Confinement | None = None, upper_size: int | None = None, nodev: bool = True,
        userns: bool | None = None, stdin: Stdio = None, stdout: Stdio = None,
        stderr: Stdio = None) -> RunResult:
    """`confinement`: None = the node's defaults. `upper_size`: bytes of the upper's quota
    (None: the node's default; 0: no quota, on the node disk): a tmpfs, or for a kept sandbox
    (whose upper is for commit, and survives a reboot) a sparse ext4 image on the node disk
    (`kept_upper_image`; default `NodeDefaults.kept_upper_size`). `userns`: a user namespace with an
    id range of the sandbox's own (`idmap`); None = where this node supports it (else without, with
    a warning logged), True = required (`ShimError` if unsupported), False = none. `extra_env` may
    hold secrets: they go to the backend's prepare and nowhere else."""
    with signals.stopping():
        defaults = NodeDefaults.load(shim.paths)
        confinement = confinement or defaults.confinement()
        size = defaults.upper_size if upper_size is None else upper_size
        image = kept_upper_image(shim.paths, upper_size) if keep else None
        backend = shim.backend(runtime)
        if getattr(backend, "guest_root", False):
            # A VM backend whose guest composes the root: the layers are mounted on the node (their
            # files are its drives), the upper is an image drive when kept, else the guest's memory.
            sb = shim.mount(MountRequest(env, sandbox=sandbox, eager=eager, upper_image=image, guest=backend.name))
        else:
            sb = _mount_on_host(shim, env, sandbox=sandbox, eager=eager, keep=keep, size=size, image=image,
                                confinement=confinement, nodev=nodev, userns=userns)
        try:
            backend.prepare(sb, command, extra_env=extra_env, confinement=confinement)
            try:
                code = backend.wait(backend.start(sb.id, stdin=stdin, stdout=stdout, stderr=stderr))
            finally:
                with signals.shielded():  # (a signal now must not cut the clean-up short)
                    backend.delete(sb.id)
            lost = shim.lost_reason(sb.id) if code else ""  # (before the teardown forgets it)
        except BaseException as e:
            if not keep:
                with signals.shielded(), contextlib.suppress(Exception):
                    shim.unmount(sb.id)
            if isinstance(e, signals.Stopped):
                fate = "kept" if keep else "stopped and removed"
                raise signals.Stopped(e.signum, f"sandbox {sb.id} {fate}") from None
            raise
        if not keep:
            shim.unmount(sb.id)
    return RunResult(sb.id, code, keep, lost)


def _mount_on_host(shim: Shim, env: str | EnvSpec, *, sandbox: str | None, eager: bool, keep: bool, size: int | None,
                   image: int | None, confinement: Confinement, nodev: bool, userns: bool | None) -> Sandbox:
    """The root composed on the node for a container runtime: an overlay with its upper's quota,
    in a user namespace of its own where the node supports one (unless `userns` says otherwise)."""
    if userns is not False:
        ok = idmap.supported(shim.paths.root, shim.paths.layers)
        if userns and not ok:
            raise ShimError("this node cannot give sandboxes a user namespace with idmapped layers "
                            "(kernel 5.12+ with idmapped EROFS and overlayfs lowers); run with --userns off")
        userns = ok
    return shim.mount(MountRequest(env, sandbox=sandbox, eager=eager, upper_size=None if keep or not size else size,
                      upper_image=image, nosuid=not confinement.new_privileges, nodev=nodev, userns=userns))

