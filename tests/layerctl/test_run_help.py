"""`layerctl run --help` says what `--backend vm` with `--layer-device pmem` does as the backends do
it (runtime_shim/backends/vm.py, microvm.py; docs/vm-memory.md): a virtio-pmem device per layer,
full VM only, each layer fetched whole before the boot; and a layer device without a VM backend
is refused before anything starts. `--no-init` (the workload as a container's PID 1) is described,
and refused for the VM backends before anything starts."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from click.testing import CliRunner

from layerctl import cmd_runtime
from layerctl.main import cli
from runtime_shim.backends.pid1 import INIT_ENV
from runtime_shim.errors import RuntimeNotAvailable
from runtime_shim.nodestate.paths import NodePaths
from runtime_shim.sandbox import runner


def _help() -> str:
    r = CliRunner().invoke(cli, ["run", "--help"], terminal_width=400)
    assert r.exit_code == 0, r.output
    return " ".join(r.output.split())


def test_backend_and_layer_device_are_described_as_the_backends_do_it() -> None:
    text = _help()
    assert "a full VM (q35) whose root is one flattened device over the layers, or with --layer-device pmem " \
           "a virtio-pmem device per layer" in text
    assert "one flattened multi-device EROFS root over a drive per layer blob (vm)" in text
    assert "pmem (vm only; microvm refuses it)" in text
    assert "each layer is fetched whole before the VM boots" in text


def test_a_layer_device_without_a_vm_backend_is_refused() -> None:
    r = CliRunner().invoke(cli, ["run", "--layer-device", "pmem", "x:1", "--", "true"])
    assert r.exit_code == 2
    assert "--layer-device is for the VM backends" in r.output


def test_no_init_is_described_and_refused_for_the_vm_backends() -> None:
    text = _help()
    assert "--no-init Run the workload as the container's PID 1" in text
    assert "Container backend only: a VM's guest init always runs the workload as its child." in text
    for backend in ("microvm", "vm"):
        r = CliRunner().invoke(cli, ["run", "--backend", backend, "--no-init", "x:1", "--", "true"])
        assert r.exit_code == 2, r.output
        assert f"--no-init is for the container backend: the {backend} guest's init always runs the workload " \
               f"as its child" in " ".join(r.output.split())


@pytest.mark.parametrize("flag,init", [([], True), (["--no-init"], False)])
def test_no_init_reaches_the_run_as_the_confinement(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     flag: list[str], init: bool) -> None:
    """The flag flows into the one value object `runner.run` hands to the backend (no node, no run)."""
    seen: dict[str, Any] = {}

    @contextlib.contextmanager
    def fake_shim(*_args: Any, **_kw: Any) -> Iterator[Any]:
        yield SimpleNamespace(paths=NodePaths(tmp_path / "node"))

    def fake_run(_shim: Any, _env: Any, command: Any, **kw: Any) -> runner.RunResult:
        seen.update(kw, command=command)
        return runner.RunResult("sb-1", 0, False)

    init_file = tmp_path / "tini-static"
    init_file.write_bytes(b"#!/bin/true\n")  # (an executable that names no ELF interpreter: found usable)
    init_file.chmod(0o755)
    monkeypatch.setenv(INIT_ENV, str(init_file))
    monkeypatch.setattr(cmd_runtime, "_shim", fake_shim)
    monkeypatch.setattr(runner, "run", fake_run)
    r = CliRunner().invoke(cli, ["run", *flag, "x:1", "--", "/sbin/my-init"])
    assert r.exit_code == 0, r.output
    assert seen["command"] == ["/sbin/my-init"] and seen["runtime"] == "runc"
    assert seen["confinement"].init is init and seen["confinement"].seccomp is True


def test_a_missing_init_is_said_before_a_node_is_opened(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No usable tini: the default run stops with what to do before it touches a node; --no-init,
    which needs none, goes on to the run."""
    opened: list[bool] = []

    @contextlib.contextmanager
    def fake_shim(*_args: Any, **_kw: Any) -> Iterator[Any]:
        opened.append(True)
        yield SimpleNamespace(paths=NodePaths(tmp_path / "node"))

    monkeypatch.setenv(INIT_ENV, str(tmp_path / "absent"))
    monkeypatch.setattr(cmd_runtime, "_shim", fake_shim)
    monkeypatch.setattr(runner, "run", lambda *_a, **_kw: runner.RunResult("sb-1", 0, False))
    r = CliRunner().invoke(cli, ["run", "x:1", "--", "true"])
    assert isinstance(r.exception, RuntimeNotAvailable) and not opened  # (layerctl's edge says it in one line)
    assert f"{INIT_ENV}={tmp_path / 'absent'}" in str(r.exception) and "install tini" in str(r.exception)
    r = CliRunner().invoke(cli, ["run", "--no-init", "x:1", "--", "true"])
    assert r.exit_code == 0, r.output
    assert opened == [True]
