"""The SandboxBackend seam without a kernel or an OCI runtime: the registry by name, the container
backend's steps against a stand-in runtime binary (argv, exit codes, signal forwarding, state
listing), `runner.run` driving any backend, and the shim's and recovery's clean-up going through
the seam."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import struct
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from layerstore.errors import ConfigError
from runtime_shim.backends import REGISTRY, BackendRegistry, Execution, node_backends, open_backend, pid1, signals
from runtime_shim.backends.base import Confinement
from runtime_shim.backends.container import ContainerBackend, CrunBackend, RuncBackend
from runtime_shim.backends.vm import VmBackend
from runtime_shim.errors import RuntimeNotAvailable, ShimError
from runtime_shim.node.blobs import DirBlobs
from runtime_shim.node.request import MountRequest
from runtime_shim.node.shim import Shim
from runtime_shim.nodestate import idmap
from runtime_shim.nodestate.paths import NodePaths
from runtime_shim.nodestate.state import MOUNTED, Sandbox
from runtime_shim.sandbox import runner
from runtime_shim.vm.qemu import QemuVm


class FakeBackend:
    """Records every step; `fail` names a step that raises; `kept` the sandboxes it has state for."""

    def __init__(self, paths: NodePaths | None = None, *, name: str = "fake", fail: str = "",
                 kept: Sequence[str] = (), statuses: dict[str, str] | None = None, runnable: bool = True) -> None:
        self.name = name
        self.paths = paths
        self.fail = fail
        self.kept = list(kept)
        self.statuses = statuses or {}
        self.runnable = runnable
        self.calls: list[tuple[str, Any]] = []

    def step(self, name: str, arg: Any) -> None:
        self.calls.append((name, arg))
        if self.fail == name:
            raise OSError(f"{name} failed")

    def check(self) -> None:
        self.step("check", None)
        if not self.runnable:
            raise RuntimeNotAvailable(f"{self.name} cannot run here")

    def prepare(self, sb: Sandbox, command: Sequence[str] | None, *, extra_env: Sequence[str] = (),
                confinement: Confinement | None = None) -> None:
        self.confinement = confinement
        self.step("prepare", (sb.id, list(command or []), list(extra_env)))

    def start(self, sandbox: str, *, stdin: Any = None, stdout: Any = None, stderr: Any = None) -> Execution:
        self.step("start", sandbox)
        return Execution(sandbox, None)  # type: ignore[arg-type]

    def wait(self, execution: Execution) -> int:
        self.step("wait", execution.sandbox)
        return 3

    def stop(self, execution: Execution, signum: int = signal.SIGTERM) -> None:
        self.step("stop", (execution.sandbox, signum))

    def delete(self, sandbox: str) -> None:
        self.step("delete", sandbox)
        if sandbox in self.kept:
            self.kept.remove(sandbox)

    def status(self, sandbox: str) -> str | None:
        self.step("status", sandbox)
        return self.statuses.get(sandbox)

    def has(self, sandbox: str) -> bool:
        return sandbox in self.kept

    def leftovers(self) -> list[str]:
        return sorted(self.kept)


def sandbox(paths: NodePaths, sid: str = "sb-1", config: dict[str, Any] | None = None) -> Sandbox:
    return Sandbox(id=sid, env="e:1", manifest="m", layers=[], config=config or {"cmd": ["/bin/sh"]},
                   target=str(paths.rootfs(sid)), upper=str(paths.sandbox_dir(sid) / "upper"),
                   work=str(paths.sandbox_dir(sid) / "work"), owned=True, status=MOUNTED)


# -- the registry ----------------------------------------------------------------------------------
def test_the_default_registry_has_the_container_and_vm_backends(tmp_path: Path) -> None:
    from runtime_shim.backends.microvm import MicrovmBackend
    from runtime_shim.backends.vm import VmBackend

    paths = NodePaths(tmp_path / "node")
    assert REGISTRY.names() == ["runc", "crun", "microvm", "vm"]
    every = node_backends(paths)
    assert list(every) == ["runc", "crun", "microvm", "vm"]
    assert isinstance(every["runc"], RuncBackend) and isinstance(every["crun"], CrunBackend)
    assert isinstance(every["microvm"], MicrovmBackend) and type(every["vm"]) is VmBackend
    assert every["microvm"].record("x") != every["vm"].record("x")  # type: ignore[attr-defined]
    assert every["runc"].state_root == paths.root / "oci" / "runc"  # type: ignore[attr-defined]
    assert not (tmp_path / "node").exists()  # constructing a backend touches nothing


def test_a_registry_by_name(tmp_path: Path) -> None:
    paths = NodePaths(tmp_path)
    reg = BackendRegistry()
    reg.register("fake", FakeBackend)
    reg.register("broken", lambda p: FakeBackend(p, name="broken", runnable=False))
    with pytest.raises(ValueError, match="registered already"):
        reg.register("fake", FakeBackend)
    assert reg.names() == ["fake", "broken"]
    fake = reg.open("fake", paths)
    assert isinstance(fake, FakeBackend) and fake.paths == paths and fake.calls == [("check", None)]
    assert reg.create("broken", paths).calls == []  # unchecked
    with pytest.raises(RuntimeNotAvailable, match="cannot run here"):
        reg.open("broken", paths)
    with pytest.raises(RuntimeNotAvailable, match=r"unknown sandbox backend 'qemu' \(have: fake, broken\)"):
        reg.open("qemu", paths)
    assert list(reg.every(paths)) == ["fake", "broken"]


def test_a_runtime_that_is_not_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    backend = RuncBackend(NodePaths(tmp_path))
    with pytest.raises(RuntimeNotAvailable, match="runc is not installed"):
        backend.check()
    with pytest.raises(RuntimeNotAvailable, match="crun is not installed"):
        open_backend("crun", NodePaths(tmp_path))
    with pytest.raises(RuntimeNotAvailable, match="unshare"):
        CrunBackend(NodePaths(tmp_path)).wrap(["crun", "state", "x"])


# -- the container backend against a stand-in runtime ------------------------------------------------
FAKE_RUNTIME = """#!/bin/sh
# argv: --root ROOT VERB ... ; logs its argv, then acts out the verb
echo "$*" >> "$FAKE_LOG"
root=$2
verb=$3
case "$verb" in
run) id=$8; mkdir -p "$root/$id"  # (--pid-file $5: written once started, unless FAKE_NO_PIDFILE)
    test -n "$FAKE_NO_PIDFILE" || { mkdir -p "${5%/*}"; echo $$ > "$5"; }
    exec /bin/sh -c "$FAKE_RUN" ;;
