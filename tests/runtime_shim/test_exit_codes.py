"""Issue 30: the same exit codes and signal delivery on every backend (container with runc, with
crun, microVM, VM). The workload is never PID 1 (a container's is tini's child, a VM's the guest
init's), so a workload that kills itself with SIGTERM exits 143 everywhere (before: 0 in a
container, whose PID 1 ignored it), its own exit code is the run's, a stop signal to the run
reaches the workload and ends the run with the same message on each backend, and a container's
init reaps orphans. With `--no-init` (`Confinement(init=False)`) a container's workload is PID 1.
Every wait has a generous deadline that only turns a hang into a failure.

VM boots are slow (TCG on this node kind): run the container cases first (`-k 'runc or crun'`).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from testkit.shim_support import (
    add_blob,
    busybox_image,
    busybox_rootfs,
    dir_shim,
    mkfs,
    needs_busybox,
    needs_runc,
    spec,
)
from testkit.vm_support import tcg

from runtime_shim.backends import signals
from runtime_shim.backends.base import Confinement
from runtime_shim.node.shim import Shim
from runtime_shim.sandbox import runner

pytestmark = [pytest.mark.root, needs_busybox]
needs_crun = pytest.mark.skipif(shutil.which("crun") is None or shutil.which("unshare") is None,
                                reason="needs crun and unshare (.ci/install-deps.sh)")
CONTAINERS = [pytest.param("runc", marks=needs_runc), pytest.param("crun", marks=needs_crun)]
VMS = [pytest.param("microvm", marks=pytest.mark.vm), pytest.param("vm", marks=pytest.mark.vm)]
CONF = Confinement(memory=256 << 20, cpus=1)  # (a VM's memory: the node default would be 1 GiB)
DEADLINE = 120.0  # seconds; only turns a hang into a failure (a TCG boot on a loaded machine)


@pytest.fixture(autouse=True)
def _tcg(monkeypatch: pytest.MonkeyPatch) -> None:
    tcg(monkeypatch)


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    return busybox_image(tmp_path_factory.mktemp("img"))


@pytest.fixture
def shim(tmp_path: Path, image: tuple[Path, str]) -> Iterator[Shim]:
    with dir_shim(tmp_path, image[0]) as s:  # (every registered backend)
        yield s


def run(shim: Shim, blob: str, backend: str, script: str, out: Path, sandbox: str | None = None,
        userns: bool | None = None, conf: Confinement = CONF) -> int:
    with open(out, "wb") as o:
        res = runner.run(shim, spec((blob, "base")), ["/bin/sh", "-c", script], runtime=backend, confinement=conf,
                         sandbox=sandbox, stdin=subprocess.DEVNULL, stdout=o, userns=userns)
    return res.exit_code


SCRIPTS = [("kill -TERM $$", 143), ("exit 7", 7), ("kill -INT $$", 130)]
# A VM boot is 10-15 s: the VMs run the case that differed (SIGTERM: 143 in a VM, 0 in a container before
# tini); `exit 7` is test_vm.py's exit-code test, and SIGINT takes the same way through the guest's init.
EXIT_CASES = [pytest.param(*b.values, *s, marks=b.marks) for b in CONTAINERS for s in SCRIPTS] + \
             [pytest.param(*b.values, *SCRIPTS[0], marks=b.marks) for b in VMS]


@pytest.mark.parametrize("backend,script,code", EXIT_CASES)
def test_the_exit_code_is_the_same_on_every_backend(shim: Shim, image: tuple[Path, str], tmp_path: Path,
                                                    backend: str, script: str, code: int) -> None:
    assert run(shim, image[1], backend, script, tmp_path / "out.txt") == code
    assert shim.sandboxes() == []


@pytest.mark.parametrize("backend", CONTAINERS)
def test_a_container_without_a_user_namespace_too(shim: Shim, image: tuple[Path, str], tmp_path: Path,
                                                 backend: str) -> None:
    """(The cases above take a user namespace where the node has one: the init's bind then is
    made inside it.)"""
    assert run(shim, image[1], backend, "kill -TERM $$", tmp_path / "out.txt", userns=False) == 143
    assert run(shim, image[1], backend, "exit 7", tmp_path / "out.txt", userns=False) == 7


@pytest.mark.parametrize("backend", CONTAINERS)
def test_with_no_init_the_workload_is_pid_1(shim: Shim, image: tuple[Path, str], tmp_path: Path,
                                           backend: str) -> None:
    """`--no-init` (an image with an init of its own): the workload is PID 1 of the container, and
    so the kernel drops a SIGTERM it has no handler for (what tini is there for by default)."""
    out = tmp_path / "out.txt"
    assert run(shim, image[1], backend, "echo $$", out) == 0
    assert out.read_text() != "1\n"  # (the default: tini's child)
    no_init = replace(CONF, init=False)
    assert run(shim, image[1], backend, "echo $$", out, conf=no_init) == 0
    assert out.read_text() == "1\n"
    assert run(shim, image[1], backend, "kill -TERM $$; echo alive", out, conf=no_init) == 0
    assert out.read_text() == "alive\n"
    assert shim.sandboxes() == []


def signal_when(ready: Callable[[], bool], done: threading.Event, then: Callable[[], None] | None = None) -> None:
    """Once `ready()`: `then()`, and SIGTERM to this process (in runner.run's wait, whose handler
    is in place by then). Gives up when `done` is set."""
    deadline = time.monotonic() + DEADLINE
    while not done.wait(0.05) and time.monotonic() < deadline:
        if ready():
            if then is not None:
                then()
            os.kill(os.getpid(), signal.SIGTERM)
            return


def main_thread_only() -> None:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are installed from the main thread only")


@pytest.mark.parametrize("backend", CONTAINERS + VMS)
def test_a_stop_signal_reaches_the_workload_on_every_backend(shim: Shim, image: tuple[Path, str], tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    """SIGTERM to the run: the workload's trap runs (before: a VM's QEMU was killed at once), then
    the run stops with the same message as on every backend. The grace is longer than the
    deadline: only the workload's own end ends the run in time."""
    main_thread_only()
    monkeypatch.setenv("LAYERSTORE_STOP_GRACE", str(10 * DEADLINE))
    out, sid, done = tmp_path / "out.txt", f"sig-{backend}", threading.Event()
    ready = lambda: out.exists() and b"ready" in out.read_bytes()  # noqa: E731
    sender = threading.Thread(target=signal_when, args=(ready, done), daemon=True)
    sender.start()
    try:
        with pytest.raises(signals.Stopped, match=f"^stopped by SIGTERM: sandbox {sid} stopped and removed$"):
            run(shim, image[1], backend, "trap 'echo got TERM; exit 42' TERM; echo ready; while :; do sleep 0.1; done",
                out, sandbox=sid)
    finally:
        done.set()
        sender.join()
    assert out.read_text() == "ready\ngot TERM\n"
    assert shim.sandboxes() == []


