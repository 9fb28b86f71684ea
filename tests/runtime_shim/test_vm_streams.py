"""`qemu.accept_streams` waits for the VMM's stream connections with poll: a shim living in a
process that holds descriptors numbered 1024 and up (the snapshotter, a service, a test run)
must still start VMs (select() refuses such numbers: every VM test failed that way once)."""

from __future__ import annotations

import os
import resource
import socket
import threading

import pytest

from runtime_shim.errors import ShimError
from runtime_shim.vm import qemu


class Running:
    returncode = None

    def poll(self) -> None:
        return None


class Exited:
    returncode = 1

    def poll(self) -> int:
        return 1


def _listener_at(path: str, number: int) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.listen(1)
    fd = os.dup2(s.fileno(), number)
    s.close()
    return socket.socket(fileno=fd)


def test_streams_are_accepted_on_descriptors_above_1024(tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 1200:
        pytest.skip("the descriptor limit is below 1200")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    try:
        paths = {name: str(tmp_path / f"{name}.sock") for name in ("stdout", "stderr")}
        listeners = {name: _listener_at(p, 1100 + i) for i, (name, p) in enumerate(paths.items())}
        clients = []

        def connect() -> None:
            for p in paths.values():
                c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                c.connect(p)
                clients.append(c)

        t = threading.Thread(target=connect)
        t.start()
        try:
            conns = qemu.accept_streams(listeners, Running())  # type: ignore[arg-type]
        finally:
            t.join()
        assert sorted(conns) == ["stderr", "stdout"]
        for c in [*conns.values(), *clients, *listeners.values()]:
            c.close()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_vmm_that_exits_first_is_an_error(tmp_path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(tmp_path / "x.sock"))
    s.listen(1)
    try:
        with pytest.raises(ShimError, match="exited with status 1"):
            qemu.accept_streams({"stdout": s}, Exited())  # type: ignore[arg-type]
    finally:
        s.close()