state) test -d "$root/$4" || exit 1; echo '{"status": "stopped", "id": "'"$4"'"}' ;;
delete) rm -rf "$root/$5" ;;
esac
"""


@pytest.fixture
def fake_runc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[RuncBackend, Path]]:
    binary = tmp_path / "bin" / "runc"
    binary.parent.mkdir()
    binary.write_text(FAKE_RUNTIME)
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    init = binary.parent / "tini-static"  # (what `pid1.find_init` looks for on PATH)
    init.write_text("#!/bin/sh\n")
    init.chmod(0o755)
    log = tmp_path / "runtime.log"
    monkeypatch.setenv("PATH", f"{binary.parent}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_LOG", str(log))
    yield RuncBackend(NodePaths(tmp_path / "node")), log


def run_fake(backend: ContainerBackend, script: str, monkeypatch: pytest.MonkeyPatch, sid: str = "sb-1") -> int:
    monkeypatch.setenv("FAKE_RUN", script)
    return backend.wait(backend.start(sid, stdin=subprocess.DEVNULL))


def test_container_steps(fake_runc: tuple[RuncBackend, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    backend, log = fake_runc
    paths = backend.paths
    sb = sandbox(paths, config={"cmd": ["/bin/sh"], "env": ["A=1"], "workdir": "/w"})
    Path(sb.target).mkdir(parents=True)
    backend.check()
    backend.prepare(sb, ["echo", "hi"], extra_env=["B=2"])
    cfg = json.loads((paths.bundle(sb.id) / "config.json").read_text())
    assert cfg["root"] == {"path": sb.target, "readonly": False}
    # the workload runs as the child of the init, bound read-only into the container's own /dev
    assert cfg["process"]["args"] == ["/dev/init", "--", "echo", "hi"] and cfg["process"]["env"][-2:] == ["A=1", "B=2"]
    init = os.path.realpath(paths.root.parent / "bin" / "tini-static")
    assert [m for m in cfg["mounts"] if m["type"] == "bind"] == [
        {"destination": "/dev/init", "type": "bind", "source": init, "options": ["bind", "ro", "nosuid", "nodev"]}]
    dests = [m["destination"] for m in cfg["mounts"]]
    assert dests.index("/dev") < dests.index("/dev/init")  # (made inside the runtime's /dev tmpfs)
    assert cfg["process"]["cwd"] == "/w" and cfg["linux"]["cgroupsPath"] == f"/layerstore/{sb.id}"
    assert cfg["hostname"] == sb.id

    assert not backend.has(sb.id) and backend.leftovers() == []
    assert run_fake(backend, "exit 7", monkeypatch, sb.id) == 7
    assert backend.has(sb.id) and backend.leftovers() == [sb.id]
    assert backend.status(sb.id) == "stopped" and backend.status("other") is None
    backend.delete(sb.id)
    backend.delete(sb.id)  # idempotent
    assert not backend.has(sb.id) and backend.leftovers() == []
    root = str(paths.root / "oci" / "runc")
    assert log.read_text().splitlines() == [
        f"--root {root} run --pid-file {paths.bundle(sb.id)}/pid --bundle {paths.bundle(sb.id)} {sb.id}",
        f"--root {root} state {sb.id}",
        f"--root {root} state other",
        f"--root {root} delete --force {sb.id}",
        f"--root {root} delete --force {sb.id}",
    ]


def test_exit_codes(fake_runc: tuple[RuncBackend, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    backend, _ = fake_runc
    assert run_fake(backend, "exit 0", monkeypatch) == 0
    assert run_fake(backend, "exit 255", monkeypatch) == 255
    assert run_fake(backend, "kill -9 $$", monkeypatch) == 137  # died of signal N: 128+N
    assert run_fake(backend, "kill -15 $$", monkeypatch) == 143


def test_a_stop_signal_is_passed_on_then_the_run_stops(fake_runc: tuple[RuncBackend, Path],
                                                       monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """SIGTERM while waiting: passed on to the runtime (the workload's trap sees it), then `wait`
    raises `Stopped` (exit 130 at the CLI) whatever the workload did; our handlers are restored."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are installed from the main thread only")
    backend, _ = fake_runc
    ready, got = tmp_path / "ready", tmp_path / "got-term"
    before = {s: signal.getsignal(s) for s in (*signals.STOP_SIGNALS, signal.SIGQUIT)}

    def send_when_waiting() -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if signal.getsignal(signal.SIGTERM) is signals._handler and ready.exists():
                os.kill(os.getpid(), signal.SIGTERM)  # to us: wait() passes it on to the runtime
                return
            time.sleep(0.01)

    th = threading.Thread(target=send_when_waiting)
    th.start()
    try:
        with pytest.raises(signals.Stopped, match="stopped by SIGTERM: the workload of sandbox sb-1 was ended") as e:
            run_fake(backend, f"trap 'touch {got}; exit 42' TERM; touch {ready}; while :; do sleep 0.05; done",
                     monkeypatch)
    finally:
        th.join()
    assert e.value.signum == signal.SIGTERM and got.exists()
    assert {s: signal.getsignal(s) for s in before} == before  # our handlers are restored


