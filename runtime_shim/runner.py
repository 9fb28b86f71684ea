"""`layerctl run`: create a sandbox, mount its root, run one command in it with a sandbox backend
(runc or crun today), stream its output, tear the sandbox down (unless kept) and hand back the
command's exit code. Any backend is driven the same way, through the `SandboxBackend` steps:
prepare, start, wait, and delete (always, also when the run failed)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

from .backends.base import Stdio
from .environment import EnvSpec
from .shim import Shim


@dataclass
class RunResult:
    sandbox: str
    exit_code: int
    kept: bool


def run(shim: Shim, env: str | EnvSpec, command: Sequence[str] | None, *, sandbox: str | None = None,
        eager: bool = False, keep: bool = False, runtime: str = "runc", extra_env: Sequence[str] = (),
        stdin: Stdio = None, stdout: Stdio = None, stderr: Stdio = None) -> RunResult:
    sb = shim.mount(env, sandbox=sandbox, eager=eager)
    try:
        backend = shim.backend(runtime)
        backend.prepare(sb, command, extra_env=extra_env)
        try:
            code = backend.wait(backend.start(sb.id, stdin=stdin, stdout=stdout, stderr=stderr))
        finally:
            backend.delete(sb.id)
    except BaseException:
        if not keep:
            with contextlib.suppress(Exception):
                shim.unmount(sb.id)
        raise
    if not keep:
        shim.unmount(sb.id)
    return RunResult(sb.id, code, keep)
