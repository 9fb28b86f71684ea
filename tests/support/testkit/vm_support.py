"""What the VM tests share (microVM and full VM backends):

- `needs_vm`: the `vm` mark (tests/conftest.py skips it unless `vm_unavailable()` is "": qemu-system-x86
  and the guest kit for the current sources are there);
- `tcg`: a fixture body that selects TCG unless LAYERSTORE_VM_ACCEL says otherwise (this node
  kind's /dev/kvm boots no guest);
- `kill9_daemon(shim)`: kill -9 the node daemon a shim uses and reap it; returns its record.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
from typing import Any

import pytest

from runtime_shim.errors import RuntimeNotAvailable
from runtime_shim.nodestate.state import NodeState
from runtime_shim.vm.kit import find_kit


def vm_unavailable() -> str:
    """Why VMs cannot boot here ("" if they can)."""
    try:
        find_kit()
    except RuntimeNotAvailable as e:
        return str(e)
    return "" if shutil.which("qemu-system-x86_64") else "needs qemu-system-x86"


needs_vm = pytest.mark.vm  # skipped by tests/conftest.py where vm_unavailable() says why


def tcg(monkeypatch: pytest.MonkeyPatch) -> None:
    if not os.environ.get("LAYERSTORE_VM_ACCEL"):
        monkeypatch.setenv("LAYERSTORE_VM_ACCEL", "tcg")


def kill9_daemon(shim: Any) -> Any:
    with NodeState(shim.paths.state) as state, state.read() as t:
        rec = t.daemon()
    assert rec is not None, "no node daemon recorded"
    os.kill(rec.pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(rec.pid, 0)
    return rec