def test_a_runtime_that_does_not_start_in_time_is_killed(fake_runc: tuple[RuncBackend, Path],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    backend, _ = fake_runc
    monkeypatch.setenv("LAYERSTORE_RUNTIME_START_TIMEOUT", "0.5")
    monkeypatch.setenv("FAKE_NO_PIDFILE", "1")  # the container never reports started
    monkeypatch.setenv("FAKE_RUN", "sleep 30")
    ex = backend.start("sb-1", stdin=subprocess.DEVNULL)
    with pytest.raises(ShimError, match=r"runc did not start sandbox sb-1 within 0.5 s"):
        backend.wait(ex)
    assert ex.process.returncode == -signal.SIGKILL  # killed and reaped before wait() returned
    monkeypatch.setenv("LAYERSTORE_RUNTIME_START_TIMEOUT", "soon")
    with pytest.raises(ConfigError, match="LAYERSTORE_RUNTIME_START_TIMEOUT"):
        backend.start("sb-2", stdin=subprocess.DEVNULL)  # refused before anything runs


def test_stop_signals_a_started_workload(fake_runc: tuple[RuncBackend, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    backend, _ = fake_runc
    monkeypatch.setenv("FAKE_RUN", "sleep 30")
    ex = backend.start("sb-1", stdin=subprocess.DEVNULL)
    backend.stop(ex, signal.SIGKILL)
    assert backend.wait(ex) == 128 + signal.SIGKILL
    backend.stop(ex)  # a workload that is gone: nothing to do


# -- the container's init (pid1) -----------------------------------------------------------------------
def test_the_init_is_found_on_path_or_named_and_refused_when_unusable(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(pid1.INIT_ENV, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(RuntimeNotAvailable, match=r"tini-static is not on PATH: install tini .* LAYERSTORE_CONTAINER"):
        pid1.find_init()
    static = tmp_path / "init"
    static.write_bytes(b"\x7fELF" + bytes(60))  # an ELF with no program header: no interpreter
    static.chmod(0o755)
    monkeypatch.setenv(pid1.INIT_ENV, str(static))
    assert pid1.find_init() == os.path.realpath(static)
    static.chmod(0o644)
    with pytest.raises(RuntimeNotAvailable, match="not an executable file"):
        pid1.find_init()
    monkeypatch.setenv(pid1.INIT_ENV, "tini")
    with pytest.raises(RuntimeNotAvailable, match="want an absolute path"):
        pid1.find_init()
    monkeypatch.setenv(pid1.INIT_ENV, str(tmp_path / "missing"))
    with pytest.raises(RuntimeNotAvailable, match="No such file"):
        pid1.find_init()
    dynamic = os.path.realpath("/bin/true")  # (Debian's coreutils: dynamically linked)
    if pid1.needs_interpreter(Path(dynamic).read_bytes()[:4096]):
        monkeypatch.setenv(pid1.INIT_ENV, dynamic)
        with pytest.raises(RuntimeNotAvailable, match="dynamically linked"):
            pid1.find_init()
    tini = shutil.which("tini-static")
    if tini is not None:  # the real one (.ci/install-deps.sh installs it)
        assert not pid1.needs_interpreter(Path(tini).read_bytes()[:4096])


def test_the_init_is_needed_by_a_sandbox_that_has_one_and_no_init_binds_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No tini on the node: the backend is runnable (`check`), a sandbox with the default init is
    refused at `prepare` ("install tini"), one without (`--no-init`) gets a bundle whose args are
    the workload's own (PID 1) and which binds nothing of the node in."""
    monkeypatch.delenv(pid1.INIT_ENV, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    paths = NodePaths(tmp_path / "node")
    runc = RuncBackend(paths)
    runc.found = "/usr/sbin/runc"  # (as if found)
    runc.check()  # (the init is not the check's: a node that runs only images with their own needs none)
    sb = sandbox(paths, config={"entrypoint": ["/sbin/my-init"], "cmd": ["--serve"]})
    Path(sb.target).mkdir(parents=True)
    with pytest.raises(RuntimeNotAvailable, match="tini-static is not on PATH: install tini"):
        runc.prepare(sb, None)
    runc.prepare(sb, None, confinement=Confinement(init=False))
    cfg = json.loads((paths.bundle(sb.id) / "config.json").read_text())
    assert cfg["process"]["args"] == ["/sbin/my-init", "--serve"]
    assert pid1.IN_CONTAINER not in [m["destination"] for m in cfg["mounts"]]
    assert all(m["type"] != "bind" for m in cfg["mounts"])


def test_the_vm_backends_refuse_no_init_before_anything(tmp_path: Path) -> None:
    """A VM's guest init always runs the workload as its child: `init` off is refused in one
    line, before a root image or a config drive is made (no VM boot, no QEMU needed)."""
    from dataclasses import replace

    from runtime_shim.backends.microvm import MicrovmBackend

    paths = NodePaths(tmp_path / "node")
    for backend in (VmBackend(paths), MicrovmBackend(paths)):
        sb = replace(sandbox(paths), backend=backend.name)
        with pytest.raises(ConfigError, match=f"^--no-init is for containers: the {backend.name} guest's init "
                                              f"always runs the workload as its child$"):
            backend.prepare(sb, ["true"], confinement=Confinement(init=False))
        assert not backend.workdir(sb.id).exists() and not backend.base.exists()


def test_an_elf_interpreter_is_read_from_the_program_headers() -> None:
    def elf(*types: int) -> bytes:
        head = bytearray(64)
        head[:6] = b"\x7fELF\x02\x01"
        struct.pack_into("<Q", head, 32, 64)  # e_phoff
        struct.pack_into("<HH", head, 54, 56, len(types))  # e_phentsize, e_phnum
        for t in types:
            head += struct.pack("<I", t) + bytes(52)
        return bytes(head)

    assert pid1.needs_interpreter(elf(6, 3, 1)) and not pid1.needs_interpreter(elf(1, 1, 4))
    assert not pid1.needs_interpreter(b"#!/bin/sh\n") and not pid1.needs_interpreter(elf(3)[:66])
    assert pid1.init_args(["sh", "-c", "x"]) == ["/dev/init", "--", "sh", "-c", "x"]


# -- the VM backends' signals, without a boot ------------------------------------------------------------
@pytest.fixture
def vm_stand_in(tmp_path: Path) -> Iterator[tuple[VmBackend, Execution, socket.socket]]:
    """A VM backend whose "running VM" is a `sleep` (the VMM) with a socket pair as its signal
    stream; the test holds the guest's end."""
    backend = VmBackend(NodePaths(tmp_path / "node"))
    host, guest = socket.socketpair()
    host.setblocking(False)
    proc = subprocess.Popen(["sleep", "60"])
    vm = QemuVm(proc, control=host)
    backend.running["sb-1"] = vm
    try:
        yield backend, Execution("sb-1", proc), guest
    finally:
        proc.kill()
        proc.wait()
        host.close()
        guest.close()


def test_a_vm_passes_a_signal_on_to_its_guest_and_stops_the_vmm_for_sigkill(
        vm_stand_in: tuple[VmBackend, Execution, socket.socket]) -> None:
    backend, ex, guest = vm_stand_in
    backend.stop(ex, signal.SIGTERM)
    backend.stop(ex, signal.SIGINT)
    guest.settimeout(10)
    got = b""
    while len(got) < 5:
        got += guest.recv(64)
    assert got == b"15\n2\n" and ex.process.poll() is None  # the guest's init passes them on
    backend.running["sb-1"].control.close()  # type: ignore[union-attr]  # a stream that is gone: the VMM is stopped
    backend.stop(ex, signal.SIGHUP)
    assert ex.process.wait(10) == -signal.SIGKILL and backend.signalled["sb-1"] == signal.SIGHUP


@pytest.mark.parametrize("guest_ends_it", [True, False])
def test_a_stop_signal_to_a_vm_run_is_passed_on_then_the_run_stops(
        vm_stand_in: tuple[VmBackend, Execution, socket.socket], monkeypatch: pytest.MonkeyPatch,
        guest_ends_it: bool) -> None:
    """As the container backend: the signal goes to the workload (here: the guest's end of the
    stream; a guest that ends the VM on it, or one that ignores it and is killed after the grace),
    then `wait` raises `Stopped`; our handlers are restored."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are installed from the main thread only")
    backend, ex, guest = vm_stand_in
    monkeypatch.setenv("LAYERSTORE_STOP_GRACE", "600" if guest_ends_it else "0.2")
    before = {s: signal.getsignal(s) for s in (*signals.STOP_SIGNALS, signal.SIGQUIT)}
    got: list[bytes] = []

    def guest_side() -> None:
        deadline = time.monotonic() + 20
        while signal.getsignal(signal.SIGTERM) is not signals._handler and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)  # to us, in wait(): passed on to the guest
        guest.settimeout(20)
        got.append(guest.recv(64))
        if guest_ends_it:
            ex.process.terminate()  # the workload ended of it, and the VM powered off

    th = threading.Thread(target=guest_side)
    th.start()
    try:
        with pytest.raises(signals.Stopped, match="^stopped by SIGTERM: the workload of sandbox sb-1 was ended$"):
            backend.wait(ex)
    finally:
        th.join()
    assert got == [b"15\n"]
    assert ex.process.returncode == (-signal.SIGTERM if guest_ends_it else -signal.SIGKILL)
    assert {s: signal.getsignal(s) for s in before} == before


# -- runner.run drives any backend ------------------------------------------------------------------
class FakeShim:
    def __init__(self, paths: NodePaths, backend: FakeBackend, mount_fails: bool = False) -> None:
        self.paths = paths
        self.be = backend
        self.mount_fails = mount_fails
        self.unmounted: list[str] = []
        self.mount_options: dict[str, Any] = {}

    def mount(self, req: MountRequest) -> Sandbox:
        self.mount_options = {k: getattr(req, k) for k in ("upper_size", "upper_image", "nosuid", "nodev", "userns")}
        if self.mount_fails:
            raise OSError("mount failed")
        return sandbox_of(self.paths, req.sandbox or "sb-1")

    def backend(self, name: str) -> FakeBackend:
        self.be.check()
        return self.be

    def unmount(self, sid: str) -> None:
        self.unmounted.append(sid)

    def lost_reason(self, sid: str) -> str:
        return ""  # (its data path never dies)


def sandbox_of(paths: NodePaths, sid: str) -> Sandbox:
    return sandbox(paths, sid)


@pytest.mark.parametrize("keep", [False, True])
def test_runner_drives_the_steps_in_order(tmp_path: Path, keep: bool) -> None:
    be = FakeBackend()
    shim = FakeShim(NodePaths(tmp_path), be)
    res = runner.run(shim, "e:1", ["true"], sandbox="s", keep=keep, runtime="fake", extra_env=["X=1"])  # type: ignore[arg-type]
    assert (res.sandbox, res.exit_code, res.kept) == ("s", 3, keep)
    assert [c[0] for c in be.calls] == ["check", "prepare", "start", "wait", "delete"]
    assert be.calls[1] == ("prepare", ("s", ["true"], ["X=1"]))
    assert shim.unmounted == ([] if keep else ["s"])
    # least privilege by default: the node's limits, every measure on, the root nosuid and nodev,
    # the upper on a size-limited tmpfs unless the sandbox is kept
    assert be.confinement == Confinement(pids=1024, memory=4 << 30, cpus=2.0)
    # (a kept one's on a sparse image of the node's kept_upper_size, 10 GiB)
    assert shim.mount_options == {"upper_size": None if keep else 1 << 30, "upper_image": 10 << 30 if keep else None,
                                  "nosuid": True, "nodev": True,
                                  "userns": idmap.supported(tmp_path, tmp_path / "layers")}


def test_runner_takes_the_nodes_defaults_and_the_callers_relaxations(tmp_path: Path) -> None:
    (tmp_path / "limits.json").write_text('{"pids": 64, "memory": null, "upper_size": 1048576}')
    be = FakeBackend()
    shim = FakeShim(NodePaths(tmp_path), be)
    runner.run(shim, "e:1", None, sandbox="s", runtime="fake")  # type: ignore[arg-type]
    assert be.confinement == Confinement(pids=64, memory=None, cpus=2.0)
    assert shim.mount_options["upper_size"] == 1 << 20
    relaxed = Confinement(seccomp=False, new_privileges=True, pids=None)
    runner.run(shim, "e:1", None, sandbox="s", runtime="fake", confinement=relaxed, upper_size=0,  # type: ignore[arg-type]
               nodev=False, userns=False)
    assert be.confinement is relaxed
    assert shim.mount_options == {"upper_size": None, "upper_image": None, "nosuid": False, "nodev": False,
                                  "userns": False}
    runner.run(shim, "e:1", None, sandbox="s", runtime="fake", keep=True, upper_size=64 << 20)  # type: ignore[arg-type]
    assert (shim.mount_options["upper_size"], shim.mount_options["upper_image"]) == (None, 64 << 20)
    runner.run(shim, "e:1", None, sandbox="s", runtime="fake", keep=True, upper_size=0)  # type: ignore[arg-type]
    assert (shim.mount_options["upper_size"], shim.mount_options["upper_image"]) == (None, None)
    (tmp_path / "limits.json").write_text('{"kept_upper_size": null}')
    runner.run(shim, "e:1", None, sandbox="s", runtime="fake", keep=True)  # type: ignore[arg-type]
    assert shim.mount_options["upper_image"] is None
    (tmp_path / "limits.json").write_text('{"pids": -1}')
    with pytest.raises(ConfigError, match="pids"):
        runner.run(shim, "e:1", None, sandbox="s", runtime="fake")  # type: ignore[arg-type]


@pytest.mark.parametrize("step", ["prepare", "start", "wait", "delete"])
def test_runner_cleans_up_when_a_step_fails(tmp_path: Path, step: str) -> None:
    be = FakeBackend(fail=step)
    shim = FakeShim(NodePaths(tmp_path), be)
    with pytest.raises(OSError, match=f"{step} failed"):
        runner.run(shim, "e:1", None, sandbox="s", runtime="fake")  # type: ignore[arg-type]
    steps = [c[0] for c in be.calls]
    # once started (or trying to start), what the backend keeps is deleted; the sandbox goes
    assert ("delete" in steps) == (step != "prepare")
    assert shim.unmounted == ["s"]


def test_runner_with_a_backend_that_cannot_run(tmp_path: Path) -> None:
    be = FakeBackend(runnable=False)
    shim = FakeShim(NodePaths(tmp_path), be)
    with pytest.raises(RuntimeNotAvailable):
        runner.run(shim, "e:1", None, sandbox="s", runtime="fake", keep=True)  # type: ignore[arg-type]
    assert [c[0] for c in be.calls] == ["check"] and shim.unmounted == []


# -- the shim's and recovery's clean-up go through the seam ------------------------------------------
def test_shim_deletes_leftovers_through_its_backends(tmp_path: Path) -> None:
    a = FakeBackend(name="a", kept=["sb-1", "sb-2"])
    b = FakeBackend(name="b", kept=["sb-1"], runnable=False)
    with Shim(NodePaths(tmp_path / "node"), DirBlobs(tmp_path / "blobs"), auto_recover=False,
              backends={"a": a, "b": b}) as shim:
        assert shim.delete_containers("sb-1") == ["a", "b"]
        assert shim.delete_containers("sb-1") == []  # nothing left
        assert a.kept == ["sb-2"] and b.kept == []
        assert shim.backend("a") is a
        with pytest.raises(RuntimeNotAvailable, match="cannot run here"):
            shim.backend("b")
        with pytest.raises(RuntimeNotAvailable, match=r"unknown sandbox backend 'c' \(have: a, b\)"):
            shim.backend("c")


def test_recovery_deletes_leftovers_through_the_backends(tmp_path: Path) -> None:
    a = FakeBackend(name="a", kept=["gone", "also-gone"])
    b = FakeBackend(name="b", kept=["x"], runnable=False)  # cannot run here: its leftovers stay
    c = FakeBackend(name="c", kept=["y"], fail="delete")  # a failed delete is not reported
    with Shim(NodePaths(tmp_path / "node"), DirBlobs(tmp_path / "blobs"), auto_recover=False,
              backends={"a": a, "b": b, "c": c}) as shim:
        rep = shim.recover()
    assert rep.deleted_containers == ["a:also-gone", "a:gone"]
    assert a.kept == [] and b.kept == ["x"] and c.kept == ["y"]
    assert ("status", "gone") not in a.calls  # no live sandbox: its state is not even asked for