def children(pid: int) -> list[tuple[int, str, str]]:
    """`pid`'s children (host pid, state, command name), from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_bytes()
        except OSError:
            continue
        name = stat[stat.index(b"(") + 1:stat.rindex(b")")].decode(errors="replace")
        fields = stat[stat.rindex(b")") + 2:].split()
        if int(fields[1]) == pid:
            found.append((int(entry), fields[0].decode(), name))
    return found


@pytest.mark.parametrize("backend", CONTAINERS)
def test_the_containers_init_reaps_orphans(shim: Shim, image: tuple[Path, str], tmp_path: Path, backend: str) -> None:
    """An orphan is the child of the container's PID 1, which reaps it; the workload then is a
    program that reaps nothing (`sleep`). Before issue 30 that program was PID 1: the orphan
    stayed a zombie until the container ended."""
    main_thread_only()
    out, sid, done = tmp_path / "out.txt", f"zz-{backend}", threading.Event()
    seen: list[list[int]] = []

    def orphan_gone() -> bool:  # (its last act: a file in the sandbox's root, seen from the node)
        return (shim.paths.rootfs(sid) / "orphan-done").exists()

    def look() -> None:  # until the orphan (a subshell: "sh") has ended and nothing is a zombie
        init = int((shim.paths.bundle(sid) / "pid").read_text())
        deadline = time.monotonic() + DEADLINE
        while time.monotonic() < deadline:
            kids = children(init)
            if not [k for k in kids if k[1] == "Z" or k[2] == "sh"]:
                break
            time.sleep(0.05)
        seen.append([k[0] for k in children(init) if k[1] == "Z"])

    sender = threading.Thread(target=signal_when, args=(orphan_gone, done, look), daemon=True)
    sender.start()
    try:
        with pytest.raises(signals.Stopped):
            run(shim, image[1], backend, "sh -c '(sleep 0.2; touch /orphan-done) &'; echo ready; exec sleep 1000",
                out, sandbox=sid)
    finally:
        done.set()
        sender.join()
    assert seen == [[]], "an orphan stayed a zombie"


@pytest.mark.parametrize("backend", CONTAINERS)
@pytest.mark.parametrize("dev", ["a symlink to /etc", "a directory with an init"])
def test_an_image_cannot_shadow_or_replace_the_init(tmp_path: Path, backend: str, dev: str) -> None:
    """An image whose /dev is a symlink (to a directory holding an `init` of its own), or a
    directory holding one: the runtime's /dev tmpfs covers it, and the init is bound onto a file
    made in that tmpfs: the image's never runs. (A /dev symlink is resolved within the root, and
    runc then fails to make /dev/ptmx there, crun /dev/null: the run fails cleanly.)"""
    root = busybox_rootfs(tmp_path / "hostile")
    planted = (root / "etc") if dev.startswith("a symlink") else (root / "dev")
    if dev.startswith("a symlink"):
        (root / "dev").rmdir()
        (root / "dev").symlink_to("/etc")
    (planted / "init").write_text("#!/bin/sh\necho PLANTED INIT RAN\nexec \"$@\"\n")
    (planted / "init").chmod(0o755)
    blobs = tmp_path / "blobs"
    blob = add_blob(blobs, mkfs(root, tmp_path / "hostile.img"))
    out = tmp_path / "out.txt"
    with dir_shim(tmp_path, blobs) as shim:
        code = run(shim, blob, backend, "echo ran; kill -TERM $$", out)
        assert shim.sandboxes() == []
    ran = out.read_text()
    assert "PLANTED" not in ran
    assert (code, ran) == (143, "ran\n") or (dev.startswith("a symlink") and code == 1 and ran == ""), (code, ran)
