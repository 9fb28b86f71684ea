"""`layerctl run`: create a sandbox, mount its root, run one command in it with an OCI runtime,
stream its output, tear the sandbox down (unless kept) and hand back the command's exit code."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO

from .bundle import write_bundle
from .environment import EnvSpec
from .oci_runtime import open_runtime
from .shim import Shim


@dataclass
class RunResult:
    sandbox: str
    exit_code: int
    kept: bool


def run(shim: Shim, env: str | EnvSpec, command: Sequence[str] | None, *, sandbox: str | None = None,
        eager: bool = False, keep: bool = False, runtime: str = "runc", extra_env: Sequence[str] = (),
        stdin: IO[bytes] | int | None = None, stdout: IO[bytes] | int | None = None,
        stderr: IO[bytes] | int | None = None) -> RunResult:
    sb = shim.mount(env, sandbox=sandbox, eager=eager)
    try:
        rt = open_runtime(runtime, shim.paths.root / "oci")
        bundle = shim.paths.bundle(sb.id)
        write_bundle(bundle, sb.target, sb.config, command, sandbox=sb.id, extra_env=extra_env,
                     cgroups_path=f"/layerstore/{sb.id}")
        try:
            code = rt.run(bundle, sb.id, stdin=stdin, stdout=stdout, stderr=stderr)
        finally:
            rt.delete(sb.id)
    except BaseException:
        if not keep:
            with contextlib.suppress(Exception):
                shim.unmount(sb.id)
        raise
    if not keep:
        shim.unmount(sb.id)
    return RunResult(sb.id, code, keep)
